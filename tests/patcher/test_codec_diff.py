"""diff_bits and diff: the same answer as the obvious NumPy code, on every width and edge."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import patcher.diff as diff_module
from bulletin.errors import IncompatibleTensors, InvalidInput
from patcher.cast import cast_bits
from patcher.diff import cast_changes, diff, diff_bits, diff_cast_bits, tensor_changes
from patcher.fingerprint import element_hashes, fingerprint
from patcher.fingerprint_update import fingerprint_change
from patcher.patch import TensorSpec
from tests.patcher.helpers import mutate, random_bits

BITS: dict[int, type[np.unsignedinteger]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
DTYPE_OF = {1: "U8", 2: "BF16", 4: "F32", 8: "I64"}


def _naive(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    idx = np.flatnonzero(old != new)
    return idx, (new.reshape(-1)[idx] - old.reshape(-1)[idx]).astype(old.dtype)


@settings(max_examples=60, deadline=None)
@given(
    width=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(0, 5000),
    density=st.sampled_from([0.0, 0.001, 0.01, 0.3, 1.0]),
    seed=st.integers(0, 2**32 - 1),
    chunk_words=st.sampled_from([1, 3, 64, 1 << 18]),
)
def test_diff_bits_matches_naive(width: int, n: int, density: float, seed: int, chunk_words: int) -> None:
    rng = np.random.default_rng(seed)
    old = random_bits(rng, DTYPE_OF[width], (n,))
    new = mutate(rng, old, density, DTYPE_OF[width])
    with pytest.MonkeyPatch.context() as mp:
        # Tiny chunks put changes on every chunk boundary and every word lane.
        mp.setattr(diff_module, "CHUNK_WORDS", chunk_words)
        idx, delta = diff_bits(old, new)
    want_idx, want_delta = _naive(old, new)
    assert idx.dtype == np.int64 and delta.dtype == old.dtype
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_array_equal(delta, want_delta)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_every_lane_and_the_tail(width: int) -> None:
    # n not a multiple of the elements per 64-bit word: the tail is compared apart.
    n = 8 // width * 5 + 3
    old = np.zeros(n, dtype=BITS[width])
    for i in range(n):
        new = old.copy()
        new[i] = 1
        idx, delta = diff_bits(old, new)
        assert idx.tolist() == [i] and delta.tolist() == [1]
    idx, delta = diff_bits(old, old + 1)
    assert idx.tolist() == list(range(n))


def test_multidimensional_and_zero_d() -> None:
    old = np.arange(24, dtype=np.uint16).reshape(2, 3, 4)
    new = old.copy()
    new[1, 2, 3] += 5
    new[0, 0, 1] -= 1
    idx, delta = diff_bits(old, new)
    assert idx.tolist() == [1, 23]
    assert delta.tolist() == [0xFFFF, 5]
    idx, delta = diff_bits(np.array(3, np.uint32), np.array(2, np.uint32))
    assert idx.tolist() == [0] and delta.tolist() == [0xFFFFFFFF]


def test_diff_bits_refuses_bad_arrays() -> None:
    a = np.zeros(10, np.uint16)
    with pytest.raises(IncompatibleTensors):
        diff_bits(a, np.zeros(11, np.uint16))
    with pytest.raises(IncompatibleTensors):
        diff_bits(a, np.zeros(10, np.uint32))
    with pytest.raises(InvalidInput):
        diff_bits(np.zeros(10, np.int16), np.zeros(10, np.int16))
    with pytest.raises(InvalidInput):
        diff_bits(np.zeros(20, np.uint16)[::2], a)
    with pytest.raises(InvalidInput):
        diff_bits(a.astype(">u2"), a.astype(">u2"))
    with pytest.raises(InvalidInput):
        diff_bits([1, 2], [1, 2])  # type: ignore[arg-type]


def test_diff_has_no_full_size_temporaries() -> None:
    n = 1 << 23  # 16 MiB of BF16 per version
    rng = np.random.default_rng(0)
    old = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    new = old.copy()
    where = rng.choice(n, n // 300, replace=False)
    new[where] += 1
    tracemalloc.start()
    try:
        idx, delta = diff_bits(old, new)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    output = idx.nbytes + delta.nbytes
    # Outputs, their per-chunk parts, and a chunk's mask; nothing of the tensor's size.
    assert peak < 2.5 * output + (4 << 20), (peak, output)
    assert peak < old.nbytes / 4


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 3000), seed=st.integers(0, 2**32 - 1), density=st.sampled_from([0.0, 0.01, 0.5, 1.0]))
def test_diff_fingerprints(n: int, seed: int, density: float) -> None:
    rng = np.random.default_rng(seed)
    spec = TensorSpec("t", "F16", (n,))
    old = random_bits(rng, "F16", (n,))
    new = mutate(rng, old, density, "F16")
    patch = diff({"t": spec}, {"t": old}, {"t": new})
    td = patch.tensors["t"]
    assert td.base_fingerprint == fingerprint(old)
    assert td.target_fingerprint == fingerprint(new)
    given_base = diff({"t": spec}, {"t": old}, {"t": new}, base_fingerprints={"t": fingerprint(old)})
    assert given_base.tensors["t"].target_fingerprint == fingerprint(new)


@settings(max_examples=40, deadline=None)
@given(width=st.sampled_from([1, 2, 4, 8]), n=st.integers(0, 20000), seed=st.integers(0, 2**32 - 1))
def test_fingerprint_change_is_the_sum_of_hashes_gained_less_those_lost(width: int, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    idx = np.sort(rng.choice(1 << 40, size=n, replace=False)).astype(np.int64)
    info = np.iinfo(BITS[width])
    old = rng.integers(0, info.max, n, dtype=BITS[width], endpoint=True)
    new = rng.integers(0, info.max, n, dtype=BITS[width], endpoint=True)
    gained = int(element_hashes(idx, new).sum(dtype=np.uint64)) if n else 0
    lost = int(element_hashes(idx, old).sum(dtype=np.uint64)) if n else 0
    assert fingerprint_change(idx, old, new) == (gained - lost) % 2**64


def test_diff_validates_everything_first() -> None:
    spec = TensorSpec("a", "BF16", (4,))
    ok = np.zeros(4, np.uint16)
    with pytest.raises(IncompatibleTensors):
        diff({"a": spec}, {"a": ok}, {})
    with pytest.raises(IncompatibleTensors):
        diff({"a": spec}, {"a": ok}, {"a": np.zeros(5, np.uint16)})
    with pytest.raises(IncompatibleTensors):
        diff({"a": spec}, {"a": ok}, {"a": np.zeros(4, np.float32)})
    with pytest.raises(InvalidInput):
        diff({"a": spec}, {"a": ok}, {"a": np.zeros(8, np.uint16)[::2]})
    with pytest.raises(InvalidInput):
        diff({"a": spec}, {"a": ok}, {"a": np.zeros(4, object)})
    with pytest.raises(InvalidInput):
        diff({"b": spec}, {"b": ok}, {"b": ok})
    with pytest.raises(IncompatibleTensors):
        diff({"a": spec}, {"a": ok}, {"a": ok}, base_fingerprints={})
    with pytest.raises(InvalidInput):
        diff({"a": spec}, {"a": ok}, {"a": ok}, base_fingerprints={"a": 1 << 64})
    # Any dtype of the right width is compared as bits.
    patch = diff({"a": spec}, {"a": np.zeros(4, np.float16)}, {"a": np.full(4, -0.0, np.float16)})
    assert patch.tensors["a"].delta.tolist() == [0x8000] * 4


@pytest.mark.parametrize("served", ["BF16", "F16"])
@pytest.mark.parametrize("chunk", [64, 1000, 1 << 20])
def test_a_diff_that_casts_chunk_by_chunk_is_the_diff_of_the_whole_cast(served: str, chunk: int) -> None:

    rng = np.random.default_rng(chunk)
    n = 5000 + chunk  # a partial last chunk
    src = (rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)).view(np.uint32)
    src[:4] = np.array([0x7FC00001, 0xFF800000, 0x80000000, 0x00000001], dtype=np.uint32)  # NaN, -inf, -0, subnormal
    old = cast_bits(src, "F32", served)
    moved = rng.choice(n, size=200, replace=False)
    src[moved] = (src[moved].view(np.float32) * np.float32(1.01)).view(np.uint32)
    src[chunk - 1 : chunk + 1] ^= np.uint32(1 << 20)  # both sides of a chunk boundary
    want = diff_bits(old, cast_bits(src, "F32", served))
    got = diff_cast_bits(old, src, "F32", served, chunk=chunk)
    assert want[0].size > 150
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    none = diff_cast_bits(cast_bits(src, "F32", served), src, "F32", served, chunk=chunk)
    assert none[0].size == 0 and none[0].dtype == np.int64 and none[1].dtype == old.dtype


def test_a_diff_that_casts_refuses_what_it_cannot_pair() -> None:

    old = np.zeros(100, np.uint16)
    with pytest.raises(IncompatibleTensors):
        diff_cast_bits(old, np.zeros(99, np.uint32), "F32", "BF16")
    with pytest.raises(InvalidInput):
        diff_cast_bits(old, np.zeros(100, np.uint32), "F32", "BF16", chunk=8)
    with pytest.raises(InvalidInput):
        diff_cast_bits(np.zeros(100, np.uint32), np.zeros(100, np.uint32), "F32", "BF16")


@settings(max_examples=60, deadline=None)
@given(
    served=st.sampled_from(["BF16", "F16", "F32"]),
    n=st.integers(0, 9000),
    density=st.sampled_from([0.0, 0.004, 0.05, 1.0]),
    first=st.sampled_from([0, 1, 4097, 2**40 + 3]),
    seed=st.integers(0, 2**32 - 1),
)
def test_changes_found_while_casting_are_those_of_the_cast_with_the_block_s_place_hashed(
    served: str, n: int, density: float, first: int, seed: int
) -> None:
    # A block from flat index `first` of its tensor: its part of the fingerprint change
    # hashes each element at that place (the sum over a sharded tensor's blocks is the
    # whole tensor's). Density 1.0 over more than 4096 elements outgrows the first outputs.
    rng = np.random.default_rng(seed)
    src = (rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)).view(np.uint32)
    old = cast_bits(src, "F32", served)
    moved = rng.random(n) < density
    src[moved] = (src[moved].view(np.float32) * np.float32(1.01) + np.float32(1e-3)).view(np.uint32)
    new = cast_bits(src, "F32", served)
    want = np.flatnonzero(old != new)
    (idx, was, delta), change = cast_changes(old, src, "F32", served, first=first, chunk=64 + seed % 3000)
    np.testing.assert_array_equal(idx, want)
    np.testing.assert_array_equal(was, old[want])
    np.testing.assert_array_equal(delta, new[want] - old[want])
    assert change == fingerprint_change(want + first, old[want], new[want])
    assert tensor_changes(old, new, first=first)[1] == change
