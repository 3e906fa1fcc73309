"""Shared helpers of the codec tests: tensor generators, patch equality, a shard forger."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
from hypothesis import strategies as st
from numpy.typing import NDArray

from patcher.dtypes import DTYPE_WIDTHS, bits_dtype
from patcher.fingerprint import fingerprint
from patcher.format import (
    FILE_TYPE_PATCH_SHARD,
    FIXED_HEADER,
    FIXED_HEADER_SIZE,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    HEADER_CRC_OFFSET,
    MAGIC,
    canonical_json,
)
from patcher.patch import Patch, TensorDelta, TensorSpec

DTYPES = sorted(DTYPE_WIDTHS)

#: Bit patterns that must survive exactly: infinities, NaN payloads, -0.0, subnormals.
SPECIAL_BITS: dict[str, list[int]] = {
    "F16": [0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF, 0x8000, 0x0001],
    "BF16": [0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x8000, 0x0001],
    "F32": [0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x80000000, 1],
    "F64": [0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000001, 0xFFFFFFFFFFFFFFFF, 1 << 63, 1],
    "F8_E4M3": [0x7F, 0xFF, 0x80, 0x01],
    "F8_E5M2": [0x7C, 0xFC, 0x7D, 0x80, 0x01],
}

DENSITIES = [0.0, 0.001, 0.01, 0.5, 1.0]


def random_bits(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> NDArray[np.unsignedinteger]:
    """Uniformly random bits of ``dtype`` with a sprinkling of its special values."""
    bd = bits_dtype(dtype)
    out = rng.integers(0, np.iinfo(bd).max, size=shape, dtype=bd, endpoint=True)
    flat = out.reshape(-1)
    specials = [*SPECIAL_BITS.get(dtype, []), 0, int(np.iinfo(bd).max), 1 << 8 * bd.itemsize - 1]
    if flat.size:
        where = rng.integers(0, flat.size, size=min(flat.size, len(specials)))
        flat[where] = np.array(specials[: where.size], dtype=bd)
    return out


def mutate(
    rng: np.random.Generator, old: NDArray[np.unsignedinteger], density: float, dtype: str
) -> NDArray[np.unsignedinteger]:
    """``old`` with about ``density`` of its elements changed, mostly by +-1 ULP."""
    new = old.copy()
    flat = new.reshape(-1)
    n = flat.size
    if n == 0 or density == 0:
        return new
    k = max(1, round(n * density)) if density < 1 else n
    where = rng.choice(n, size=k, replace=False)
    bd = flat.dtype
    kind = rng.integers(0, 10, size=k)
    small = rng.choice(np.array([1, -1, 2, -2, 3, -3], dtype=np.int64), size=k)
    step = np.where(kind < 8, small, rng.integers(1, 1 << 62, size=k)).astype(np.uint64)
    flat[where] = flat[where] + step.astype(bd)
    # Special values arrive too (a NaN appears, an Inf goes back to finite).
    specials = SPECIAL_BITS.get(dtype, [1 << (8 * bd.itemsize - 1)])
    some = where[: min(k, 3)]
    flat[some] = np.array(specials[: some.size], dtype=bd)
    return new


@st.composite
def tensor_cases(draw: st.DrawFn, dtypes: list[str] = DTYPES) -> tuple[TensorSpec, Any, Any]:
    """(spec, old bits, new bits) for one tensor of any dtype, shape and density."""
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(
        st.one_of(
            st.just(()),
            st.tuples(st.integers(0, 3000)),
            st.tuples(st.integers(0, 40), st.integers(0, 70)),
            st.tuples(st.integers(1, 5), st.integers(1, 7), st.integers(1, 9)),
        )
    )
    density = draw(st.sampled_from(DENSITIES))
    seed = draw(st.integers(0, 2**32 - 1))
    name = draw(st.from_regex(r"[a-z]{1,8}(\.[a-z0-9_]{1,6}){0,3}", fullmatch=True))
    rng = np.random.default_rng(seed)
    old = random_bits(rng, dtype, shape)
    new = mutate(rng, old, density, dtype)
    return TensorSpec(name, dtype, shape), old, new


@st.composite
def model_cases(draw: st.DrawFn, max_tensors: int = 6) -> tuple[dict[str, TensorSpec], dict[str, Any], dict[str, Any]]:
    """A small model: specs, old bits and new bits by name (unique names)."""
    cases = draw(st.lists(tensor_cases(), min_size=0, max_size=max_tensors, unique_by=lambda c: c[0].name))
    specs = {c[0].name: c[0] for c in cases}
    return specs, {c[0].name: c[1] for c in cases}, {c[0].name: c[2] for c in cases}


def fingerprints(tensors: Mapping[str, NDArray[Any]]) -> dict[str, int]:
    return {name: fingerprint(bits) for name, bits in tensors.items()}


def assert_patches_equal(a: Patch, b: Patch) -> None:
    """Same tensors, specs, fingerprints, indices and deltas (dtype included)."""
    assert sorted(a.tensors) == sorted(b.tensors)
    for name, x in a.tensors.items():
        y = b.tensors[name]
        assert x.spec == y.spec, name
        assert (x.base_fingerprint, x.target_fingerprint) == (y.base_fingerprint, y.target_fingerprint), name
        assert x.indices.dtype == y.indices.dtype == np.int64, name
        assert x.delta.dtype == y.delta.dtype == x.spec.bits_dtype, name
        np.testing.assert_array_equal(x.indices, y.indices, err_msg=name)
        np.testing.assert_array_equal(x.delta, y.delta, err_msg=name)


def sparse_delta(
    spec: TensorSpec, indices: list[int], deltas: list[int], base: int = 0, target: int = 1
) -> TensorDelta:
    """A TensorDelta built directly (no arrays of the tensor's size are allocated)."""
    return TensorDelta(
        spec,
        np.array(indices, dtype=np.int64),
        np.array(deltas, dtype=np.uint64).astype(spec.bits_dtype),
        base,
        target,
    )


def forge(
    doc: object,
    payload: bytes = b"",
    *,
    magic: bytes = MAGIC,
    major: int = FORMAT_MAJOR,
    minor: int = FORMAT_MINOR,
    file_type: int = FILE_TYPE_PATCH_SHARD,
    codec_id: int = 1,
    header: bytes | None = None,
    json_length: int | None = None,
    payload_length: int | None = None,
) -> bytes:
    """A shard with valid checksums around any header document and payload.

    Lets hostile-input tests reach the semantic checks behind the CRCs. ``header``
    replaces the canonical JSON bytes (stored verbatim unless ``json_length`` says more).
    """
    raw = canonical_json(doc) if header is None else header
    j_len = len(raw) if json_length is None else json_length
    p_len = len(payload) if payload_length is None else payload_length
    fixed = FIXED_HEADER.pack(magic, major, minor, file_type, codec_id, len(raw), j_len, p_len, zlib.crc32(payload), 0)
    crc = zlib.crc32(raw, zlib.crc32(fixed[:HEADER_CRC_OFFSET]))
    return fixed[:HEADER_CRC_OFFSET] + struct.pack("<I", crc) + raw + payload


def split_shard(data: bytes) -> tuple[bytes, bytes, bytes]:
    """(fixed header, stored header, payload) of a shard, for rewriting."""
    h_len = struct.unpack_from("<I", data, 16)[0]
    return (
        data[:FIXED_HEADER_SIZE],
        data[FIXED_HEADER_SIZE : FIXED_HEADER_SIZE + h_len],
        data[FIXED_HEADER_SIZE + h_len :],
    )
