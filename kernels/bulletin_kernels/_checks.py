"""Argument checks shared by both backends, run before anything is read or written.

They only look at ``dtype``, ``shape``, ``ndim``, ``size`` and ``flags``, which NumPy and
CuPy arrays both have, so the two backends refuse exactly the same inputs with the
same errors. :func:`check_select_order` alone reads values, through the array module
it is given (NumPy, or CuPy on the device).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from patcher.cast import CastKind, cast_kind
from patcher.dtypes import BITS_DTYPES, bits_dtype
from patcher.errors import FormatError, IncompatibleTensors, InvalidInput, WrongBase
from patcher.patch import Patch, check_names

__all__ = [
    "ClassField",
    "check_apply",
    "check_apply_ranks",
    "check_bits",
    "check_diff_cast",
    "check_disjoint",
    "check_gaps",
    "check_patch_targets",
    "check_select_order",
    "check_select_ranks",
]

_INT64 = np.dtype(np.int64)


def check_bits(array: Any, what: str, *, dtype: str | None = None, writable: bool = False) -> None:
    """``array`` is a C-contiguous unsigned bits array (of ``dtype``'s width if given)."""
    expected = bits_dtype(dtype) if dtype is not None else None
    actual = array.dtype
    if expected is not None and actual != expected:
        raise InvalidInput(
            f"{what}: {dtype} bits must be a {expected} array, got {actual} (take a bits view with kernels.as_bits)"
        )
    if expected is None and actual not in BITS_DTYPES.values():
        raise InvalidInput(f"{what}: expected an unsigned bits array, got {actual}")
    if not array.flags.c_contiguous:
        raise InvalidInput(f"{what}: array must be C-contiguous")
    # CuPy arrays have no writeable flag: device memory is always writable.
    if writable and not getattr(array.flags, "writeable", True):
        raise InvalidInput(f"{what}: array is read-only")


def check_diff_cast(current: Any, kept: Any, current_dtype: str, served_dtype: str) -> CastKind:
    """Arguments of ``diff_cast``; returns the cast to apply."""
    kind = cast_kind(current_dtype, served_dtype)
    check_bits(current, "current", dtype=current_dtype)
    check_bits(kept, "kept", dtype=served_dtype, writable=True)
    if tuple(current.shape) != tuple(kept.shape):
        raise IncompatibleTensors(f"current has shape {tuple(current.shape)}, kept bits {tuple(kept.shape)}")
    return kind


def check_disjoint(first: tuple[int, int], second: tuple[int, int], what: str) -> None:
    """Two (address, nbytes) ranges do not overlap: a kernel that reads one while writing
    the other in place would see half-updated data."""
    (a, a_size), (b, b_size) = first, second
    if a_size and b_size and a < b + b_size and b < a + a_size:
        raise InvalidInput(f"{what} share memory")


def check_gaps(gaps: Any, start: int) -> None:
    """Arguments of ``decode_gaps``."""
    if gaps.ndim != 1 or gaps.dtype.kind not in "ui":
        raise InvalidInput(f"gaps must be a 1-d integer array, got {gaps.ndim}-d {gaps.dtype}")
    if not gaps.flags.c_contiguous:
        raise InvalidInput("gaps must be contiguous")
    if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < 1 << 63:
        raise InvalidInput(f"start must be an int in [0, 2**63), got {start!r}")


def check_apply(bits: Any, indices: Any, delta: Any) -> None:
    """Arguments of ``apply_delta``, except the index values (each backend checks those)."""
    check_bits(bits, "bits", writable=True)
    if indices.dtype != _INT64 or indices.ndim != 1 or not indices.flags.c_contiguous:
        raise InvalidInput(f"indices must be a contiguous 1-d int64 array, got {indices.ndim}-d {indices.dtype}")
    if delta.dtype != bits.dtype or delta.ndim != 1 or not delta.flags.c_contiguous:
        raise InvalidInput(f"delta must be a contiguous 1-d {bits.dtype} array, got {delta.ndim}-d {delta.dtype}")
    if delta.size != indices.size:
        raise InvalidInput(f"{indices.size} indices but {delta.size} deltas")


def check_patch_targets(patch: Patch, tensors: Mapping[str, Any], fingerprints: Mapping[str, int]) -> None:
    """The holder's arrays match the patch's layout and its base fingerprints.

    ``tensors`` must hold exactly the patch's tensors (``IncompatibleTensors``), each a
    writable C-contiguous bits array of the spec's width and shape, and ``fingerprints``
    the base fingerprint of each (``WrongBase`` otherwise).
    """
    check_names(patch.tensors, tensors, "tensor sets differ")
    for name, td in patch.tensors.items():
        array = tensors[name]
        check_bits(array, name, dtype=td.spec.dtype, writable=True)
        if tuple(array.shape) != td.spec.shape:
            raise IncompatibleTensors(f"{name}: patch has shape {td.spec.shape}, array {tuple(array.shape)}")
    for name, td in patch.tensors.items():
        held = fingerprints.get(name)
        if held != td.base_fingerprint:
            shown = "unknown" if held is None else f"{held:016x}"
            raise WrongBase(f"{name}: patch expects base {td.base_fingerprint:016x}, holder has {shown}")


class ClassField(NamedTuple):
    """How select_ranks classes an element's bits b: ``clip(((b >> shift) & mask) - lo,
    0, classes - 1)`` (``patcher.context.element_classes``; mask 0 for dtypes without
    an exponent field)."""

    shift: int
    mask: int
    lo: int
    classes: int


def check_select_ranks(
    base: Any, dtype: str, window: Any, start: int, stop: int, classes: Any, ranks: Any
) -> ClassField:
    """Arguments of ``select_ranks`` but the query values (:func:`check_select_order`,
    and the ranks against the class counts, which each backend checks as it counts)."""
    from patcher.context import EXPONENT_FIELDS, check_window

    check_bits(base, "base", dtype=dtype)
    check_window(dtype, window)
    for value, what in ((start, "start"), (stop, "stop")):
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidInput(f"{what} must be an int, got {value!r}")
    if not 0 <= start <= stop <= base.size:
        raise InvalidInput(f"element range [{start}, {stop}) is not within the tensor's {base.size} elements")
    if classes.dtype != np.uint8 or classes.ndim != 1 or not classes.flags.c_contiguous:
        raise InvalidInput(f"classes must be a contiguous 1-d uint8 array, got {classes.ndim}-d {classes.dtype}")
    if ranks.dtype != _INT64 or ranks.ndim != 1 or not ranks.flags.c_contiguous:
        raise InvalidInput(f"ranks must be a contiguous 1-d int64 array, got {ranks.ndim}-d {ranks.dtype}")
    if classes.size != ranks.size:
        raise InvalidInput(f"{classes.size} classes but {ranks.size} ranks")
    shift, width = EXPONENT_FIELDS.get(dtype, (0, 0))
    return ClassField(shift, (1 << width) - 1, window.lo, window.classes)


def check_apply_ranks(
    bits: Any, dtype: str, window: Any, start: int, stop: int, classes: Any, ranks: Any, delta: Any
) -> ClassField:
    """Arguments of ``apply_ranks``: those of ``select_ranks`` on writable ``bits``, and
    one delta of the bits' dtype per query."""
    field = check_select_ranks(bits, dtype, window, start, stop, classes, ranks)
    check_bits(bits, "bits", writable=True)
    if delta.dtype != bits.dtype or delta.ndim != 1 or not delta.flags.c_contiguous:
        raise InvalidInput(f"delta must be a contiguous 1-d {bits.dtype} array, got {delta.ndim}-d {delta.dtype}")
    if delta.size != ranks.size:
        raise InvalidInput(f"{ranks.size} ranks but {delta.size} deltas")
    return field


def check_select_order(xp: Any, classes: Any, ranks: Any, n_classes: int) -> None:
    """The queries of ``select_ranks`` are as an entropy decoder yields them: classes
    below ``n_classes`` and non-decreasing, ranks non-negative and strictly increasing
    within a class. ``FormatError`` otherwise (they come from a shard's streams)."""
    if classes.size == 0:
        return
    c0, c1, r0, r1 = classes[:-1], classes[1:], ranks[:-1], ranks[1:]
    if bool(xp.any(classes >= n_classes)) or bool(xp.any(ranks < 0)):
        raise FormatError(f"a decoded class is not below {n_classes} or a rank is negative")
    if bool(xp.any((c1 < c0) | ((c1 == c0) & (r1 <= r0)))):
        raise FormatError("decoded (class, rank) pairs are not in class-major, rank-increasing order")
