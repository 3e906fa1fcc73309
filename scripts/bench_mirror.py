#!/usr/bin/env python
"""Benchmark of origin egress for a fleet in several regions: mirrors against direct reads.

    .venv/bin/python scripts/bench_mirror.py                          # 12 nodes in 3 regions, 6 versions
    .venv/bin/python scripts/bench_mirror.py --nodes 24 --regions 4 --versions 10 --store local
    .venv/bin/python scripts/bench_mirror.py --json results.json

A Llama-shaped model (FP32 masters, BF16 served, synthetic AdamW steps, a keyframe every
``--keyframe-every`` versions) is published version by version to an origin store. A
fleet of ``--nodes`` subscribers, spread evenly over ``--regions`` regions, brings
itself to each version as ``Subscriber.follow`` would (a poll of the head, then a sync),
twice in the same run:

- the baseline: every node reads the origin directly;
- with mirrors: each region has a mirror following the origin (``bulletin.mirror``, one
  pass per new head, as ``Mirror.follow`` does), and each node reads its region's mirror
  first, the origin second (``Subscriber([mirror, origin], ...)``).

Every read the origin serves is counted by key (head, manifests, signatures, patch
shards and keyframe files; bytes and objects). Per version the script prints the
origin's egress both ways and the ratio; with mirrors each version's objects leave the
origin once per region (R times) instead of once per node (N times). Every node is
checked bit-exact (its fingerprints against the manifest's) after every version.
Memory stores by default (seconds); ``--store local`` uses local directories.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bulletin import Publisher, Subscriber  # noqa: E402
from bulletin.demo import SyntheticAdamW, llama_layout  # noqa: E402
from bulletin.mirror import Mirror  # noqa: E402
from bulletin.run import Run  # noqa: E402
from bulletin.storage import ObjectData, Store, drop_memory_bucket, open_store  # noqa: E402
from bulletin.storage.base import Downloaded  # noqa: E402
from bulletin.storage.wrapper import WrapperStore  # noqa: E402
from bulletin.target import ArrayTarget  # noqa: E402
from schemas.manifest import ObjectRef  # noqa: E402

RUN = "bench"


def kind_of(key: str) -> str:
    """What an object of the run is: head, manifest, signature or data (shards, keyframe files)."""
    relative = key.split("/", 1)[1] if "/" in key else key
    if relative == "head.json":
        return "head"
    return {"manifests": "manifest", "signatures": "signature"}.get(relative.split("/", 1)[0], "data")


class Egress(WrapperStore):
    """Counts what the wrapped store serves: reads per key, objects and bytes per kind, and
    requests (an unchanged conditional read is a request, no object)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.reads: Counter[str] = Counter()
            self.bytes: Counter[str] = Counter()
            self.requests = 0

    def _served(self, key: str, size: int | None) -> None:
        with self._lock:
            self.requests += 1
            if size is not None:
                self.reads[key] += 1
                self.bytes[kind_of(key)] += size

    def get(self, key: str, *, max_bytes: int | None = None) -> ObjectData:
        try:
            obj = super().get(key, max_bytes=max_bytes)
        except Exception:
            self._served(key, None)
            raise
        self._served(key, None if obj is None else len(obj.data))
        return obj

    def get_if_changed(self, key: str, etag: str | None, *, max_bytes: int | None = None) -> ObjectData | None:
        try:
            obj = super().get_if_changed(key, etag, max_bytes=max_bytes)
        except Exception:
            self._served(key, None)
            raise
        self._served(key, None if obj is None else len(obj.data))
        return obj

    def get_to_file(
        self, key: str, path: str | os.PathLike[str], *, sha256: str | None = None, max_bytes: int | None = None
    ) -> Downloaded:
        try:
            done = super().get_to_file(key, path, sha256=sha256, max_bytes=max_bytes)
        except Exception:
            self._served(key, None)
            raise
        self._served(key, done.size)  # keyframes stream to files: served all the same
        return done

    def data_reads(self) -> Counter[str]:
        """Reads of data objects (patch shards and keyframe files) only, by key."""
        with self._lock:
            return Counter({k: n for k, n in self.reads.items() if kind_of(k) == "data"})

    def stat(self, key: str) -> Any:
        with self._lock:
            self.requests += 1
        return super().stat(key)

    def list(self, prefix: str, *, start_after: str | None = None) -> Any:
        with self._lock:
            self.requests += 1
        return super().list(prefix, start_after=start_after)


