#!/usr/bin/env python
"""Benchmark of publish and sync through S3 (LocalStack), against full checkpoints.

    .venv/bin/python scripts/bench_sync.py                    # starts LocalStack itself
    .venv/bin/python scripts/bench_sync.py --endpoint http://127.0.0.1:4566 --params 50e6
    .venv/bin/python scripts/bench_sync.py --json results.json

A Llama-shaped model (FP32 masters, BF16 served) takes AdamW steps on synthetic
gradients at a learning rate chosen so that about 0.35% of the BF16 weights change
per step (the share measured on real fine-tuning at lr 1e-6). For every version it
prints the bytes uploaded by the publisher and downloaded by a following subscriber
(every request counted, manifests and head included), and the wall time of publish
and of sync, next to the baseline measured in the same run against the same server:
a plain upload and download of the version's full BF16 safetensors checkpoint. Then
the cost of an idle poll (one conditional GET of the head), in requests and in bytes
on the wire, counted by a loopback TCP proxy in front of the server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import boto3
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bulletin import Publisher, Subscriber  # noqa: E402
from bulletin.checkpoint import plan_checkpoint, safetensors_bytes  # noqa: E402
from bulletin.demo import SyntheticAdamW, llama_layout  # noqa: E402
from bulletin.snapshot import snapshot  # noqa: E402
from bulletin.storage import open_store  # noqa: E402
from bulletin.storage.wrapper import CountingStore  # noqa: E402
from bulletin.target import ArrayTarget  # noqa: E402


class CountingProxy:
    """A loopback TCP proxy that counts the bytes of every connection, both ways."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sent = 0  # client -> server
        self.received = 0  # server -> client
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while chunk := src.recv(65536):
                with self.lock:
                    if upstream:
                        self.sent += len(chunk)
                    else:
                        self.received += len(chunk)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def reset(self) -> tuple[int, int]:
        with self.lock:
            seen = (self.sent, self.received)
            self.sent = self.received = 0
        return seen

    def close(self) -> None:
        self.listener.close()


@dataclass
class VersionRow:
    version: int
    kind: str
    changed_pct: float
    publish_up_bytes: int
    publish_requests: int
    publish_s: float
    sync_down_bytes: int
    sync_requests: int
    sync_s: float
    full_bytes: int
    full_upload_s: float
    full_download_s: float

    @property
    def bytes_ratio(self) -> float:
        return (2 * self.full_bytes) / max(1, self.publish_up_bytes + self.sync_down_bytes)


