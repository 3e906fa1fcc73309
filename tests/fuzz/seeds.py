"""Seed shards for the fuzzers: the golden files plus a few encoded on the spot."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from patcher.encode import encode
from patcher.patch import Patch, TensorDelta, TensorSpec

__all__ = ["seed_shards"]

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def _patch() -> Patch:
    rng = np.random.default_rng(0)
    out = {}
    for i, (dtype, n) in enumerate([("BF16", 5000), ("F32", 100), ("U8", 0), ("F64", 1)]):
        spec = TensorSpec(f"layers.{i}.w", dtype, (n,))
        k = n // 20 if n > 1 else n
        idx = np.sort(rng.choice(n, k, replace=False)).astype(np.int64) if k else np.empty(0, np.int64)
        bits = spec.bits_dtype
        delta = rng.integers(1, np.iinfo(bits).max, k, dtype=bits, endpoint=True)
        delta[: k // 2] = 1
        out[spec.name] = TensorDelta(spec, idx, delta, i, i + 1 if k else i)
    return Patch(out)


def seed_shards() -> list[bytes]:
    """Valid shards covering both codecs, split tensors and every golden case."""
    seeds = sorted((p.read_bytes() for p in GOLDEN.glob("v*/*.shard")), key=len)
    patch = _patch()
    seeds += encode(patch, codec="zstd")
    seeds += encode(patch, codec="lz4")
    seeds += encode(patch, max_shard_bytes=900)
    return seeds