@dataclass
class Side:
    """The origin's egress for one version, one way of serving the fleet."""

    requests: int = 0
    bytes: int = 0
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    data_objects: int = 0
    """Patch shards and keyframe files served (every copy counted)."""
    manifest_reads: int = 0
    reads_per_data_object: list[int] = field(default_factory=list)
    """How many times each of the version's data objects was served (sorted)."""

    @classmethod
    def of(cls, egress: Egress, data_keys: list[str], manifest_key: str) -> Side:
        return cls(
            requests=egress.requests,
            bytes=sum(egress.bytes.values()),
            bytes_by_kind=dict(egress.bytes),
            data_objects=sum(egress.data_reads().values()),
            manifest_reads=egress.reads[manifest_key],
            reads_per_data_object=sorted(egress.reads[k] for k in data_keys),
        )


@dataclass
class Row:
    version: int
    kind: str
    version_bytes: int
    """Bytes of the version's data objects (one copy)."""
    direct: Side
    mirrored: Side

    @property
    def bytes_ratio(self) -> float:
        return self.direct.bytes / max(1, self.mirrored.bytes)


def _stores(kind: str, root: Path, count: int) -> list[str]:
    if kind == "memory":
        return [f"memory://bench-mirror-{uuid.uuid4().hex}" for _ in range(count)]
    return [str(root / f"store-{i}") for i in range(count)]


def _refs(run: Run, version: int) -> list[ObjectRef]:
    """The data objects of ``version``: its patch shards and keyframe files."""
    manifest = run.read_manifest(version).manifest
    return list(manifest.patch.shards if manifest.patch else ()) + list(
        manifest.keyframe.files if manifest.keyframe else ()
    )


def _check(node: Subscriber, target: ArrayTarget, version: int, origin: Run) -> None:
    expected = dict(origin.read_manifest(version).manifest.fingerprints)
    if node.current_version != version or target.full_fingerprints() != expected:
        raise AssertionError(f"a node is not bit-exact at version {version}")


def measure(
    *,
    nodes: int = 12,
    regions: int = 3,
    versions: int = 6,
    params: float = 2e6,
    keyframe_every: int = 4,
    lr: float = 1.5e-7,
    store: str = "memory",
    seed: int = 0,
) -> dict[str, Any]:
    """Run both fleets through ``versions`` versions; the origin's egress per version."""
    if nodes < 1 or regions < 1 or regions > nodes or versions < 1:
        raise ValueError("need 1 <= regions <= nodes and versions >= 1")
    with tempfile.TemporaryDirectory(prefix="bench-mirror-") as tmp:
        urls = _stores(store, Path(tmp), 2 + regions)
        try:
            return _measure(urls, nodes, regions, versions, params, keyframe_every, lr, seed)
        finally:
            for url in urls:
                if url.startswith("memory://"):
                    drop_memory_bucket(url.removeprefix("memory://"))


def _measure(
    urls: list[str],
    nodes: int,
    regions: int,
    versions: int,
    params: float,
    keyframe_every: int,
    lr: float,
    seed: int,
) -> dict[str, Any]:
    direct_url, origin_url, *mirror_urls = urls
    rng = np.random.default_rng(seed)
    shapes = llama_layout(int(params))
    masters = {n: (rng.standard_normal(s, dtype=np.float32) * 0.02) for n, s in shapes.items()}
    optimizer = SyntheticAdamW(masters, rng, lr)
    optimizer.step()  # past Adam's first step, which moves every weight by lr
    # Both origins get the same versions: one publisher each, the same bits.
    publishers = [Publisher(url, RUN, keyframe_every=keyframe_every) for url in (direct_url, origin_url)]
    direct_egress, origin_egress = Egress(open_store(direct_url)), Egress(open_store(origin_url))
    direct_fleet = [ArrayTarget() for _ in range(nodes)]
    direct_subs = [Subscriber(direct_egress, RUN, target=t) for t in direct_fleet]
    mirrors = [Mirror(origin_egress, url, RUN) for url in mirror_urls]
    region_of = [i % regions for i in range(nodes)]
    mirrored_fleet = [ArrayTarget() for _ in range(nodes)]
    mirrored_subs = [
        Subscriber([open_store(mirror_urls[region_of[i]]), origin_egress], RUN, target=t)
        for i, t in enumerate(mirrored_fleet)
    ]
    direct_run, origin_run = Run(open_store(direct_url), RUN), Run(open_store(origin_url), RUN)
    rows: list[Row] = []
    for step in range(versions):
        if step:
            optimizer.step()
        for publisher in publishers:
            version = publisher.publish(masters)
        manifest = origin_run.read_manifest(version).manifest
        refs = _refs(origin_run, version)
        manifest_key = origin_run.key(f"manifests/{version:020d}.json")  # the same in both origins

        direct_egress.reset()
        for sub, target in zip(direct_subs, direct_fleet, strict=True):
            if sub.head_version() != sub.current_version:
                sub.sync()
            _check(sub, target, version, origin_run)
        # Keyframe folders are named by their writer: each origin's own keys.
        direct = Side.of(direct_egress, [direct_run.key(ref.key) for ref in _refs(direct_run, version)], manifest_key)

        origin_egress.reset()
        for mirror in mirrors:  # each region's mirror sees the new head and copies it
            mirror.sync()
        for sub, target in zip(mirrored_subs, mirrored_fleet, strict=True):
            if sub.head_version() != sub.current_version:
                sub.sync()
            _check(sub, target, version, origin_run)
        mirrored = Side.of(origin_egress, [origin_run.key(ref.key) for ref in refs], manifest_key)
        kind = "+".join(k for k, present in (("keyframe", manifest.keyframe), ("patch", manifest.patch)) if present)
        rows.append(Row(version, kind, sum(ref.size for ref in refs), direct, mirrored))
    for publisher in publishers:
        publisher.close()
    total = sum(int(np.prod(s)) for s in shapes.values())
    return {
        "nodes": nodes,
        "regions": regions,
        "versions": versions,
        "params": total,
        "dense_bf16_bytes": 2 * total,
        "rows": [asdict(r) | {"bytes_ratio": r.bytes_ratio} for r in rows],
        "direct_bytes": sum(r.direct.bytes for r in rows),
        "mirrored_bytes": sum(r.mirrored.bytes for r in rows),
        "direct_data_objects": sum(r.direct.data_objects for r in rows),
        "mirrored_data_objects": sum(r.mirrored.data_objects for r in rows),
    }


