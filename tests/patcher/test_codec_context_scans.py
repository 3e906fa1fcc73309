"""The context codec's pieces: the range coder and the scans over the base (patcher.context).

The scans are what a GPU kernel does on the device (kernels/); their NumPy definitions
are checked here against a plain-Python model, and the compiled ones against those.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from bulletin.errors import FormatError, InvalidInput
from patcher import native
from patcher.context import (
    CHUNK,
    EXPONENT_FIELDS,
    ClassWindow,
    check_window,
    choose_window,
    class_ranks,
    element_classes,
    exponents,
    select_ranks,
)
from patcher.dtypes import bits_dtype
from patcher.rangecoder import RangeDecoder, RangeEncoder

FLOATS = sorted(EXPONENT_FIELDS)


def random_base(rng: np.random.Generator, dtype: str, n: int) -> NDArray[Any]:
    bd = bits_dtype(dtype)
    return rng.integers(0, np.iinfo(bd).max, size=n, dtype=bd, endpoint=True)


def slow_ranks(classes: NDArray[np.uint8], start: int, indices: NDArray[np.int64]) -> list[tuple[int, int]]:
    """(class, rank) of each index, by counting: the definition in plain Python."""
    seen: dict[int, int] = {}
    out, at = [], start
    for i in indices.tolist():
        for j in range(at, i):
            c = int(classes[j])
            seen[c] = seen.get(c, 0) + 1
        c = int(classes[i])
        out.append((c, seen.get(c, 0)))
        seen[c] = seen.get(c, 0) + 1
        at = i + 1
    return out


def test_exponents_and_classes_follow_the_field_and_the_window() -> None:
    bits = np.array([0x3F80, 0xBF80, 0x0001, 0x7F80, 0x4000], dtype=np.uint16)  # 1, -1, tiny, inf, 2
    np.testing.assert_array_equal(exponents(bits, "BF16"), [127, 127, 0, 255, 128])
    np.testing.assert_array_equal(element_classes(bits, "BF16", ClassWindow(120, 8)), [7, 7, 0, 7, 7])
    np.testing.assert_array_equal(element_classes(bits, "BF16", ClassWindow(127, 2)), [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(exponents(np.array([7, 9], np.uint32), "I32"), [0, 0])


@pytest.mark.parametrize(
    ("dtype", "window"),
    [
        ("BF16", ClassWindow(250, 7)),
        ("BF16", ClassWindow(0, 17)),
        ("I32", ClassWindow(0, 2)),
        ("F16", ClassWindow(-1, 2)),
    ],
)
def test_windows_outside_the_field_are_refused(dtype: str, window: ClassWindow) -> None:
    with pytest.raises(InvalidInput):
        check_window(dtype, window)


@pytest.mark.parametrize("dtype", [*FLOATS, "U8"])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 4099])
def test_ranks_and_select_are_inverse_and_match_counting(dtype: str, n: int) -> None:
    rng = np.random.default_rng(n)
    base = random_base(rng, dtype, n)
    # Narrow exponents so that every class is used.
    if dtype in EXPONENT_FIELDS:
        shift, width = EXPONENT_FIELDS[dtype]
        keep = ~np.array(((1 << width) - 1) << shift, dtype=np.uint64).astype(base.dtype)
        base = (base & keep) | (rng.integers(100 % (1 << width), 1 << width, size=n).astype(base.dtype) << shift)
    start = n // 5
    indices = np.sort(rng.choice(np.arange(start, n), size=max(1, (n - start) // 9), replace=False)).astype(np.int64)
    window = choose_window(base, dtype, start, n, indices)
    check_window(dtype, window)
    classes, ranks = class_ranks(base, dtype, window, start, indices)
    assert list(zip(classes.tolist(), ranks.tolist(), strict=True)) == slow_ranks(
        element_classes(base, dtype, window), start, indices
    )
    order = np.argsort(classes, kind="stable")
    found = select_ranks(base, dtype, window, start, n, classes[order], ranks[order])
    np.testing.assert_array_equal(found, indices[order])


def test_scans_cross_chunks() -> None:
    rng = np.random.default_rng(3)
    n = CHUNK * 2 + 77
    base = ((rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)).view(np.uint32) >> 16).astype(np.uint16)
    indices = np.sort(rng.choice(n, size=5000, replace=False)).astype(np.int64)
    window = choose_window(base, "BF16", 0, n, indices)
    classes, ranks = class_ranks(base, "BF16", window, 0, indices)
    with native.disabled():
        c2, r2 = class_ranks(base, "BF16", window, 0, indices)
    np.testing.assert_array_equal(classes, c2)
    np.testing.assert_array_equal(ranks, r2)
    order = np.argsort(classes, kind="stable")
    np.testing.assert_array_equal(
        select_ranks(base, "BF16", window, 0, n, classes[order], ranks[order]), indices[order]
    )


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_select_through_an_overlay_reads_the_changed_bits(dtype: str) -> None:
    rng = np.random.default_rng(4)
    n = 3000
    base = random_base(rng, dtype, n)
    changed = base.copy()
    where = np.sort(rng.choice(n, size=300, replace=False)).astype(np.int64)
    changed[where] = random_base(rng, dtype, 300)
    indices = np.sort(rng.choice(n, size=200, replace=False)).astype(np.int64)
    window = ClassWindow(EXPONENT_FIELDS[dtype][1] and 100, 16)
    classes, ranks = class_ranks(changed, dtype, window, 0, indices)
    order = np.argsort(classes, kind="stable")
    c, r = classes[order], ranks[order]
    expected = select_ranks(changed, dtype, window, 0, n, c, r)
    np.testing.assert_array_equal(
        select_ranks(base, dtype, window, 0, n, c, r, overlay=(where, changed[where])), expected
    )
    c3, r3 = class_ranks(base, dtype, window, 0, indices, overlay=(where, changed[where]))
    np.testing.assert_array_equal(c3, classes)
    np.testing.assert_array_equal(r3, ranks)


@pytest.mark.parametrize("dtype", ["BF16", "F64"])
def test_a_rank_past_its_class_is_a_format_error(dtype: str) -> None:
    base = random_base(np.random.default_rng(5), dtype, 500)
    window = ClassWindow(0, 16)
    members = np.bincount(element_classes(base, dtype, window), minlength=16)
    c = int(np.argmax(members))
    with pytest.raises(FormatError, match=f"class {c} has {members[c]} elements"):
        select_ranks(base, dtype, window, 0, 500, np.array([c], np.uint8), np.array([members[c]], np.int64))
    with pytest.raises(FormatError):
        select_ranks(base, "U8", ClassWindow(0, 1), 0, 500, np.array([0], np.uint8), np.array([500], np.int64))


@pytest.mark.compiled_vs_numpy  # the compiled path's own checks: once, on that path
def test_the_compiled_scans_check_their_buffers() -> None:
    s = native.speedups
    base = np.zeros(100, np.uint16)
    empty_idx, empty_val = np.empty(0, np.int64), np.empty(0, np.uint16)
    out = np.empty(2, np.int64)
    with pytest.raises(ValueError, match="non-decreasing"):
        s.ctx_select(
            base,
            2,
            7,
            8,
            0,
            4,
            0,
            100,
            np.array([1, 0], np.uint8),
            np.array([0, 0], np.int64),
            empty_idx,
            empty_val,
            out,
        )
    with pytest.raises(ValueError, match="increasing in each"):
        s.ctx_select(
            base,
            2,
            7,
            8,
            0,
            4,
            0,
            100,
            np.array([0, 0], np.uint8),
            np.array([3, 3], np.int64),
            empty_idx,
            empty_val,
            out,
        )
    with pytest.raises(ValueError, match="window"):
        s.ctx_select(base, 2, 7, 8, 250, 16, 0, 100, np.zeros(2, np.uint8), np.arange(2), empty_idx, empty_val, out)
    with pytest.raises(ValueError, match="start <= stop"):
        s.ctx_select(base, 2, 7, 8, 0, 4, 0, 101, np.zeros(2, np.uint8), np.arange(2), empty_idx, empty_val, out)
    with pytest.raises(ValueError, match="increasing"):
        s.ctx_ranks(base, 2, 7, 8, 0, 4, 0, np.array([5, 5], np.int64), np.empty(2, np.uint8), np.empty(2, np.int64))
    with pytest.raises(ValueError):
        s.ctx_ranks(base, 2, 7, 8, 0, 4, 0, np.array([100], np.int64), np.empty(1, np.uint8), np.empty(1, np.int64))
    with pytest.raises(ValueError, match="meta"):
        s.ctx_decode(b"\x00" * 8, np.zeros(5, np.int64), bytearray(), bytearray(), bytearray())


# -- the range coder ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 1), st.integers(0, 40)), max_size=400))
def test_range_coder_round_trips_and_reads_exactly_its_bytes(symbols: list[tuple[int, int, int]]) -> None:
    enc = RangeEncoder(10)
    for ctx, bit, direct in symbols:
        enc.bit(ctx, bit)
        enc.direct(direct, 6)
    data = enc.finish()
    assert data[0] == 0 and len(data) <= enc.size_bound()
    dec = RangeDecoder(data, 10, "t")
    assert [(ctx, dec.bit(ctx), dec.direct(6)) for ctx, _, _ in symbols] == symbols
    dec.finish()


def test_range_coder_learns_skewed_bits() -> None:
    enc = RangeEncoder(1)
    for i in range(10_000):
        enc.bit(0, int(i % 100 == 0))
    assert len(enc.finish()) < 10_000 * 0.1 / 8  # an entropy of 0.08 bits per bit, plus the learning


@pytest.mark.parametrize("data", [b"", b"\x00\x00\x00\x00", b"\x01\x00\x00\x00\x00", b"\x00\xff\xff\xff\xff"])
def test_a_stream_that_cannot_start_is_a_format_error(data: bytes) -> None:
    with pytest.raises(FormatError):
        RangeDecoder(data, 1, "t")


def test_reading_past_the_end_or_stopping_early_is_a_format_error() -> None:
    enc = RangeEncoder(1)
    for _ in range(200):
        enc.direct(0x5A, 8)
    data = enc.finish()
    dec = RangeDecoder(data[:-3], 1, "t")
    with pytest.raises(FormatError, match="ends before"):
        for _ in range(200):
            dec.direct(8)
    dec = RangeDecoder(data + b"\x00", 1, "t")
    for _ in range(200):
        dec.direct(8)
    with pytest.raises(FormatError, match="after the last change"):
        dec.finish()


def _slow_window(sampled: NDArray[np.int64], changed: NDArray[np.int64], scale: int) -> tuple[int, int]:
    """window_of by its definition, in plain Python: of the windows of at most 16
    classes over the exponents present, the one of least ``sum n h(k / n)``, the lowest
    of those within WINDOW_TIE of it."""
    import math

    from patcher.context import MAX_CLASSES, WINDOW_TIE

    members = [max(int(s) * scale, int(c)) for s, c in zip(sampled, changed, strict=True)]
    present = [e for e, m in enumerate(members) if m]
    lo, hi = present[0], present[-1]
    if hi - lo < MAX_CLASSES:
        return lo, hi - lo + 1

    def h(n: float, k: float) -> float:
        return 0.0 if not 0 < k < n else -(k * math.log2(k / n) + (n - k) * math.log2(1 - k / n))

    bits = {}
    for w in range(lo, hi - MAX_CLASSES + 2):
        classes = [[0, 0] for _ in range(MAX_CLASSES)]
        for e in range(len(members)):
            c = classes[min(max(e - w, 0), MAX_CLASSES - 1)]
            c[0] += members[e]
            c[1] += int(changed[e])
        bits[w] = sum(h(n, k) for n, k in classes)
    best = min(bits.values())
    return min(w for w, b in bits.items() if b <= best + best * WINDOW_TIE + WINDOW_TIE), MAX_CLASSES


@pytest.mark.compiled_vs_numpy  # compares the two paths itself
@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    span=st.integers(1, 60),
    scale=st.sampled_from([1, 8, 64]),
    share=st.sampled_from([0.0005, 0.01, 0.3]),
)
def test_the_window_choice_is_its_definition_compiled_or_not(seed: int, span: int, scale: int, share: float) -> None:
    from patcher.context import window_of

    rng = np.random.default_rng(seed)
    lo = int(rng.integers(0, 256 - span))
    sampled, changed = np.zeros(256, np.int64), np.zeros(256, np.int64)
    sampled[lo : lo + span] = rng.integers(0, 10 ** int(rng.integers(1, 7)), span)
    sampled[lo : lo + span][rng.random(span) < 0.2] = 0  # gaps, and runs of equivalent windows
    changed[lo : lo + span] = (sampled[lo : lo + span] * scale * rng.random(span) * share).astype(np.int64)
    changed[lo + int(rng.integers(0, span))] += 1
    want = _slow_window(sampled, changed, scale)
    got = window_of(sampled, changed, scale)
    with native.disabled():
        reference = window_of(sampled, changed, scale)
    assert (got.lo, got.classes) == (reference.lo, reference.classes) == want


@pytest.mark.compiled_vs_numpy  # the compiled path's own checks
def test_the_compiled_window_choice_refuses_what_it_cannot_read() -> None:
    if not native.active():
        pytest.skip("the compiled path is not built")
    ok = np.ones(256, np.int64)
    with pytest.raises(ValueError, match="at most 2048"):
        native.speedups.ctx_window(np.ones(4096, np.int64), np.ones(4096, np.int64), 1)
    with pytest.raises(ValueError, match=">= 0"):
        native.speedups.ctx_window(-ok, ok, 1)
    with pytest.raises(ValueError, match="empty"):
        native.speedups.ctx_window(np.zeros(256, np.int64), np.zeros(256, np.int64), 1)
    with pytest.raises(ValueError, match="expected 256 items"):
        native.speedups.ctx_window(ok, np.ones(255, np.int64), 1)
