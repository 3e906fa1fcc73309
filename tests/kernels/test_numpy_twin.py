"""The NumPy twins against the codec they are built on (patcher.diff/cast/fingerprint/apply)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bulletin.errors import (
    FormatError,
    IncompatibleTensors,
    InvalidInput,
    UnsupportedDtype,
    VerificationFailed,
    WrongBase,
)
from bulletin_kernels import numpy_twin as twin
from patcher.cast import cast_bits
from patcher.context import ClassWindow, class_ranks
from patcher.diff import diff_bits
from patcher.dtypes import bits_dtype
from patcher.fingerprint import fingerprint
from patcher.patch import Patch, TensorDelta, TensorSpec
from patcher.streams import pack_gaps, unpack_gaps
from tests.kernels.helpers import (
    CASTS,
    SELECT_FIELDS,
    model_patch,
    pair,
    random_bits,
    select_case,
    sorted_unique,
)

MASK64 = (1 << 64) - 1


@settings(max_examples=40, deadline=None)
@given(
    cast=st.sampled_from(CASTS),
    n=st.integers(0, 3000),
    density=st.sampled_from([0.0, 0.001, 0.01, 0.5, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_diff_cast_is_diff_bits_of_the_cast(cast: tuple[str, str], n: int, density: float, seed: int) -> None:
    source, served = cast
    rng = np.random.default_rng(seed)
    current, kept = pair(rng, source, served, (n,), density)
    before = kept.copy()
    new = cast_bits(current, source, served)
    want_idx, want_delta = diff_bits(before, new)

    got = twin.diff_cast(current, kept, current_dtype=source, served_dtype=served)

    np.testing.assert_array_equal(got.indices, want_idx)
    np.testing.assert_array_equal(got.delta, want_delta)
    assert got.indices.dtype == np.int64 and got.delta.dtype == bits_dtype(served)
    np.testing.assert_array_equal(kept, new)
    assert got.fingerprint_delta == (fingerprint(new) - fingerprint(before)) & MASK64


def test_diff_cast_across_chunks_and_shapes() -> None:
    rng = np.random.default_rng(11)
    shape = (3, twin.CHUNK_ELEMENTS // 2 + 7)
    current, kept = pair(rng, "F32", "BF16", shape, 0.01)
    before = kept.copy()
    got = twin.diff_cast(current, kept, current_dtype="F32", served_dtype="BF16")
    idx, delta = diff_bits(before, cast_bits(current, "F32", "BF16"))
    np.testing.assert_array_equal(got.indices, idx)
    np.testing.assert_array_equal(got.delta, delta)
    assert got.fingerprint_delta == (fingerprint(kept) - fingerprint(before)) & MASK64


def test_diff_cast_refuses_bad_input_and_changes_nothing() -> None:
    rng = np.random.default_rng(5)
    current, kept = pair(rng, "F32", "BF16", (64,), 0.5)
    before = kept.copy()
    cases: list[tuple[type[Exception], dict[str, Any]]] = [
        (IncompatibleTensors, {"current": current[:32]}),
        (InvalidInput, {"current": current.view(np.float32)}),
        (InvalidInput, {"kept": kept.view(np.int16)}),
        (InvalidInput, {"current": np.zeros(128, dtype=np.uint32)[::2]}),
        (UnsupportedDtype, {"served_dtype": "F64"}),
        (UnsupportedDtype, {"current_dtype": "F16"}),
        (InvalidInput, {"current_dtype": "BF16"}),  # identity cast, but uint32 bits
        (InvalidInput, {"kept": before.tolist()}),
    ]
    for error, override in cases:
        args: dict[str, Any] = {"current": current, "kept": kept, "current_dtype": "F32", "served_dtype": "BF16"}
        args.update(override)
        with pytest.raises(error):
            twin.diff_cast(**args)
        np.testing.assert_array_equal(kept, before)
    same = current.copy()
    with pytest.raises(InvalidInput, match="share memory"):
        twin.diff_cast(same, same, current_dtype="F32", served_dtype="F32")
    kept.flags.writeable = False
    with pytest.raises(InvalidInput, match="read-only"):
        twin.diff_cast(current, kept, current_dtype="F32", served_dtype="BF16")


@pytest.mark.parametrize("source,served", CASTS)
def test_cast(source: str, served: str) -> None:
    current = random_bits(np.random.default_rng(2), source, (4, 33))
    np.testing.assert_array_equal(twin.cast(current, source, served), cast_bits(current, source, served))


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(["U8", "BF16", "F32", "F64"]),
    n=st.integers(0, 5000),
    m=st.integers(0, 5000),
    seed=st.integers(0, 2**32 - 1),
)
def test_apply_delta_and_fingerprint(dtype: str, n: int, m: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    bits = random_bits(rng, dtype, (n,))
    before = bits.copy()
    idx = sorted_unique(rng, n, m)
    delta = random_bits(rng, dtype, (idx.size,))
    delta[delta == 0] = 1

    change = twin.apply_delta(bits, idx, delta)

    want = before.copy()
    want[idx] += delta  # wraps
    np.testing.assert_array_equal(bits, want)
    assert twin.fingerprint(bits) == fingerprint(want)
    assert change == (fingerprint(want) - fingerprint(before)) & MASK64


def test_apply_delta_refuses_bad_indices_and_changes_nothing() -> None:
    rng = np.random.default_rng(9)
    bits = random_bits(rng, "BF16", (100,))
    before = bits.copy()
    d3 = np.ones(3, dtype=np.uint16)
    bad: list[tuple[Any, Any]] = [
        (np.array([1, 5, 5], dtype=np.int64), d3),  # duplicate
        (np.array([1, 7, 5], dtype=np.int64), d3),  # unsorted
        (np.array([-1, 5, 7], dtype=np.int64), d3),  # negative
        (np.array([1, 5, 100], dtype=np.int64), d3),  # past the end
        (np.array([1, 5, 7], dtype=np.int32), d3),  # index dtype
        (np.array([1, 5, 7], dtype=np.int64), np.ones(3, dtype=np.uint32)),  # delta width
        (np.array([1, 5, 7], dtype=np.int64), np.ones(2, dtype=np.uint16)),  # lengths
        (np.array([[1, 5, 7]], dtype=np.int64), d3),  # 2-d
    ]
    for idx, delta in bad:
        with pytest.raises(InvalidInput):
            twin.apply_delta(bits, idx, delta)
        np.testing.assert_array_equal(bits, before)
    # An unsorted pair that straddles a chunk edge is found too.
    n = twin.CHUNK_ELEMENTS + 10
    big = np.zeros(n, dtype=np.uint8)
    idx = np.arange(n, dtype=np.int64)
    idx[twin.CHUNK_ELEMENTS], idx[twin.CHUNK_ELEMENTS - 1] = idx[twin.CHUNK_ELEMENTS - 1], idx[twin.CHUNK_ELEMENTS]
    with pytest.raises(InvalidInput, match="increasing"):
        twin.apply_delta(big, idx, np.ones(n, dtype=np.uint8))
    assert not big.any()
    bits.flags.writeable = False
    with pytest.raises(InvalidInput, match="read-only"):
        twin.apply_delta(bits, np.array([1], dtype=np.int64), np.ones(1, dtype=np.uint16))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 10**6), m=st.integers(1, 2000), start=st.integers(0, 10**6), seed=st.integers(0, 2**32 - 1))
def test_decode_gaps_inverts_the_codec(n: int, m: int, start: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    indices = start + sorted_unique(rng, n, m)
    raw, width = pack_gaps(indices, start)
    # The codec's gaps, as docs/FORMAT.md defines them for an entry starting at `start`.
    gaps = np.diff(indices, prepend=start - 1)
    np.testing.assert_array_equal(unpack_gaps(raw, indices.size, width, start, start + n, "test"), indices)
    for dtype in (np.uint8, np.uint32, np.uint64, np.int64):
        if int(gaps.max()) <= np.iinfo(dtype).max:
            got = twin.decode_gaps(gaps.astype(dtype), start)
            assert got.dtype == np.int64
            np.testing.assert_array_equal(got, indices)


def test_decode_gaps_refuses_bad_input() -> None:
    for gaps, start in [
        (np.ones((2, 2), dtype=np.uint8), 0),
        (np.ones(4, dtype=np.float32), 0),
        (np.ones(8, dtype=np.uint8)[::2], 0),
        (np.ones(4, dtype=np.uint8), -1),
        (np.ones(4, dtype=np.uint8), True),
    ]:
        with pytest.raises(InvalidInput):
            twin.decode_gaps(gaps, start)
    assert twin.decode_gaps(np.empty(0, dtype=np.uint16), 5).size == 0


def test_apply_patch() -> None:
    patch, old, new = model_patch(np.random.default_rng(1))
    held = {name: bits.copy() for name, bits in old.items()}
    fps = {td.spec.name: td.base_fingerprint for td in patch}
    got = twin.apply(patch, held, fps)
    for name, bits in held.items():
        np.testing.assert_array_equal(bits, new[name])
        assert got[name] == fingerprint(new[name]) == patch.tensors[name].target_fingerprint


def test_apply_patch_refuses_wrong_holders_and_changes_nothing() -> None:
    patch, old, _ = model_patch(np.random.default_rng(2))
    fps = {td.spec.name: td.base_fingerprint for td in patch}
    held = {name: bits.copy() for name, bits in old.items()}

    def unchanged() -> None:
        for name, bits in held.items():
            np.testing.assert_array_equal(bits, old[name])

    with pytest.raises(WrongBase):
        twin.apply(patch, held, {**fps, "norm.weight": fps["norm.weight"] ^ 1})
    unchanged()
    with pytest.raises(WrongBase):
        twin.apply(patch, held, {k: v for k, v in fps.items() if k != "head.bias"})
    unchanged()
    with pytest.raises(IncompatibleTensors):
        twin.apply(patch, {k: v for k, v in held.items() if k != "head.bias"}, fps)
    unchanged()
    with pytest.raises(IncompatibleTensors):
        twin.apply(patch, {**held, "norm.weight": held["norm.weight"].reshape(4, 4)}, fps)
    unchanged()
    with pytest.raises(InvalidInput):
        twin.apply(patch, {**held, "norm.weight": held["norm.weight"].view(np.float32)}, fps)
    unchanged()
    # A holder whose bits are not what its fingerprints say: caught after the scatter,
    # and every tensor is put back.
    held["embed.weight"][0, 0] ^= 1
    lying = {name: bits.copy() for name, bits in held.items()}
    with pytest.raises(VerificationFailed):
        twin.apply(patch, held, fps)
    for name, bits in held.items():
        np.testing.assert_array_equal(bits, lying[name])


def test_unchanged_tensor_keeps_its_fingerprint() -> None:
    spec = TensorSpec("w", "BF16", (10,))
    bits = random_bits(np.random.default_rng(0), "BF16", (10,))
    fp = fingerprint(bits)
    empty = TensorDelta(spec, np.empty(0, dtype=np.int64), np.empty(0, dtype=np.uint16), fp, fp)
    assert twin.apply(Patch({"w": empty}), {"w": bits}, {"w": fp}) == {"w": fp}


@pytest.mark.parametrize("dtype,shift,width", SELECT_FIELDS)
def test_select_ranks_inverts_class_ranks(dtype: str, shift: int, width: int) -> None:
    rng = np.random.default_rng(width)
    for n in [1, 333, 5000]:
        for classes in [1, 3, 16] if width else [1]:
            case = select_case(rng, dtype, shift, width, n, classes, 0.2)
            window = ClassWindow(case.lo, case.classes)
            got = twin.select_ranks(case.base, dtype, window, case.start, case.stop, case.query_classes, case.ranks)
            np.testing.assert_array_equal(got, case.expected)
            # And the encoder's side gives back the queries.
            order = np.argsort(case.expected)
            c, r = class_ranks(case.base, dtype, window, case.start, case.expected[order])
            np.testing.assert_array_equal(c, case.query_classes[order])
            np.testing.assert_array_equal(r, case.ranks[order])


def test_select_ranks_refuses_bad_arguments_and_queries() -> None:
    case = select_case(np.random.default_rng(3), "BF16", 7, 8, 4000, 4, 0.1)
    window = ClassWindow(case.lo, 4)
    c, r = case.query_classes, case.ranks

    def call(**changes: Any) -> Any:
        args: dict[str, Any] = {
            "base": case.base,
            "dtype": "BF16",
            "window": window,
            "start": case.start,
            "stop": case.stop,
            "classes": c,
            "ranks": r,
        }
        return twin.select_ranks(**(args | changes))

    invalid: list[dict[str, Any]] = [
        {"dtype": "F32"},
        {"window": ClassWindow(0, 17)},
        {"window": ClassWindow(0, 2), "dtype": "U16"},
        {"stop": case.base.size + 1},
        {"start": case.stop + 1},
        {"classes": c.astype(np.int64)},
        {"ranks": r[:-1]},
        {"ranks": r.astype(np.int32)},
    ]
    for bad in invalid:
        with pytest.raises(InvalidInput):
            call(**bad)
    corrupt: list[dict[str, Any]] = [
        {"classes": np.concatenate([c[:-1], [4]]).astype(np.uint8)},
        {"ranks": np.concatenate([r[:-1], [r[-1] + 4000]])},
        {"classes": c[::-1].copy(), "ranks": r[::-1].copy()},
        {"ranks": np.concatenate([[-1], r[1:]])},
    ]
    for bad in corrupt:
        with pytest.raises(FormatError):
            call(**bad)


def test_apply_ranks_is_select_then_apply_delta_and_refuses_without_writing() -> None:
    rng = np.random.default_rng(12)
    case = select_case(rng, "BF16", 7, 8, 9000, 16, 0.05)
    window = ClassWindow(case.lo, case.classes)
    delta = random_bits(rng, "BF16", (case.ranks.size,))
    held = case.base.copy()
    change = twin.apply_ranks(held, "BF16", window, case.start, case.stop, case.query_classes, case.ranks, delta)
    order = np.argsort(case.expected)
    reference = case.base.copy()
    assert change == twin.apply_delta(reference, case.expected[order], delta[order])
    np.testing.assert_array_equal(held, reference)
    assert fingerprint(held) == (fingerprint(case.base) + change) & MASK64
    ranks = case.ranks.copy()
    ranks[-1] += 9000
    held = case.base.copy()
    with pytest.raises(FormatError):
        twin.apply_ranks(held, "BF16", window, case.start, case.stop, case.query_classes, ranks, delta)
    with pytest.raises(InvalidInput):
        twin.apply_ranks(held, "BF16", window, case.start, case.stop, case.query_classes, case.ranks, delta[:-1])
    with pytest.raises(InvalidInput):
        twin.apply_ranks(
            held, "BF16", window, case.start, case.stop, case.query_classes, case.ranks, delta.astype(np.uint32)
        )
    read_only = case.base.copy()
    read_only.flags.writeable = False
    with pytest.raises(InvalidInput):
        twin.apply_ranks(read_only, "BF16", window, case.start, case.stop, case.query_classes, case.ranks, delta)
    np.testing.assert_array_equal(held, case.base)
