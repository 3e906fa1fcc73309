"""CUDA backend: thin CuPy wrappers around the raw kernels in ``kernels/*.cu``.

Same functions and signatures as :mod:`kernels.numpy_twin` (which documents each one)
and the same bits, on CuPy arrays of one device. Importing this module needs no CuPy
and no GPU: CuPy is imported on first call, and each ``.cu`` file is compiled with
NVRTC on its first use on a device, then cached (in memory here, on disk by CuPy).

Arguments are checked before any launch, exactly as the twin checks them; index
values given to :func:`apply_delta` are checked on the device (range and strict
order) before the scatter runs, so a bad patch never writes outside the tensor.

Streams: kernels run on CuPy's current stream. The functions that return an ``int``
(and :func:`diff_cast`, which needs the number of changes to size its outputs) wait for
their own work to finish before returning. For a torch tensor, take the CuPy view with
``kernels.as_bits`` right before the call: DLPack then orders our stream after the work
already queued on torch's current stream.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Final

import numpy as np

from bulletin.errors import InvalidInput
from kernels._checks import check_apply, check_bits, check_diff_cast, check_gaps
from kernels.types import BitsArray, DiffCast, IndexArray, IntArray
from patcher.cast import cast_kind
from patcher.dtypes import bits_dtype

__all__ = [
    "BLOCK",
    "KERNEL_FILES",
    "TILE_ELEMENTS",
    "apply_delta",
    "cast",
    "decode_gaps",
    "diff_cast",
    "fingerprint",
    "kernel_source",
]

KERNEL_DIR: Final = Path(__file__).resolve().parent
#: The kernel sources, by module name (kernels/<name>.cu).
KERNEL_FILES: Final = ("apply", "cast", "diff", "fingerprint")
#: Threads per block; every kernel is written for exactly this (kernels/common.cuh).
BLOCK: Final = 256
#: Elements per tile of diff_cast: 256 threads x 4 groups x 8 elements (kernels/diff.cu).
TILE_ELEMENTS: Final = 8192
_TILE_MASK_BYTES: Final = TILE_ELEMENTS // 8
_MAX_GRID: Final = (1 << 31) - 1
_SUFFIX: Final = {1: "u8", 2: "u16", 4: "u32", 8: "u64"}
_INCLUDE: Final = re.compile(r'^#include "common\.cuh"[ \t]*$', re.MULTILINE)
_MASK64: Final = (1 << 64) - 1


def kernel_source(name: str) -> str:
    """The text NVRTC compiles for ``kernels/<name>.cu``: the file with common.cuh pasted
    in, so that it needs no include path and CuPy's cache key covers every byte of it."""
    if name not in KERNEL_FILES:
        raise InvalidInput(f"unknown kernel file {name!r}; known: {', '.join(KERNEL_FILES)}")
    text = (KERNEL_DIR / f"{name}.cu").read_text(encoding="utf-8")
    common = (KERNEL_DIR / "common.cuh").read_text(encoding="utf-8")
    return _INCLUDE.sub(lambda _: common, text, count=1)


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise InvalidInput(
            "the CUDA backend needs CuPy (pip install 'bulletin[gpu]') and CuPy arrays"
        ) from exc
    return cupy


@functools.cache
def _module(name: str, device_id: int) -> Any:
    # One RawModule per device: a loaded CUmodule belongs to one device's context.
    cp = _cupy()
    with cp.cuda.Device(device_id):
        return cp.RawModule(code=kernel_source(name), options=("-std=c++17",))


@functools.cache
def _sm_count(device_id: int) -> int:
    cp = _cupy()
    return int(cp.cuda.Device(device_id).attributes["MultiProcessorCount"])


def _kernel(name: str, function: str, device_id: int) -> Any:
    return _module(name, device_id).get_function(function)


def _device_array(array: object, what: str) -> Any:
    cp = _cupy()
    if not isinstance(array, cp.ndarray):
        raise InvalidInput(
            f"{what}: the CUDA backend needs a cupy.ndarray, got {type(array).__name__}"
        )
    if array.data.ptr % max(array.dtype.itemsize, 1):
        raise InvalidInput(f"{what}: array is not aligned to its element size")
    return array


def _same_device(*arrays: Any) -> int:
    devices = {int(a.device.id) for a in arrays}
    if len(devices) != 1:
        raise InvalidInput(f"arrays live on different devices: {sorted(devices)}")
    return devices.pop()


