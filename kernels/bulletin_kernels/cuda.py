"""CUDA backend: thin CuPy wrappers around the raw kernels in ``kernels/bulletin_kernels/*.cu``.

Same functions and signatures as :mod:`bulletin_kernels.numpy_twin` (which documents each one)
and the same bits, on CuPy arrays of one device. Importing this module needs no CuPy
and no GPU: CuPy is imported on first call, and each ``.cu`` file is compiled with
NVRTC on its first use on a device, then cached (in memory here, on disk by CuPy).

Arguments are checked before any launch, exactly as the twin checks them; index
values given to :func:`apply_delta` are checked on the device (range and strict
order) before the scatter runs, so a bad patch never writes outside the tensor.

Streams: kernels run on CuPy's current stream. The functions that return an ``int``
(and :func:`diff_cast`, which needs the number of changes to size its outputs) wait for
their own work to finish before returning. For a torch tensor, take the CuPy view with
``bulletin_kernels.as_bits`` right before the call: DLPack then orders our stream after the work
already queued on torch's current stream.

The launch logic is written against a small ``Runtime`` (array module, pointers,
launches) so that tests/kernels/emulator.py can run it, and the kernel sources
themselves, on the CPU with NumPy arrays.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, NamedTuple, Protocol

import numpy as np

from bulletin_kernels._checks import (
    ClassField,
    check_apply,
    check_apply_ranks,
    check_bits,
    check_diff_cast,
    check_disjoint,
    check_gaps,
    check_patch_targets,
    check_select_order,
    check_select_ranks,
)
from bulletin_kernels.types import BitsArray, ClassArray, ClassWindowLike, IndexArray, IntArray
from patcher.cast import CastKind, cast_kind
from patcher.dtypes import bits_dtype
from patcher.errors import FormatError, InvalidInput, VerificationFailed
from patcher.patch import Change, Patch

__all__ = [
    "BLOCK",
    "KERNEL_DIR",
    "KERNEL_ENTRIES",
    "KERNEL_FILES",
    "SELECT_TILE_ELEMENTS",
    "TILE_ELEMENTS",
    "DiffPlan",
    "Runtime",
    "apply",
    "apply_delta",
    "apply_ranks",
    "cast",
    "decode_gaps",
    "diff_cast",
    "fingerprint",
    "kernel_source",
    "plan_diff",
    "plan_fingerprint",
    "select_ranks",
]

KERNEL_DIR: Final = Path(__file__).resolve().parent
#: The kernel sources, by module name (kernels/bulletin_kernels/<name>.cu).
KERNEL_FILES: Final = ("apply", "cast", "diff", "fingerprint", "select")
_SUFFIXES: Final = ("u8", "u16", "u32", "u64")
#: The kernels each file defines (extern "C"), all launched from this module.
KERNEL_ENTRIES: Final[dict[str, tuple[str, ...]]] = {
    "apply": ("check_indices", "apply_u8", "apply_u16", "apply_u32", "apply_u64"),
    "cast": ("cast_f32_bf16", "cast_f32_f16"),
    "diff": tuple(
        f"diff_{step}_{suffix}"
        for suffix in ("u8", "u16", "u32", "u64", "f32_bf16", "f32_f16")
        for step in ("mark", "emit")
    ),
    "fingerprint": ("fingerprint_u8", "fingerprint_u16", "fingerprint_u32", "fingerprint_u64"),
    "select": tuple(f"{step}_{suffix}" for suffix in _SUFFIXES for step in ("class_counts", "select", "apply_ranks")),
}
#: Threads per block; every kernel is written for exactly this (kernels/bulletin_kernels/common.cuh).
BLOCK: Final = 256
#: Elements per tile of diff_cast: 256 threads x 4 groups x 8 elements (kernels/bulletin_kernels/diff.cu).
TILE_ELEMENTS: Final = 8192
#: Elements per tile of select_ranks: 256 threads x 8 rounds (kernels/bulletin_kernels/select.cu).
SELECT_TILE_ELEMENTS: Final = 2048
_TILE_MASK_BYTES: Final = TILE_ELEMENTS // 8
_MAX_GRID: Final = (1 << 31) - 1
_SUFFIX: Final = {1: "u8", 2: "u16", 4: "u32", 8: "u64"}
_INCLUDE: Final = re.compile(r'^#include "common\.cuh"[ \t]*$', re.MULTILINE)
_MASK64: Final = (1 << 64) - 1


def kernel_source(name: str) -> str:
    """The text NVRTC compiles for ``kernels/bulletin_kernels/<name>.cu``: the file with common.cuh pasted
    in, so that it needs no include path and CuPy's cache key covers every byte of it."""
    if name not in KERNEL_FILES:
        raise InvalidInput(f"unknown kernel file {name!r}; known: {', '.join(KERNEL_FILES)}")
    text = (KERNEL_DIR / f"{name}.cu").read_text(encoding="utf-8")
    common = (KERNEL_DIR / "common.cuh").read_text(encoding="utf-8")
    return _INCLUDE.sub(lambda _: common, text, count=1)


