"""The fixed patches behind the golden shard files (see README.md next to this file).

Data come from a splitmix64 counter in plain Python integers, not from NumPy's random
generators, so the same patches can be rebuilt by any future version of anything.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from patcher.diff import diff
from patcher.fingerprint import format_fingerprint
from patcher.patch import Patch, TensorDelta, TensorSpec

__all__ = ["CASES", "GoldenCase", "build", "build_base", "library_versions", "summarise"]

_MASK = (1 << 64) - 1


def _stream(seed: int, n: int) -> list[int]:
    """``n`` pseudo-random 64-bit words (splitmix64)."""
    out, x = [], seed & _MASK
    for _ in range(n):
        x = (x + 0x9E3779B97F4A7C15) & _MASK
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        out.append(z ^ (z >> 31))
    return out


def _pair(seed: int, name: str, dtype: str, shape: tuple[int, ...], every: int) -> tuple[TensorSpec, Any, Any]:
    """Old bits and new bits where about one element in ``every`` changed."""
    spec = TensorSpec(name, dtype, shape)
    bd = spec.bits_dtype
    n = spec.numel
    words = _stream(seed, 2 * n)
    bits = 8 * bd.itemsize
    old = np.array([w >> (64 - bits) for w in words[:n]], dtype=np.uint64).astype(bd)
    new = old.copy()
    steps = [1, (1 << bits) - 1, 2, (1 << bits) - 2, 3, 1 << (bits - 1), 0x55]
    for i, w in enumerate(words[n:]):
        if w % every == 0:
            new[i] = (int(old[i]) + steps[(w >> 8) % len(steps)]) & ((1 << bits) - 1)
    return spec, old.reshape(shape), new.reshape(shape)


def _mixed() -> Patch:
    return diff(*_mixed_pair())


def _mixed_pair() -> tuple[dict[str, TensorSpec], dict[str, Any], dict[str, Any]]:
    layout = [
        ("blocks.0.attn.weight", "BF16", (24, 32), 7),
        ("blocks.0.attn.bias", "F32", (32,), 3),
        ("blocks.0.norm.weight", "F16", (32,), 1 << 62),  # unchanged
        ("embed.weight", "U8", (40, 8), 11),
        ("step", "I64", (), 1),  # 0-d, changed
        ("mask", "BOOL", (16,), 4),
        ("empty", "F8_E4M3", (0, 3), 1),
        ("fp8.scale", "F8_E5M2", (9,), 2),
        ("wide", "F64", (5,), 2),
    ]
    specs, old, new = {}, {}, {}
    for seed, (name, dtype, shape, every) in enumerate(layout, start=1):
        spec, a, b = _pair(seed, name, dtype, shape, every)
        if dtype == "F32":  # NaN payload, -0.0 and Inf, exactly
            b.view(np.uint32)[:3] = [0x7FC00001, 0x80000000, 0x7F800000]
        specs[name], old[name], new[name] = spec, a, b
    return specs, old, new


def _split() -> Patch:
    return diff(*_split_pair())


def _split_pair() -> tuple[dict[str, TensorSpec], dict[str, Any], dict[str, Any]]:
    spec, a, b = _pair(99, "layers.0.mlp.up_proj.weight", "BF16", (3000,), 10)
    return {spec.name: spec}, {spec.name: a}, {spec.name: b}


def _sparse_huge() -> Patch:
    # 2**34 elements: gaps wider than 32 bits; built directly, nothing that size exists.
    spec = TensorSpec("huge.table", "U8", (1 << 17, 1 << 17))
    indices = np.array([7, 7 + (1 << 33) + 5, (1 << 34) - 1], dtype=np.int64)
    delta = np.array([1, 255, 128], dtype=np.uint8)
    return Patch({spec.name: TensorDelta(spec, indices, delta, 0x0123456789ABCDEF, 0xFEDCBA9876543210)})


@dataclass(frozen=True)
class GoldenCase:
    """One golden artefact: a fixed patch and the encode arguments that wrote it."""

    name: str
    patch: str
    codec: str
    level: int | None = None
    max_shard_bytes: int = 1 << 62


CASES = (
    GoldenCase("mixed-zstd", "mixed", "zstd"),
    GoldenCase("mixed-lz4", "mixed", "lz4"),
    GoldenCase("mixed-lz4hc", "mixed", "lz4", level=9),
    GoldenCase("split-zstd", "split", "zstd", max_shard_bytes=900),
    GoldenCase("sparse-huge-zstd19", "sparse_huge", "zstd", level=19),
    # The context codec (FORMAT.md 3.15): decoded against the base bits stored beside it;
    # their headers at zstd level 19 (the writer's default until it became 15).
    GoldenCase("mixed-context", "mixed", "context", level=19),
    GoldenCase("split-context", "split", "context", level=19, max_shard_bytes=800),
)

_PATCHES = {"mixed": _mixed, "split": _split, "sparse_huge": _sparse_huge}
_BASES = {"mixed": _mixed_pair, "split": _split_pair}


def build(case: GoldenCase) -> Patch:
    """The patch of ``case``."""
    return _PATCHES[case.patch]()


def build_base(case: GoldenCase) -> dict[str, Any] | None:
    """The bits ``case``'s patch was made from, for a context-coded case (else None)."""
    return _BASES[case.patch]()[1] if case.codec == "context" else None


def library_versions() -> dict[str, str]:
    """Versions whose output bytes the golden files depend on."""
    import lz4
    import zstandard

    return {
        "libzstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
        "zstandard": zstandard.__version__,
        "liblz4": lz4.library_version_string(),
        "lz4": lz4.__version__,
    }


def summarise(patch: Patch) -> dict[str, Any]:
    """The decoded content of a patch, in a form that survives any future refactor."""
    return {
        name: {
            "dtype": td.spec.dtype,
            "shape": list(td.spec.shape),
            "base": format_fingerprint(td.base_fingerprint),
            "target": format_fingerprint(td.target_fingerprint),
            "changed": td.changed,
            "indices_sha256": hashlib.sha256(td.indices.astype("<i8").tobytes()).hexdigest(),
            "delta_sha256": hashlib.sha256(td.delta.astype(td.delta.dtype.newbyteorder("<")).tobytes()).hexdigest(),
        }
        for name, td in sorted(patch.tensors.items())
    }