def _grid(items: int, per_block: int, device_id: int, waves: int = 8) -> int:
    # Enough blocks for every SM several times over; grid-stride loops do the rest.
    return max(1, min(-(-items // per_block), _sm_count(device_id) * waves, _MAX_GRID))


def _vector_align(width: int) -> int:
    """Byte alignment of an 8-element vector load (kernels/common.cuh ``Vec8``)."""
    return min(16, 8 * width)


def _aligned_phase(ptr: int, width: int) -> int:
    """Elements from ``ptr`` back to the previous vector boundary."""
    return (ptr % _vector_align(width)) // width


def cast(current: BitsArray, current_dtype: str, served_dtype: str) -> BitsArray:
    """A new device array holding ``current`` cast exactly to ``served_dtype``."""
    cp = _cupy()
    src = _device_array(current, "current")
    check_bits(src, "current", dtype=current_dtype)
    kind = cast_kind(current_dtype, served_dtype)
    if kind == "identity":
        return src.copy()
    device = int(src.device.id)
    with cp.cuda.Device(device):
        out = cp.empty(src.shape, dtype=cp.uint16)
        n = int(src.size)
        if n:
            fn = _kernel("cast", f"cast_{kind}", device)
            fn((_grid(n, BLOCK, device),), (BLOCK,), (src, out, np.uint64(n)))
    return out


def diff_cast(
    current: BitsArray, kept: BitsArray, *, current_dtype: str, served_dtype: str
) -> DiffCast:
    """Fused cast + compare + compact on the GPU; see ``numpy_twin.diff_cast``."""
    cp = _cupy()
    cur = _device_array(current, "current")
    old = _device_array(kept, "kept")
    kind = check_diff_cast(cur, old, current_dtype, served_dtype)
    device = _same_device(cur, old)
    served = bits_dtype(served_dtype)
    n = int(cur.size)
    with cp.cuda.Device(device):
        if n == 0:
            return DiffCast(cp.empty(0, dtype=cp.int64), cp.empty(0, dtype=served), 0)
        suffix = _SUFFIX[served.itemsize] if kind == "identity" else kind
        src_width, dst_width = cur.dtype.itemsize, served.itemsize
        # Shift positions so that groups of eight start on vector boundaries of `kept`;
        # `cur` is read with vector loads only if that shift aligns it too.
        shift = _aligned_phase(int(old.data.ptr), dst_width)
        cur_vec = (int(cur.data.ptr) - src_width * shift) % _vector_align(src_width) == 0
        tiles = -(-(n + shift) // TILE_ELEMENTS)
        if tiles > _MAX_GRID:
            raise InvalidInput(f"tensor of {n} elements is too large for one launch")
        mask = cp.empty(tiles * _TILE_MASK_BYTES, dtype=cp.uint8)
        counts = cp.empty(tiles, dtype=cp.uint32)
        mark = _kernel("diff", f"diff_mark_{suffix}", device)
        mark(
            (tiles,),
            (BLOCK,),
            (cur, old, np.uint64(n), np.uint32(shift), np.int32(cur_vec), mask, counts),
        )
        inclusive = cp.cumsum(counts, dtype=cp.int64)
        total = int(inclusive[-1])  # the one small device-to-host copy that sizes outputs
        if total == 0:
            return DiffCast(cp.empty(0, dtype=cp.int64), cp.empty(0, dtype=served), 0)
        out_index = cp.empty(total, dtype=cp.int64)
        out_delta = cp.empty(total, dtype=served)
        fp = cp.zeros(1, dtype=cp.uint64)
        emit = _kernel("diff", f"diff_emit_{suffix}", device)
        emit(
            (tiles,),
            (BLOCK,),
            (cur, old, np.uint32(shift), mask, counts, inclusive, out_index, out_delta, fp),
        )
        return DiffCast(out_index, out_delta, int(fp.get()[0]) & _MASK64)


def decode_gaps(gaps: IntArray, start: int = 0) -> IndexArray:
    """Indices from index gaps by a prefix sum on the device; see ``numpy_twin.decode_gaps``."""
    cp = _cupy()
    g = _device_array(gaps, "gaps")
    check_gaps(g, start)
    with cp.cuda.Device(int(g.device.id)):
        indices = cp.cumsum(g, dtype=cp.int64)
        if start:
            indices += start
    return indices


def apply_delta(bits: BitsArray, indices: IndexArray, delta: BitsArray) -> int:
    """Scatter-add ``delta`` into ``bits`` in place and return the fingerprint change;
    see ``numpy_twin.apply_delta``. Index values are checked on the device first."""
    cp = _cupy()
    b = _device_array(bits, "bits")
    idx = _device_array(indices, "indices")
    d = _device_array(delta, "delta")
    check_apply(b, idx, d)
    device = _same_device(b, idx, d)
    m, n = int(idx.size), int(b.size)
    if m == 0:
        return 0
    with cp.cuda.Device(device):
        bad = cp.zeros(1, dtype=cp.uint32)
        grid = _grid(m, BLOCK, device, waves=16)
        check = _kernel("apply", "check_indices", device)
        check((grid,), (BLOCK,), (idx, np.uint64(m), np.int64(n), bad))
        if int(bad.get()[0]):
            raise InvalidInput(f"indices must be strictly increasing and within [0, {n})")
        fp = cp.zeros(1, dtype=cp.uint64)
        scatter = _kernel("apply", f"apply_{_SUFFIX[b.dtype.itemsize]}", device)
        scatter((grid,), (BLOCK,), (b, idx, d, np.uint64(m), fp))
        return int(fp.get()[0]) & _MASK64


def fingerprint(bits: BitsArray) -> int:
    """Full fingerprint of a device bits array, the same number as patcher.fingerprint."""
    cp = _cupy()
    b = _device_array(bits, "bits")
    check_bits(b, "bits")
    n = int(b.size)
    if n == 0:
        return 0
    device = int(b.device.id)
    width = b.dtype.itemsize
    # Elements before the first vector boundary are hashed one by one (kernels/fingerprint.cu).
    head = min(n, (-_aligned_phase(int(b.data.ptr), width)) % (_vector_align(width) // width))
    with cp.cuda.Device(device):
        out = cp.zeros(1, dtype=cp.uint64)
        fn = _kernel("fingerprint", f"fingerprint_{_SUFFIX[width]}", device)
        groups = (n - head) // 8
        fn((_grid(groups, BLOCK, device),), (BLOCK,), (b, np.uint64(n), np.uint64(head), out))
        return int(out.get()[0])
