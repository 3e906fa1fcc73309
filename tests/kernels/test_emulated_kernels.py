"""The CUDA kernel sources and kernels/bulletin_kernels/cuda.py's launch logic, run on the CPU emulator,
against the NumPy twin: same indices, deltas, kept bits, fingerprints, bit for bit.

This is what CI (no GPU) can say about the kernels: arithmetic, ascending order across
warps and tiles, head/tail and misaligned-view handling (views are placed at every
element offset from a 16-byte boundary; UBSan aborts on a misaligned vector load), no
writes outside the arrays (canaries), and the warp-synchronous protocol. Speed, the
GPU memory model and NVRTC are left to tests/kernels/test_cuda.py on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from bulletin.errors import FormatError, InvalidInput, VerificationFailed
from bulletin_kernels import cuda
from bulletin_kernels import numpy_twin as twin
from bulletin_kernels._checks import ClassField
from patcher.cast import cast_bits, cast_kind
from patcher.context import ClassWindow, choose_window, class_ranks
from patcher.dtypes import bits_dtype
from tests.kernels.emulator import EmulatorRuntime, Placed, build_emulator, compiler, isolated
from tests.kernels.helpers import (
    CASTS,
    SELECT_FIELDS,
    SPECIALS,
    golden_cases,
    golden_patch,
    model_patch,
    pair,
    random_bits,
    select_case,
    sorted_unique,
)

pytestmark = pytest.mark.skipif(compiler() is None, reason="the kernel emulator needs g++ (C++20, UBSan)")

TILE = cuda.TILE_ELEMENTS
SIZES = [1, 7, 8, 9, 100, TILE - 1, TILE, TILE + 1, 3 * TILE + 77]
DENSITIES = [0.0, 0.001, 0.01, 0.5, 1.0]


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorRuntime]:
    workdir: Path = tmp_path_factory.mktemp("emulator")
    yield EmulatorRuntime(build_emulator(workdir))


def offset_of(rng: np.random.Generator, width: int) -> int:
    return int(rng.integers(0, max(1, 16 // width))) * width


@pytest.mark.parametrize("source,served", CASTS)
def test_diff_cast(runtime: EmulatorRuntime, source: str, served: str) -> None:
    rng = np.random.default_rng(sum(map(ord, source + served)))
    kind = cast_kind(source, served)
    cases = []
    for n in SIZES:
        for density in DENSITIES:
            current, kept = pair(rng, source, served, (n,), density)
            cases.append((current, kept, offset_of(rng, current.itemsize), offset_of(rng, kept.itemsize)))

    def run() -> list[tuple[Any, ...]]:
        out = []
        for current, kept, cur_off, kept_off in cases:
            cur_p, kept_p = Placed(current, cur_off), Placed(kept, kept_off)
            got = cuda._diff_cast(runtime, cur_p.array, kept_p.array, kind, served)
            intact = cur_p.canaries_intact() and kept_p.canaries_intact()
            out.append((got.indices, got.delta, got.fingerprint_delta, kept_p.array.copy(), intact))
        return out

    for (current, kept, cur_off, kept_off), (idx, delta, fp, kept_after, intact) in zip(
        cases, isolated(run), strict=True
    ):
        where = f"n={current.size} offsets={cur_off},{kept_off}"
        want = twin.diff_cast(current, kept, current_dtype=source, served_dtype=served)
        assert intact, where
        np.testing.assert_array_equal(idx, want.indices, err_msg=where)
        np.testing.assert_array_equal(delta, want.delta, err_msg=where)
        assert idx.dtype == np.int64 and delta.dtype == bits_dtype(served), where
        assert fp == want.fingerprint_delta, where
        np.testing.assert_array_equal(kept_after, kept, err_msg=where)


def test_diff_cast_empty(runtime: EmulatorRuntime) -> None:
    got = cuda._diff_cast(runtime, np.empty(0, np.uint32), np.empty(0, np.uint16), "f32_bf16", "BF16")
    assert got.indices.size == 0 and got.delta.dtype == np.uint16 and got.fingerprint_delta == 0
    assert runtime.launches == []


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_fingerprint(runtime: EmulatorRuntime, width: int) -> None:
    rng = np.random.default_rng(width)
    dtype = np.dtype(f"u{width}")
    cases = []
    for n in [1, 2, 7, 8, 9, 17, 1000, 4096 * 8 + 13]:
        for offset in range(0, 16, width):
            cases.append((rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True), offset))

    def run() -> list[int]:
        out = []
        for bits, offset in cases:
            placed = Placed(bits, offset)
            out.append(cuda._fingerprint(runtime, placed.array))
        return out

    for (bits, offset), fp in zip(cases, isolated(run), strict=True):
        assert fp == twin.fingerprint(bits), f"n={bits.size} offset={offset}"


@pytest.mark.parametrize("dtype", ["U8", "BF16", "F32", "F64"])
def test_apply_delta(runtime: EmulatorRuntime, dtype: str) -> None:
    rng = np.random.default_rng(len(dtype))
    cases = []
    for n, m in [(1, 1), (10, 3), (5000, 50), (5000, 5000), (70_000, 9000)]:
        bits = random_bits(rng, dtype, (n,))
        idx = sorted_unique(rng, n, m)
        delta = random_bits(rng, dtype, (idx.size,))
        delta[delta == 0] = 1
        cases.append((bits, idx, delta, offset_of(rng, bits.itemsize)))

    def run() -> list[tuple[Any, ...]]:
        out = []
        for bits, idx, delta, offset in cases:
            placed = Placed(bits, offset)
            change = cuda._apply_delta(runtime, placed.array, idx, delta)
            out.append((change, placed.array.copy(), placed.canaries_intact()))
        return out

    for (bits, idx, delta, _), (change, after, intact) in zip(cases, isolated(run), strict=True):
        held = bits.copy()
        assert change == twin.apply_delta(held, idx, delta)
        np.testing.assert_array_equal(after, held)
        assert intact


def test_apply_delta_checks_indices_on_the_device(runtime: EmulatorRuntime) -> None:
    bits = np.arange(6000, dtype=np.uint16)
    bad_indices = [
        np.array([3, 3], dtype=np.int64),
        np.array([5, 4], dtype=np.int64),
        np.array([-1, 4], dtype=np.int64),
        np.array([0, 6000], dtype=np.int64),
        np.r_[np.arange(5000, dtype=np.int64), 4999],  # late in a grid-stride loop
    ]

    def run() -> list[tuple[bool, bool]]:
        out = []
        for idx in bad_indices:
            held = bits.copy()
            try:
                cuda._apply_delta(runtime, held, idx, np.ones(idx.size, dtype=np.uint16))
                refused = False
            except InvalidInput:
                refused = True
            out.append((refused, bool(np.array_equal(held, bits))))
        return out

    assert isolated(run) == [(True, True)] * len(bad_indices)


@pytest.mark.parametrize("served", ["BF16", "F16"])
def test_cast(runtime: EmulatorRuntime, served: str) -> None:
    rng = np.random.default_rng(4)
    current = np.concatenate([SPECIALS, rng.integers(0, 1 << 32, 20_000, dtype=np.uint32)])
    kind = cast_kind("F32", served)
    got = isolated(lambda: cuda._cast(runtime, Placed(current, 4).array, kind, served))
    np.testing.assert_array_equal(got, cast_bits(current, "F32", served))


def test_decode_gaps(runtime: EmulatorRuntime) -> None:
    gaps = np.array([3, 1, 1, 200], dtype=np.uint8)
    np.testing.assert_array_equal(cuda._decode_gaps(runtime, gaps, 10), twin.decode_gaps(gaps, 10))


def test_apply_patch_and_restore(runtime: EmulatorRuntime) -> None:
    patch, old, new = model_patch(np.random.default_rng(3))

    def run() -> tuple[dict[str, int], dict[str, NDArray[Any]], bool, dict[str, NDArray[Any]]]:
        held = {name: bits.copy() for name, bits in old.items()}
        runtimes = dict.fromkeys(held, runtime)
        fps = cuda._apply_patch(runtimes, patch, held)
        # A holder whose bits are not what its fingerprints claim, at an element the
        # patch changes: found after embed.weight is already patched; both put back.
        lying = {name: bits.copy() for name, bits in old.items()}
        lying["head.bias"][2] ^= 1
        snapshot = {name: bits.copy() for name, bits in lying.items()}
        try:
            cuda._apply_patch(runtimes, patch, lying)
            failed = False
        except VerificationFailed:
            failed = True
        restored = all(np.array_equal(lying[name], snapshot[name]) for name in lying)
        return fps, held, failed and restored, lying

    fps, held, failed_and_restored, _ = isolated(run)
    for name, bits in held.items():
        np.testing.assert_array_equal(bits, new[name])
        assert fps[name] == patch.tensors[name].target_fingerprint
    assert failed_and_restored


@pytest.mark.skipif(not golden_cases(), reason="no golden patch files under tests/golden")
@pytest.mark.parametrize("case", sorted(golden_cases()))
def test_golden_patches_apply_the_same_on_both_paths(runtime: EmulatorRuntime, case: str) -> None:
    # The codec's committed patches (every dtype width, NaN payloads, escaped deltas),
    # decoded by patcher.decode and applied onto the same base by both paths.
    patch = golden_patch(case)
    # The 2**34-element case pins index arithmetic past 32 bits: that is test_cuda.py's
    # job (a GPU holds it); here it would need 16 GiB of host memory.
    checked = [td for td in patch if td.spec.numel <= 1 << 24]
    if not any(td.changed for td in checked):
        pytest.skip("every changed tensor of this case is too large for the CPU emulator")
    rng = np.random.default_rng(8)
    bases = {td.spec.name: random_bits(rng, td.spec.dtype, td.spec.shape) for td in checked}

    def run() -> dict[str, tuple[int, NDArray[Any], NDArray[np.int64]]]:
        out = {}
        for td in checked:
            placed = Placed(bases[td.spec.name], td.spec.width)
            change = cuda._apply_delta(runtime, placed.array, td.indices, td.delta)
            gaps = np.diff(td.indices, prepend=-1)
            out[td.spec.name] = (change, placed.array.copy(), cuda._decode_gaps(runtime, gaps, 0))
        return out

    results = isolated(run)
    for td in checked:
        change, after, indices = results[td.spec.name]
        held = bases[td.spec.name].copy()
        assert change == twin.apply_delta(held, td.indices, td.delta), td.spec.name
        np.testing.assert_array_equal(after, held, err_msg=td.spec.name)
        np.testing.assert_array_equal(indices, td.indices, err_msg=td.spec.name)


STILE = cuda.SELECT_TILE_ELEMENTS


@pytest.mark.parametrize("dtype,shift,width", SELECT_FIELDS)
def test_select_ranks(runtime: EmulatorRuntime, dtype: str, shift: int, width: int) -> None:
    rng = np.random.default_rng(shift * 100 + width)
    cases = [
        select_case(rng, dtype, shift, width, n, classes, density)
        for n in [1, 100, STILE - 1, STILE + 1, 3 * STILE + 77]
        for classes in ([1, 5, 16] if width else [1])
        for density in [0.01, 0.3, 1.0]
    ]
    offsets = [offset_of(rng, c.base.itemsize) for c in cases]

    def run() -> list[tuple[Any, ...]]:
        out = []
        for case, offset in zip(cases, offsets, strict=True):
            placed = Placed(case.base, offset)
            field = ClassField(case.shift, case.mask, case.lo, case.classes)
            got = cuda._select_ranks(
                runtime, placed.array, field, case.start, case.stop, case.query_classes, case.ranks
            )
            out.append((got, placed.canaries_intact(), np.array_equal(placed.array, case.base)))
        return out

    for case, (got, intact, unchanged) in zip(cases, isolated(run), strict=True):
        where = f"n={case.base.size} [{case.start}, {case.stop}) classes={case.classes} m={case.ranks.size}"
        np.testing.assert_array_equal(got, case.expected, err_msg=where)
        window = ClassWindow(case.lo, case.classes)
        want = twin.select_ranks(case.base, dtype, window, case.start, case.stop, case.query_classes, case.ranks)
        np.testing.assert_array_equal(got, want, err_msg=where)
        assert got.dtype == np.int64 and intact and unchanged, where


def test_select_ranks_refuses_bad_queries(runtime: EmulatorRuntime) -> None:
    case = select_case(np.random.default_rng(7), "BF16", 7, 8, 5000, 4, 0.2)
    field = ClassField(7, 0xFF, case.lo, 4)
    c, r = case.query_classes, case.ranks
    counts = np.bincount(
        np.clip(((case.base[case.start : case.stop] >> 7) & 0xFF).astype(np.int64) - case.lo, 0, 3), minlength=4
    )
    top = np.flatnonzero(c == c[-1])
    bad_queries = {
        "past its class": (c, np.concatenate([r[:-1], [counts[c[-1]]]])),
        "class outside the window": (np.concatenate([c[:-1], [4]]).astype(np.uint8), r),
        "negative rank": (c, np.concatenate([[-1], r[1:]])),
        "classes out of order": (c[::-1].copy(), r[::-1].copy()),
        "ranks not increasing": (c, np.concatenate([r[: top[-1]], [r[top[-2]]]])),
    }
    for what, (classes, ranks) in bad_queries.items():
        with pytest.raises(FormatError):
            cuda._select_ranks(runtime, case.base, field, case.start, case.stop, classes, ranks.astype(np.int64))
        assert what
    with pytest.raises(FormatError):
        cuda._select_ranks(runtime, case.base, field, 10, 10, c[:1], np.zeros(1, np.int64))
    empty = cuda._select_ranks(runtime, case.base, field, 0, 0, c[:0], r[:0])
    assert empty.size == 0 and empty.dtype == np.int64


@pytest.mark.parametrize("dtype,shift,width", SELECT_FIELDS)
def test_apply_ranks(runtime: EmulatorRuntime, dtype: str, shift: int, width: int) -> None:
    rng = np.random.default_rng(shift * 10 + width + 1)
    cases = []
    for n in [1, 700, 2 * STILE + 3]:
        for classes in [1, 16] if width else [1]:
            for density in [0.02, 1.0]:
                case = select_case(rng, dtype, shift, width, n, classes, density)
                delta = random_bits(rng, dtype, (case.ranks.size,))
                cases.append((case, delta, offset_of(rng, case.base.itemsize)))

    def run() -> list[tuple[Any, ...]]:
        out = []
        for case, delta, offset in cases:
            placed = Placed(case.base, offset)
            field = ClassField(case.shift, case.mask, case.lo, case.classes)
            change = cuda._apply_ranks(
                runtime, placed.array, field, case.start, case.stop, case.query_classes, case.ranks, delta
            )
            out.append((change, placed.array.copy(), placed.canaries_intact()))
        return out

    for (case, delta, _), (change, after, intact) in zip(cases, isolated(run), strict=True):
        where = f"n={case.base.size} classes={case.classes} m={case.ranks.size}"
        held = case.base.copy()
        window = ClassWindow(case.lo, case.classes)
        want = twin.apply_ranks(held, dtype, window, case.start, case.stop, case.query_classes, case.ranks, delta)
        assert change == want, where
        np.testing.assert_array_equal(after, held, err_msg=where)
        expected = case.base.copy()
        expected[case.expected] += delta
        np.testing.assert_array_equal(held, expected, err_msg=where)
        assert intact, where


def test_select_ranks_inverts_the_encoders_class_ranks(runtime: EmulatorRuntime) -> None:
    # A weight-like BF16 tensor and an Adam-like step, with the window the context
    # codec's encoder picks: the kernel must find every change from its (class, rank).
    rng = np.random.default_rng(11)
    weights = rng.standard_normal(3 * STILE + 501).astype(np.float32) * np.float32(0.02)
    old = cast_bits(weights.view(np.uint32), "F32", "BF16")
    stepped = weights + np.float32(3e-4) * rng.standard_normal(weights.size).astype(np.float32)
    new = cast_bits(stepped.view(np.uint32), "F32", "BF16")
    indices = np.flatnonzero(old != new).astype(np.int64)
    start = 100
    indices = indices[indices >= start]
    window = choose_window(old, "BF16", start, old.size, indices)
    classes, ranks = class_ranks(old, "BF16", window, start, indices)
    order = np.argsort(classes, kind="stable")
    field = ClassField(7, 0xFF, window.lo, window.classes)
    got = isolated(lambda: cuda._select_ranks(runtime, old, field, start, old.size, classes[order], ranks[order]))
    assert window.classes > 1 and indices.size > 100
    np.testing.assert_array_equal(got, indices[order])
