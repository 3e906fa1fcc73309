#!/usr/bin/env python
"""Benchmark of large-object transfers: Bulletin's streamed store methods against boto3 and ``cp``.

    .venv/bin/python scripts/bench_transfer.py --endpoint http://127.0.0.1:4566     # 64 and 512 MiB
    .venv/bin/python scripts/bench_transfer.py --endpoint URL --sizes 64,512,2048 --repeat 5

For each file size (MiB of random bytes, written once), in the same run:

- **S3** (any endpoint, LocalStack here): ``S3Store.put_file_if_absent`` (create-only
  multipart upload) and ``S3Store.get_to_file`` (parallel ranged GETs, SHA-256 verified,
  fsynced) next to boto3's ``upload_file`` / ``download_file`` with ``TransferConfig()``
  defaults, and ``download_file`` followed by an fsync (what ``get_to_file`` guarantees);
- **local**: ``LocalStore.put_file_if_absent`` and ``get_to_file`` next to ``cp`` followed
  by an fsync of the copy.

Each transfer runs in a fresh process, so that its peak RSS (``VmHWM``) is its own; the
figure printed is the peak above the process's RSS once its imports are done. Times are
wall clock of the call alone. The transfers take turns: each of ``--repeat`` rounds runs
every one of them once, so load from other jobs falls on all alike; the best and the
median of the rounds are printed. Ratios are baseline time / Bulletin time (best to best,
median to median): above 1.0 means Bulletin is faster. Every download is compared with the
source's SHA-256.

HTTPS: LocalStack serves it on the same port with a self-signed certificate issued to
``localhost``; trust it for both clients with ``AWS_CA_BUNDLE``:

    AWS_CA_BUNDLE=$LOCALSTACK_RUN_DIR/data/var/lib/localstack/cache/server.test.pem.crt \
        .venv/bin/python scripts/bench_transfer.py --endpoint https://localhost:4566
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

MIB = 1 << 20


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _boto3_client(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def child(args: argparse.Namespace) -> None:
    """One transfer in this process; prints JSON: seconds and peak RSS above the baseline."""
    from bulletin.storage import LocalStore, S3Store

    op, src, dst, key = args.op, args.src, args.dst, args.key
    store: Any = None
    client: Any = None
    if op.startswith("bulletin-s3"):
        store = S3Store(args.bucket, endpoint_url=args.endpoint, region="us-east-1")
    elif op.startswith("bulletin-local"):
        store = LocalStore(args.local_root)
    elif op.startswith("boto3"):
        from boto3.s3.transfer import TransferConfig

        client = _boto3_client(args.endpoint)
        config = TransferConfig()
    baseline = _rss_kib("VmRSS")
    started = time.perf_counter()
    if op in {"bulletin-s3-up", "bulletin-local-up"}:
        store.put_file_if_absent(key, src)
    elif op in {"bulletin-s3-down", "bulletin-local-down"}:
        store.get_to_file(key, dst, sha256=args.sha256)
    elif op == "boto3-up":
        client.upload_file(src, args.bucket, key, Config=config)
    elif op == "boto3-down":
        client.download_file(args.bucket, key, dst, Config=config)
    elif op == "boto3-down-fsync":
        client.download_file(args.bucket, key, dst, Config=config)
        _fsync(dst)
    elif op == "cp-fsync":
        subprocess.run(["cp", src, dst], check=True)
        _fsync(dst)
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "peak_mib": (_rss_kib("VmHWM") - baseline) / 1024}))


def _run(op: str, **options: str) -> dict[str, float]:
    argv = [sys.executable, __file__, "--child", op]
    for name, value in options.items():
        argv += [f"--{name.replace('_', '-')}", value]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 * MIB):
            digest.update(chunk)
    return digest.hexdigest()


def _rounds(
    ops: list[tuple[str, str, str, bool]], repeat: int, dst: Path, digest: str, common: dict[str, str]
) -> dict[str, list[dict[str, float]]]:
    """Every op of ``ops`` (name, child op, key pattern with ``{n}`` for the round, whether it
    writes ``dst``) once per round, in turn, ``repeat`` rounds: a burst of load from other
    jobs on the machine then falls on every transfer alike, not on one method's runs."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, *_ in ops}
    for n in range(repeat):
        for name, op, key, writes in ops:
            runs[name].append(_run(op, key=key.format(n=n), dst=str(dst if writes else "unused"), **common))
            if writes:
                assert _sha256(dst) == digest, f"{op}: wrong bytes"
                dst.unlink()
    return runs


