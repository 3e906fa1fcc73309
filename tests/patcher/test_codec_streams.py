"""The gap and delta streams: widths, escapes, huge virtual tensors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bulletin.errors import InvalidInput
from patcher.decode import decode, read_shard_header
from patcher.encode import encode
from patcher.patch import Patch, TensorSpec
from patcher.streams import byte_width, decode_deltas, decode_gaps, encode_deltas, encode_gaps, pack_gaps, unpack_gaps
from tests.patcher.helpers import assert_patches_equal, sparse_delta

BITS = [np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32), np.dtype(np.uint64)]


def test_byte_width() -> None:
    assert [byte_width(v) for v in (0, 1, 255, 256, 65535, 65536, 2**32, 2**64 - 1)] == [1, 1, 1, 2, 2, 3, 5, 8]


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(
        st.one_of(st.integers(1, 300), st.integers(1, 2000), st.integers(1, 2**40)), min_size=1, max_size=300
    ),
    start=st.integers(0, 2**20),
)
def test_gaps_roundtrip(gaps: list[int], start: int) -> None:
    indices = np.cumsum(np.array(gaps, dtype=np.int64)) + (start - 1)
    stop = int(indices[-1]) + 1
    parts = encode_gaps(indices, start)
    # The low bytes are a plain byte plane; the high parts are small values.
    assert parts.low == bytes(g & 0xFF for g in gaps)
    high = [g >> 8 for g in gaps]
    escaped = [h - 3 for h in high if h >= 3]
    assert parts.small.escape_count == len(escaped)
    assert len(parts.small.escapes) == (byte_width(max(escaped)) if escaped else 0)
    back = decode_gaps(parts.low, parts.small.codes, parts.small.escapes, len(gaps), len(escaped), start, stop, "t")
    np.testing.assert_array_equal(back, indices)
    raw, width = pack_gaps(indices, start)
    np.testing.assert_array_equal(unpack_gaps(raw, len(gaps), width, start, stop, "t"), indices)


@pytest.mark.parametrize("dtype", BITS, ids=str)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_deltas_roundtrip(dtype: np.dtype, data: st.DataObject) -> None:
    bits = dtype.itemsize * 8
    small = st.sampled_from([1, 2, 3, (1 << bits) - 1, (1 << bits) - 2, (1 << bits) - 3, (1 << bits) - 4])
    values = data.draw(st.lists(st.one_of(small, st.integers(1, (1 << bits) - 1)), min_size=1, max_size=200))
    delta = np.array(values, dtype=np.uint64).astype(dtype)
    parts = encode_deltas(delta)
    # -1, +1 and -2 fit the 2-bit codes; everything else escapes.
    signed = [v - (1 << bits) if v >> (bits - 1) else v for v in values]
    escapes = sum(1 for s in signed if s not in (-1, 1, -2))
    assert parts.small.escape_count == escapes and len(parts.small.codes) == (len(values) + 3) // 4
    assert len(parts.small.escapes) <= dtype.itemsize
    back = decode_deltas(parts.small.codes, parts.small.escapes, len(values), escapes, dtype, "t")
    assert back.dtype == dtype
    np.testing.assert_array_equal(back, delta)


def test_gaps_beyond_32_bits_on_a_virtual_tensor() -> None:
    # 2**34 elements would be 16 GiB: the delta is built directly, nothing that size exists.
    spec = TensorSpec("huge.weight", "U8", (1 << 17, 1 << 17))
    positions = [5, 5 + (1 << 33) + 7, (1 << 34) - 1]
    td = sparse_delta(spec, positions, [1, 255, 128])
    patch = Patch({spec.name: td})
    shards = encode(patch)
    entry = read_shard_header(shards[0]).entries[0]
    assert entry.gap_escape_width == 4  # high parts of gaps above 2**33 need 4 bytes
    assert (entry.start, entry.stop, entry.count) == (0, 1 << 34, 3)
    assert_patches_equal(decode(shards), patch)


def test_wide_dtype_deltas_survive_escaping() -> None:
    spec = TensorSpec("x", "F64", (4,))
    deltas = [1, (1 << 64) - 1, 1 << 63, 0x0123456789ABCDEF]
    patch = Patch({"x": sparse_delta(spec, [0, 1, 2, 3], deltas)})
    shards = encode(patch, codec="lz4")
    entry = read_shard_header(shards[0]).entries[0]
    assert entry.delta_escapes == 2 and entry.delta_escape_width == 8
    assert_patches_equal(decode(shards), patch)


def test_encode_refuses_what_decode_would_refuse() -> None:
    spec = TensorSpec("x", "BF16", (10,))
    with pytest.raises(InvalidInput):
        encode(Patch({"x": sparse_delta(spec, [3, 3], [1, 1])}))
    with pytest.raises(InvalidInput):
        encode(Patch({"x": sparse_delta(spec, [3], [0])}))
    with pytest.raises(InvalidInput):
        encode(Patch({"x": sparse_delta(spec, [10], [1])}))
    with pytest.raises(InvalidInput):
        encode(Patch({"x": sparse_delta(spec, [], [], base=1, target=2)}))  # unchanged, yet moved
    with pytest.raises(InvalidInput):
        encode(Patch({"x": sparse_delta(TensorSpec("x", "U8", (1 << 62, 4)), [1], [1])}))
    ok = Patch({"x": sparse_delta(spec, [3], [1])})
    bad: dict[str, Any]
    for bad in ({"codec": "gzip"}, {"level": 0}, {"level": 20}, {"codec": "lz4", "level": 13}, {"max_shard_bytes": 40}):
        with pytest.raises(InvalidInput):
            encode(ok, **bad)
    with pytest.raises(InvalidInput):
        encode(ok, max_shard_bytes=300)  # cannot hold one element with its description