# -- launch planning (pure arithmetic on addresses and sizes) --------------------------


def _vector_align(width: int) -> int:
    """Byte alignment of an 8-element vector load (``Vec8`` in kernels/bulletin_kernels/common.cuh)."""
    return min(16, 8 * width)


class DiffPlan(NamedTuple):
    """How diff_cast launches for given arrays (see kernels/bulletin_kernels/diff.cu)."""

    #: Elements between the previous vector boundary of ``kept`` and its first element.
    shift: int
    #: Whether ``current`` is vector-aligned under the same shift.
    cur_vec: bool
    #: Tiles of ``TILE_ELEMENTS`` virtual positions: the grid of both passes.
    tiles: int


def plan_diff(cur_ptr: int, kept_ptr: int, n: int, src_width: int, dst_width: int) -> DiffPlan:
    """Launch plan of diff_cast for ``n`` elements at these addresses."""
    # Virtual position v = i + shift puts every group of eight on a vector boundary of
    # `kept` wherever the view starts; `cur` gets vector loads only if it lines up too.
    shift = (kept_ptr % _vector_align(dst_width)) // dst_width
    cur_vec = (cur_ptr - src_width * shift) % _vector_align(src_width) == 0
    tiles = -(-(n + shift) // TILE_ELEMENTS)
    if tiles > _MAX_GRID:
        raise InvalidInput(f"tensor of {n} elements is too large for one launch")
    return DiffPlan(shift, cur_vec, tiles)


def plan_fingerprint(ptr: int, n: int, width: int) -> int:
    """Elements hashed one by one before the first vector boundary (``head``)."""
    align = _vector_align(width)
    phase = (ptr % align) // width
    return min(n, -phase % (align // width))


def _grid(items: int, sm_count: int, waves: int = 8) -> int:
    # Enough blocks for every SM several times over; grid-stride loops do the rest.
    return max(1, min(-(-items // BLOCK), sm_count * waves, _MAX_GRID))


# -- where kernels run ------------------------------------------------------------------


class Runtime(Protocol):
    """What the launch logic needs from a device: CuPy here, an emulator in tests."""

    @property
    def xp(self) -> Any:
        """The array module (``cupy``, or ``numpy`` under the emulator)."""
        ...

    def activate(self) -> contextlib.AbstractContextManager[Any]:
        """Make this device current for allocations and launches."""
        ...

    def ptr(self, array: Any) -> int:
        """Address of an array's first element."""
        ...

    def sm_count(self) -> int:
        """Number of multiprocessors (sizes grid-stride launches)."""
        ...

    def launch(self, file: str, kernel: str, grid: int, args: tuple[Any, ...]) -> None:
        """Launch ``kernel`` of ``kernels/<file>.cu`` with ``grid`` blocks of ``BLOCK``."""
        ...


class _CupyRuntime:
    def __init__(self, device_id: int) -> None:
        self.xp = _cupy()
        self.device_id = device_id

    def activate(self) -> contextlib.AbstractContextManager[Any]:
        device: contextlib.AbstractContextManager[Any] = self.xp.cuda.Device(self.device_id)
        return device

    def ptr(self, array: Any) -> int:
        return int(array.data.ptr)

    def sm_count(self) -> int:
        return _sm_count(self.device_id)

    def launch(self, file: str, kernel: str, grid: int, args: tuple[Any, ...]) -> None:
        _module(file, self.device_id).get_function(kernel)((grid,), (BLOCK,), args)


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise InvalidInput("the CUDA backend needs CuPy (pip install 'bulletin[gpu]') and CuPy arrays") from exc
    return cupy


@functools.cache
def _module(name: str, device_id: int) -> Any:
    # One RawModule per device: a loaded CUmodule belongs to one device's context. The
    # sources are valid C++11 through C++20, so CuPy's default -std is fine.
    cp = _cupy()
    with cp.cuda.Device(device_id):
        return cp.RawModule(code=kernel_source(name))


@functools.cache
def _sm_count(device_id: int) -> int:
    return int(_cupy().cuda.Device(device_id).attributes["MultiProcessorCount"])


@functools.cache
def _runtime(device_id: int) -> _CupyRuntime:
    return _CupyRuntime(device_id)


def _device_array(array: object, what: str) -> Any:
    cp = _cupy()
    if not isinstance(array, cp.ndarray):
        raise InvalidInput(f"{what}: the CUDA backend needs a cupy.ndarray, got {type(array).__name__}")
    if array.data.ptr % array.dtype.itemsize:
        raise InvalidInput(f"{what}: array is not aligned to its element size")
    return array


def _runtime_of(*arrays: Any) -> _CupyRuntime:
    devices = {int(a.device.id) for a in arrays}
    if len(devices) != 1:
        raise InvalidInput(f"arrays live on different devices: {sorted(devices)}")
    return _runtime(devices.pop())


# -- the backend ------------------------------------------------------------------------


def cast(current: BitsArray, current_dtype: str, served_dtype: str) -> BitsArray:
    """A new device array holding ``current`` cast exactly to ``served_dtype``."""
    src = _device_array(current, "current")
    check_bits(src, "current", dtype=current_dtype)
    kind = cast_kind(current_dtype, served_dtype)
    return _cast(_runtime_of(src), src, kind, served_dtype)


def diff_cast(
    current: BitsArray, kept: BitsArray, *, current_dtype: str, served_dtype: str
) -> Change[IndexArray, BitsArray]:
    """Fused cast + compare + compact on the GPU; see ``numpy_twin.diff_cast``."""
    cur = _device_array(current, "current")
    old = _device_array(kept, "kept")
    kind = check_diff_cast(cur, old, current_dtype, served_dtype)
    check_disjoint((cur.data.ptr, cur.nbytes), (old.data.ptr, old.nbytes), "current and kept")
    return _diff_cast(_runtime_of(cur, old), cur, old, kind, served_dtype)


def decode_gaps(gaps: IntArray, start: int = 0) -> IndexArray:
    """Indices from index gaps by a prefix sum on the device; see ``numpy_twin.decode_gaps``."""
    g = _device_array(gaps, "gaps")
    check_gaps(g, start)
    return _decode_gaps(_runtime_of(g), g, start)


def apply_delta(bits: BitsArray, indices: IndexArray, delta: BitsArray) -> int:
    """Scatter-add ``delta`` into ``bits`` in place and return the fingerprint change;
    see ``numpy_twin.apply_delta``. Index values are checked on the device first."""
    b = _device_array(bits, "bits")
    idx = _device_array(indices, "indices")
    d = _device_array(delta, "delta")
    check_apply(b, idx, d)
    return _apply_delta(_runtime_of(b, idx, d), b, idx, d)


def fingerprint(bits: BitsArray) -> int:
    """Full fingerprint of a device bits array, the same number as patcher.fingerprint."""
    b = _device_array(bits, "bits")
    check_bits(b, "bits")
    return _fingerprint(_runtime_of(b), b)


def select_ranks(
    base: BitsArray,
    dtype: str,
    window: ClassWindowLike,
    start: int,
    stop: int,
    classes: ClassArray,
    ranks: IndexArray,
) -> IndexArray:
    """Flat indices of (class, rank) queries over the base's exponent classes, on the
    device; see ``numpy_twin.select_ranks``. Two passes over ``base[start:stop]``
    (kernels/bulletin_kernels/select.cu); the queries' order and ranks are checked on the device first."""
    b = _device_array(base, "base")
    c = _device_array(classes, "classes")
    r = _device_array(ranks, "ranks")
    field = check_select_ranks(b, dtype, window, start, stop, c, r)
    return _select_ranks(_runtime_of(b, c, r), b, field, start, stop, c, r)


def apply_ranks(
    bits: BitsArray,
    dtype: str,
    window: ClassWindowLike,
    start: int,
    stop: int,
    classes: ClassArray,
    ranks: IndexArray,
    delta: BitsArray,
) -> int:
    """``select_ranks`` fused with the scatter-add of ``apply_delta``, in place on the
    device; see ``numpy_twin.apply_ranks``. Everything is checked before the first write."""
    b = _device_array(bits, "bits")
    c = _device_array(classes, "classes")
    r = _device_array(ranks, "ranks")
    d = _device_array(delta, "delta")
    field = check_apply_ranks(b, dtype, window, start, stop, c, r, d)
    return _apply_ranks(_runtime_of(b, c, r, d), b, field, start, stop, c, r, d)


def apply(patch: Patch, tensors: Mapping[str, BitsArray], fingerprints: Mapping[str, int]) -> dict[str, int]:
    """Apply a whole patch in place to device bits arrays; the GPU twin of ``patcher.apply``.

    ``tensors`` maps every tensor of the patch, and nothing else, to its device bits
    array; ``fingerprints`` holds their current fingerprints. Layout and every base
    fingerprint are checked before anything is written (``IncompatibleTensors``,
    ``WrongBase``). Tensors are then patched one by one, each one's new fingerprint
    computed from the bits it overwrote; if one does not reach its target, or its indices
    are refused, every tensor already patched is put back bit for bit (wrapping
    addition is undone by adding the negated deltas) before ``VerificationFailed`` or
    ``InvalidInput`` is raised. Returns the new fingerprints.
    """
    arrays = {name: _device_array(array, name) for name, array in tensors.items()}
    check_patch_targets(patch, arrays, fingerprints)
    runtimes = {name: _runtime_of(array) for name, array in arrays.items()}
    return _apply_patch(runtimes, patch, arrays)


# -- launch logic, on any Runtime ---------------------------------------------------------


def _cast(rt: Runtime, src: Any, kind: CastKind, served_dtype: str) -> Any:
    xp = rt.xp
    with rt.activate():
        if kind == "identity":
            return src.copy()
        out = xp.empty(src.shape, dtype=bits_dtype(served_dtype))
        n = int(src.size)
        if n:
            rt.launch("cast", f"cast_{kind}", _grid(n, rt.sm_count()), (src, out, np.uint64(n)))
        return out


def _diff_cast(rt: Runtime, cur: Any, old: Any, kind: CastKind, served_dtype: str) -> Change[Any, Any]:
    xp = rt.xp
    served = bits_dtype(served_dtype)
    n = int(cur.size)
    with rt.activate():
        if n == 0:
            return Change(xp.empty(0, dtype=np.int64), xp.empty(0, dtype=served), 0)
        suffix = _SUFFIX[served.itemsize] if kind == "identity" else kind
        plan = plan_diff(rt.ptr(cur), rt.ptr(old), n, cur.dtype.itemsize, served.itemsize)
        mask = xp.empty(plan.tiles * _TILE_MASK_BYTES, dtype=np.uint8)
        counts = xp.empty(plan.tiles, dtype=np.uint32)
        shift = np.uint32(plan.shift)
        mark_args = (cur, old, np.uint64(n), shift, np.int32(plan.cur_vec), mask, counts)
        rt.launch("diff", f"diff_mark_{suffix}", plan.tiles, mark_args)
        inclusive = xp.cumsum(counts, dtype=np.int64)
        total = int(inclusive[-1])  # the one small device-to-host copy that sizes outputs
        if total == 0:
            return Change(xp.empty(0, dtype=np.int64), xp.empty(0, dtype=served), 0)
        out_index = xp.empty(total, dtype=np.int64)
        out_delta = xp.empty(total, dtype=served)
        fp = xp.zeros(1, dtype=np.uint64)
        emit_args = (cur, old, shift, mask, counts, inclusive, out_index, out_delta, fp)
        rt.launch("diff", f"diff_emit_{suffix}", plan.tiles, emit_args)
        return Change(out_index, out_delta, int(fp[0]) & _MASK64)


def _decode_gaps(rt: Runtime, gaps: Any, start: int) -> Any:
    with rt.activate():
        # A prefix sum is bandwidth-bound and CuPy's (CUB's) scan is as fast as one gets.
        indices = rt.xp.cumsum(gaps, dtype=np.int64)
        indices += start - 1
        return indices


def _apply_delta(rt: Runtime, bits: Any, idx: Any, delta: Any) -> int:
    xp = rt.xp
    m, n = int(idx.size), int(bits.size)
    if m == 0:
        return 0
    with rt.activate():
        grid = _grid(m, rt.sm_count(), waves=16)
        bad = xp.zeros(1, dtype=np.uint32)
        rt.launch("apply", "check_indices", grid, (idx, np.uint64(m), np.int64(n), bad))
        if int(bad[0]):
            raise InvalidInput(f"indices must be strictly increasing and within [0, {n})")
        fp = xp.zeros(1, dtype=np.uint64)
        suffix = _SUFFIX[bits.dtype.itemsize]
        rt.launch("apply", f"apply_{suffix}", grid, (bits, idx, delta, np.uint64(m), fp))
        return int(fp[0]) & _MASK64


def _fingerprint(rt: Runtime, bits: Any) -> int:
    n = int(bits.size)
    if n == 0:
        return 0
    width = bits.dtype.itemsize
    head = plan_fingerprint(rt.ptr(bits), n, width)
    with rt.activate():
        out = rt.xp.zeros(1, dtype=np.uint64)
        grid = _grid((n - head) // 8, rt.sm_count())
        rt.launch("fingerprint", f"fingerprint_{_SUFFIX[width]}", grid, (bits, np.uint64(n), np.uint64(head), out))
        return int(out[0])


class _SelectPlan(NamedTuple):
    """How pass 2 of select_ranks / apply_ranks launches (kernels/bulletin_kernels/select.cu)."""

    suffix: str
    tiles: int
    #: Its arguments up to, not including, its outputs.
    args: tuple[Any, ...]


def _select_plan(
    rt: Runtime, base: Any, field: ClassField, start: int, stop: int, classes: Any, ranks: Any
) -> _SelectPlan | None:
    """Pass 1 and the host-side steps of select_ranks: None when there are no queries.
    Every check is done when this returns."""
    xp = rt.xp
    m, n, k = int(ranks.size), stop - start, field.classes
    if m == 0:
        return None
    check_select_order(xp, classes, ranks, k)
    if n == 0:
        raise FormatError(f"{m} ranks in an empty element range")
    tiles = -(-n // SELECT_TILE_ELEMENTS)
    if tiles > _MAX_GRID:
        raise InvalidInput(f"an element range of {n} is too large for one launch")
    flat = base.reshape(-1)
    suffix = _SUFFIX[flat.dtype.itemsize]
    common: tuple[Any, ...] = (flat, np.uint64(start), np.uint64(n), np.uint32(field.shift))
    common += (np.uint64(field.mask), np.int64(field.lo), np.uint32(k), np.uint64(tiles))
    counts = xp.empty(k * tiles, dtype=np.uint32)
    rt.launch("select", f"class_counts_{suffix}", tiles, (*common, counts))
    # offsets[c, t]: elements of class c in the tiles before t (row c ends with c's total).
    offsets = xp.zeros((k, tiles + 1), dtype=np.int64)
    offsets[:, 1:] = xp.cumsum(counts.reshape(k, tiles), axis=1, dtype=np.int64)
    totals = offsets[:, -1]
    if bool(xp.any(ranks >= totals[classes.astype(np.int64)])):
        raise FormatError(f"a rank is not below the count of its class in [{start}, {stop})")
    # bounds[c, t]: the first query of class c whose rank is in tile t or later (the
    # queries of class c are one run, ranks increasing: classes are sorted).
    runs = xp.searchsorted(classes, xp.arange(k + 1, dtype=np.uint8)).tolist()
    bounds = xp.empty((k, tiles + 1), dtype=np.int64)
    for c in range(k):
        bounds[c] = xp.searchsorted(ranks[runs[c] : runs[c + 1]], offsets[c]) + runs[c]
    return _SelectPlan(suffix, tiles, (*common, offsets, bounds, ranks))


def _select_ranks(rt: Runtime, base: Any, field: ClassField, start: int, stop: int, classes: Any, ranks: Any) -> Any:
    with rt.activate():
        plan = _select_plan(rt, base, field, start, stop, classes, ranks)
        out = rt.xp.empty(int(ranks.size), dtype=np.int64)
        if plan is not None:
            rt.launch("select", f"select_{plan.suffix}", plan.tiles, (*plan.args, out))
        return out


def _apply_ranks(
    rt: Runtime, bits: Any, field: ClassField, start: int, stop: int, classes: Any, ranks: Any, delta: Any
) -> int:
    with rt.activate():
        plan = _select_plan(rt, bits, field, start, stop, classes, ranks)
        if plan is None:
            return 0
        fp = rt.xp.zeros(1, dtype=np.uint64)
        rt.launch("select", f"apply_ranks_{plan.suffix}", plan.tiles, (*plan.args, delta, fp))
        return int(fp[0]) & _MASK64


def _apply_patch(runtimes: Mapping[str, Runtime], patch: Patch, arrays: Mapping[str, Any]) -> dict[str, int]:
    done: list[tuple[Runtime, Any, Any, Any]] = []
    new: dict[str, int] = {}
    try:
        for name, td in patch.tensors.items():
            rt, bits = runtimes[name], arrays[name]
            change = 0
            if td.changed:
                with rt.activate():
                    idx = rt.xp.asarray(td.indices)
                    delta = rt.xp.asarray(td.delta)
                check_apply(bits, idx, delta)
                change = _apply_delta(rt, bits, idx, delta)
                done.append((rt, bits, idx, delta))
            new[name] = (td.base_fingerprint + change) & _MASK64
            if new[name] != td.target_fingerprint:
                raise VerificationFailed(
                    f"{name}: fingerprint after apply is {new[name]:016x}, "
                    f"the patch promises {td.target_fingerprint:016x}"
                )
    except BaseException:
        for rt, bits, idx, delta in reversed(done):
            with rt.activate():
                undo = -delta  # unsigned negation wraps: adding it restores the old bits
            _apply_delta(rt, bits, idx, undo)
        raise
    return new
