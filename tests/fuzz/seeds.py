"""Seed shards for the fuzzers: the golden files plus a few encoded on the spot."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from patcher.encode import encode
from patcher.fingerprint import fingerprint
from patcher.patch import Patch, TensorDelta, TensorSpec

__all__ = ["fuzz_base", "seed_shards"]

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


def fuzz_base(spec: TensorSpec) -> NDArray[np.unsignedinteger]:
    """The bits the fuzzers hold for a tensor: fixed by its name and layout, varied enough
    that a context-coded shard's classes are all in use. The context-coded seeds are
    coded against them."""
    rng = np.random.default_rng(zlib.crc32(f"{spec.name}/{spec.dtype}/{spec.shape}".encode()))
    bd = spec.bits_dtype
    bits = rng.integers(0, np.iinfo(bd).max, size=spec.numel, dtype=bd, endpoint=True)
    return bits.reshape(spec.shape)


def seed_shards() -> list[bytes]:
    """Valid shards covering every codec, split tensors and the golden cases whose base
    is :func:`fuzz_base` (every one but the context-coded ones)."""
    seeds = sorted((p.read_bytes() for p in GOLDEN.glob("v*/*.shard") if "context" not in p.name), key=len)
    patch = _patch()
    seeds += encode(patch, codec="zstd")
    seeds += encode(patch, codec="lz4")
    seeds += encode(patch, max_shard_bytes=900)
    base = {td.spec.name: fuzz_base(td.spec) for td in patch}
    context = Patch({name: _rebased(td) for name, td in patch.tensors.items()})
    seeds += encode(context, codec="context", base=base)
    seeds += encode(context, codec="context", base=base, max_shard_bytes=700)
    return seeds


def _rebased(td: TensorDelta) -> TensorDelta:
    """``td`` with fingerprints true of :func:`fuzz_base` and of it after ``td``."""
    base = fuzz_base(td.spec).reshape(-1)
    after = base.copy()
    after[td.indices] += td.delta
    return TensorDelta(td.spec, td.indices, td.delta, fingerprint(base), fingerprint(after))