def start_localstack() -> str:
    subprocess.run([str(ROOT / "localstack" / "install.sh")], check=True)
    out = subprocess.run([str(ROOT / "localstack" / "start.sh")], check=True, capture_output=True, text=True)
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", help="S3 endpoint (default: start LocalStack with localstack/start.sh)")
    parser.add_argument("--params", type=float, default=100e6, help="model size in parameters")
    parser.add_argument("--versions", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1.5e-7)
    parser.add_argument("--keyframe-every", type=int, default=100)
    parser.add_argument("--polls", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    endpoint = args.endpoint or start_localstack()
    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test")):
        os.environ.setdefault(name, value)  # LocalStack takes any credentials
    bucket = f"bench-sync-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    url = f"s3://{bucket}?endpoint_url={endpoint}&region=us-east-1"
    rng = np.random.default_rng(0)
    shapes = llama_layout(int(args.params))
    masters = {n: (rng.standard_normal(s, dtype=np.float32) * 0.02) for n, s in shapes.items()}
    for name, w in masters.items():
        if name.endswith("norm.weight"):
            w[...] = 1.0
    optimizer = SyntheticAdamW(masters, rng, args.lr)
    optimizer.step()  # past Adam's first step, which moves every weight by lr
    total = sum(int(np.prod(s)) for s in shapes.values())
    print(f"model: {total / 1e6:.1f}M parameters ({2 * total / 2**20:.0f} MiB BF16), server {endpoint}")

    pub_store = CountingStore(open_store(url))
    sub_store = CountingStore(open_store(url))
    publisher = Publisher(pub_store, "bench", keyframe_every=args.keyframe_every)
    subscriber = Subscriber(sub_store, "bench", target=ArrayTarget())
    rows: list[VersionRow] = []
    print(
        f"{'ver':>3} {'kind':<9} {'chg %':>6} {'up bytes':>12} {'down bytes':>12} {'pub s':>6} {'sync s':>6}"
        f" | {'full bytes':>12} {'up s':>6} {'down s':>6} | {'bytes x':>8}"
    )
    for i in range(args.versions):
        if i:
            optimizer.step()
        pub_store.reset()
        t0 = time.perf_counter()
        version = publisher.publish(masters)
        publish_s = time.perf_counter() - t0
        published = pub_store.reset()
        result = publisher.results[-1]

        sub_store.reset()
        t0 = time.perf_counter()
        subscriber.sync()
        sync_s = time.perf_counter() - t0
        synced = sub_store.reset()

        # Baseline: the same version as one plain safetensors checkpoint, up and down.
        snap = snapshot(masters)
        ((_, shard),) = plan_checkpoint(snap.specs, 1 << 62)
        full = safetensors_bytes(shard, snap.bits)
        key = f"baseline/{version}.safetensors"
        t0 = time.perf_counter()
        client.put_object(Bucket=bucket, Key=key, Body=full)
        full_up_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        full_down_s = time.perf_counter() - t0
        assert len(body) == len(full)
        kind = "keyframe" if result.version == 1 else ("key+patch" if result.keyframe else "patch")
        row = VersionRow(
            version=version,
            kind=kind,
            changed_pct=100 * result.changed_elements / result.total_elements,
            publish_up_bytes=published.up,
            publish_requests=published.requests,
            publish_s=publish_s,
            sync_down_bytes=synced.down,
            sync_requests=synced.requests,
            sync_s=sync_s,
            full_bytes=len(full),
            full_upload_s=full_up_s,
            full_download_s=full_down_s,
        )
        rows.append(row)
        print(
            f"{row.version:>3} {row.kind:<9} {row.changed_pct:>6.3f} {row.publish_up_bytes:>12,} "
            f"{row.sync_down_bytes:>12,} {row.publish_s:>6.2f} {row.sync_s:>6.2f} | {row.full_bytes:>12,} "
            f"{row.full_upload_s:>6.2f} {row.full_download_s:>6.2f} | {row.bytes_ratio:>7.1f}x"
        )
    publisher.close()

    # The idle poll, on the wire: a fresh subscriber through a counting proxy.
    host, port = endpoint.split("://", 1)[1].split(":")
    proxy = CountingProxy((host, int(port)))
    proxied = CountingStore(open_store(f"s3://{bucket}?endpoint_url=http://127.0.0.1:{proxy.port}&region=us-east-1"))
    idle = Subscriber(proxied, "bench", target=ArrayTarget())
    idle.head_version()  # first poll fetches the head; later ones are conditional
    time.sleep(0.2)
    proxy.reset()
    proxied.reset()
    t0 = time.perf_counter()
    for _ in range(args.polls):
        idle.head_version()
    poll_s = (time.perf_counter() - t0) / args.polls
    time.sleep(0.2)
    sent, received = proxy.reset()
    polled = proxied.reset()
    proxy.close()

    patches = [r for r in rows if r.kind == "patch"]
    summary: dict[str, Any] = {
        "params": total,
        "full_checkpoint_bytes": rows[0].full_bytes,
        "versions": [asdict(r) | {"bytes_ratio": r.bytes_ratio} for r in rows],
        "patch_versions_mean_changed_pct": float(np.mean([r.changed_pct for r in patches])) if patches else None,
        "patch_versions_bytes_ratio": (
            sum(2 * r.full_bytes for r in patches) / sum(r.publish_up_bytes + r.sync_down_bytes for r in patches)
            if patches
            else None
        ),
        "patch_publish_s_mean": float(np.mean([r.publish_s for r in patches])) if patches else None,
        "patch_sync_s_mean": float(np.mean([r.sync_s for r in patches])) if patches else None,
        "full_upload_plus_download_s_mean": float(np.mean([r.full_upload_s + r.full_download_s for r in rows])),
        "idle_poll": {
            "requests_per_poll": polled.requests / args.polls,
            "body_bytes_per_poll": polled.down / args.polls,
            "wire_bytes_sent_per_poll": sent / args.polls,
            "wire_bytes_received_per_poll": received / args.polls,
            "seconds_per_poll": poll_s,
        },
    }
    p = summary["idle_poll"]
    print(
        f"patch versions: {summary['patch_versions_mean_changed_pct']:.3f}% changed, "
        f"{summary['patch_versions_bytes_ratio']:.0f}x fewer bytes (up + down) than full checkpoints; "
        f"publish {summary['patch_publish_s_mean']:.2f}s + sync {summary['patch_sync_s_mean']:.2f}s vs "
        f"full upload + download {summary['full_upload_plus_download_s_mean']:.2f}s"
    )
    print(
        f"idle poll: {p['requests_per_poll']:.0f} request, {p['body_bytes_per_poll']:.0f} body bytes, "
        f"{p['wire_bytes_sent_per_poll']:.0f} B sent + {p['wire_bytes_received_per_poll']:.0f} B received "
        f"on the wire, {1000 * p['seconds_per_poll']:.1f} ms"
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