def per(side: dict[str, Any]) -> str:
    """How many times the version's data objects were served ("12": each twelve times)."""
    return "/".join(map(str, sorted(set(side["reads_per_data_object"])))) or "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=12)
    parser.add_argument("--regions", type=int, default=3)
    parser.add_argument("--versions", type=int, default=6)
    parser.add_argument("--params", type=float, default=2e6, help="model size in parameters")
    parser.add_argument("--keyframe-every", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1.5e-7)
    parser.add_argument("--store", choices=("memory", "local"), default="memory")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    result = measure(
        nodes=args.nodes,
        regions=args.regions,
        versions=args.versions,
        params=args.params,
        keyframe_every=args.keyframe_every,
        lr=args.lr,
        store=args.store,
    )
    n, r = result["nodes"], result["regions"]
    print(
        f"model: {result['params'] / 1e6:.1f}M parameters ({result['dense_bf16_bytes'] / 2**20:.1f} MiB BF16); "
        f"{n} nodes in {r} regions; {args.store} stores"
    )
    print(
        f"{'ver':>3} {'kind':<15} {'version B':>10} | {'direct B':>11} {'obj':>4} {'x/obj':>6} | "
        f"{'mirrored B':>11} {'obj':>4} {'x/obj':>6} | {'bytes x':>7}"
    )
    for row in result["rows"]:
        d, m = row["direct"], row["mirrored"]
        print(
            f"{row['version']:>3} {row['kind']:<15} {row['version_bytes']:>10} | {d['bytes']:>11} "
            f"{d['data_objects']:>4} {per(d):>6} | {m['bytes']:>11} {m['data_objects']:>4} {per(m):>6} | "
            f"{row['bytes_ratio']:>6.2f}x"
        )
    direct_b, mirrored_b = result["direct_bytes"], result["mirrored_bytes"]
    patch_rows = [row for row in result["rows"] if row["kind"] == "patch"]
    patches_direct = sum(row["direct"]["bytes"] for row in patch_rows)
    patches_mirrored = sum(row["mirrored"]["bytes"] for row in patch_rows)
    needed = sorted({x for row in result["rows"] for x in row["direct"]["reads_per_data_object"] if x})
    mirrored = sorted({x for row in result["rows"] for x in row["mirrored"]["reads_per_data_object"]})
    print(
        f"total origin egress: direct {direct_b} B ({result['direct_data_objects']} data objects), with mirrors "
        f"{mirrored_b} B ({result['mirrored_data_objects']} data objects): {direct_b / max(1, mirrored_b):.2f}x "
        f"less; patch versions alone {patches_direct / max(1, patches_mirrored):.2f}x less (N/R = {n / r:.2f})"
    )
    print(
        f"each data object a node needed left the origin {needed} time(s) direct (N = {n}), every data object "
        f"{mirrored} time(s) with mirrors (R = {r}); a keyframe the fleet skipped (it took the patch) left it "
        "0 times direct and R times with mirrors, which hold every object of each version they show"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