def _row(name: str, size_mib: int, runs: list[dict[str, float]], base: list[dict[str, float]] | None) -> str:
    """Best and median of the runs; the ratios are the baseline's over these (best to best,
    median to median); peak RSS is the largest of the runs."""
    best = min(r["seconds"] for r in runs)
    median = statistics.median(r["seconds"] for r in runs)
    peak = max(r["peak_mib"] for r in runs)
    ratio = ""
    if base is not None:
        base_best = min(r["seconds"] for r in base)
        base_median = statistics.median(r["seconds"] for r in base)
        ratio = f"{base_best / best:6.2f}x {base_median / median:6.2f}x"
    return f"  {name:<38} {best:7.2f} s {median:7.2f} s {size_mib / best:8.1f} MiB/s {peak:7.1f} MiB  {ratio}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", default=os.environ.get("BULLETIN_TEST_S3_ENDPOINT"))
    parser.add_argument("--sizes", default="64,512", help="file sizes in MiB, comma-separated")
    parser.add_argument("--repeat", type=int, default=1, help="rounds; each runs every transfer once, in turn")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--child", dest="op", default=None, help=argparse.SUPPRESS)
    for hidden in ("src", "dst", "key", "bucket", "local-root", "sha256"):
        parser.add_argument(f"--{hidden}", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.op:
        child(args)
        return
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-transfer-") as scratch:
        root = Path(scratch)
        bucket = f"bench-transfer-{uuid.uuid4().hex[:12]}"
        if args.endpoint:
            _boto3_client(args.endpoint).create_bucket(Bucket=bucket)
        print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores here are shared with other jobs)")
        print(
            f"{'transfer':<40} {'best':>9} {'median':>9} {'speed (best)':>14} {'peak RSS':>11}"
            f"  {'baseline/bulletin (best, median)'}"
        )
        for size in sizes:
            src = root / f"src-{size}"
            with src.open("wb") as f:
                for _ in range(size):
                    f.write(os.urandom(MIB))
            digest = _sha256(src)
            common = {"src": str(src), "bucket": bucket, "sha256": digest, "local_root": str(root / "local-store")}
            if args.endpoint:
                common["endpoint"] = args.endpoint
            print(f"{size} MiB, {args.repeat} rounds")
            dst = root / "dst"
            ops: list[tuple[str, str, str, bool]] = []
            if args.endpoint:
                ops += [
                    ("s3-up", "bulletin-s3-up", f"b-{size}-{{n}}", False),
                    ("boto3-up", "boto3-up", f"o-{size}-{{n}}", False),
                    ("s3-down", "bulletin-s3-down", f"b-{size}-0", True),
                    ("boto3-down", "boto3-down", f"o-{size}-0", True),
                    ("boto3-down-fsync", "boto3-down-fsync", f"o-{size}-0", True),
                ]
            ops += [
                ("local-up", "bulletin-local-up", f"l-{size}-{{n}}", False),
                ("local-down", "bulletin-local-down", f"l-{size}-0", True),
                ("cp", "cp-fsync", "-", True),
            ]
            runs = _rounds(ops, args.repeat, dst, digest, common)
            if args.endpoint:
                print(_row("S3 upload: boto3 upload_file", size, runs["boto3-up"], None))
                print(_row("S3 upload: S3Store.put_file_if_absent", size, runs["s3-up"], runs["boto3-up"]))
                print(_row("S3 download: boto3 download_file", size, runs["boto3-down"], None))
                print(_row("S3 download: boto3 + fsync", size, runs["boto3-down-fsync"], None))
                print(_row("S3 download: S3Store.get_to_file", size, runs["s3-down"], runs["boto3-down"]))
                print(_row("  get_to_file vs boto3 + fsync", size, runs["s3-down"], runs["boto3-down-fsync"]))
            print(_row("local: cp + fsync", size, runs["cp"], None))
            print(_row("local: LocalStore.put_file_if_absent", size, runs["local-up"], runs["cp"]))
            print(_row("local: LocalStore.get_to_file", size, runs["local-down"], runs["cp"]))
            src.unlink()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
