"""What the context codec knows about an element before it decodes it: its base's class.

The context codec (docs/FORMAT.md 3.15, codec id 3) codes a patch against the base
tensor that every receiver holds. The only context it takes from the base is each
element's **class**: its floating-point exponent field (a small ``|w|`` has a small ULP,
which Adam's step crosses far more often), clipped into a window of at most 16 values
that each entry of a shard names::

    class(b) = clip(exponent(b) - lo, 0, classes - 1)

Positions are then coded per class as gaps between the *ranks* of the changed elements
among that class's elements of the entry's range, so a decoder needs the base twice:
to learn the class of nothing (the entropy decoder works without it), and to turn each
decoded (class, rank) back into an index (:func:`select_ranks`, the O(model) pass over
the base, done by a kernel on a GPU). Encoders compute ranks with :func:`class_ranks`.

This module defines those scans in NumPy; the compiled fast path (patcher.native) and
the CUDA kernels (kernels/) compute them bit for bit. All work in chunks, so no
temporary grows with the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import NDArray

from patcher import native
from patcher.errors import FormatError, InvalidInput
from patcher.patch import TensorSpec

__all__ = [
    "CHUNK",
    "EXPONENT_FIELDS",
    "MAX_CLASSES",
    "ClassWindow",
    "ContextStream",
    "Overlay",
    "choose_window",
    "class_ranks",
    "coder_trace",
    "context_symbols",
    "element_classes",
    "exponent_width",
    "exponents",
    "sampled_histograms",
    "select_ranks",
    "window_bits",
    "window_of",
]

#: dtype -> (shift, width) of its exponent field in the bits. Dtypes not listed (integers,
#: BOOL) have no exponent: all their elements are of class 0.
EXPONENT_FIELDS: Final[dict[str, tuple[int, int]]] = {
    "BF16": (7, 8),
    "F16": (10, 5),
    "F32": (23, 8),
    "F64": (52, 11),
    "F8_E4M3": (3, 4),
    "F8_E5M2": (2, 5),
}
#: Most classes one entry may have (the compiled scan keeps one byte lane per class).
MAX_CLASSES: Final = 16
#: Elements handled per step of a scan: temporaries of a few MiB.
CHUNK: Final = 1 << 20
#: The encoder's window choice looks at the first WINDOW_RUN elements of every
#: WINDOW_STRIDE of the range (one in 64, in runs that fill cache lines: a strided sample
#: would read all of memory anyway). CHUNK is a multiple of the stride.
WINDOW_RUN: Final = 64
WINDOW_STRIDE: Final = 4096
#: Windows whose estimated bits lie this close to the least (relatively, and in bits) are
#: taken as equal and the lowest of them is chosen: rounding, which differs between the
#: compiled and NumPy paths, never decides between equivalent windows.
WINDOW_TIE: Final = 1e-9

_I64 = np.int64
_NO_INDEX: Final = np.empty(0, dtype=np.int64)


#: Changes to read the base with, not yet applied to it: sorted flat indices and the
#: bits they hold instead (an earlier patch decoded but not applied).
Overlay = tuple[NDArray[np.int64], NDArray[np.unsignedinteger]]


def _chunk(flat: NDArray[np.unsignedinteger], lo: int, hi: int, overlay: Overlay | None) -> NDArray[np.unsignedinteger]:
    """The base's elements ``lo:hi``, as the overlay makes them."""
    chunk = flat[lo:hi]
    if overlay is None:
        return chunk
    idx, values = overlay
    a, b = np.searchsorted(idx, [lo, hi])
    if a == b:
        return chunk
    chunk = chunk.copy()
    chunk[idx[a:b] - lo] = values[a:b]
    return chunk


@dataclass(frozen=True, slots=True)
class ClassWindow:
    """An entry's classes: exponents ``lo .. lo + classes - 1``, the rest clipped to the ends."""

    lo: int
    classes: int


def exponent_width(dtype: str) -> int:
    """Bits of ``dtype``'s exponent field, 0 for a dtype without one."""
    field = EXPONENT_FIELDS.get(dtype)
    return field[1] if field else 0


def check_window(dtype: str, window: ClassWindow) -> None:
    """``InvalidInput`` unless ``window`` is one that ``dtype`` admits (FORMAT.md 3.15)."""
    width = exponent_width(dtype)
    lo, classes = window.lo, window.classes
    if not (isinstance(lo, int) and isinstance(classes, int)) or isinstance(lo, bool) or isinstance(classes, bool):
        raise InvalidInput(f"class window must hold two ints, got {window!r}")
    if width == 0:
        if (lo, classes) != (0, 1):
            raise InvalidInput(f"{dtype} has no exponent: its class window must be lo 0, 1 class")
        return
    if not 1 <= classes <= MAX_CLASSES or not lo >= 0 or lo + classes > 1 << width:
        raise InvalidInput(f"class window lo={lo}, classes={classes} is not within {dtype}'s exponents")


def exponents(bits: NDArray[np.unsignedinteger], dtype: str) -> NDArray[np.int64]:
    """The exponent field of every element of ``bits`` (flat, C order); zeros without one."""
    flat = bits.reshape(-1)
    field = EXPONENT_FIELDS.get(dtype)
    if field is None:
        return np.zeros(flat.size, dtype=_I64)
    shift, width = field
    t = flat.dtype.type
    out: NDArray[np.int64] = ((flat >> t(shift)) & t((1 << width) - 1)).astype(_I64)
    return out


def element_classes(bits: NDArray[np.unsignedinteger], dtype: str, window: ClassWindow) -> NDArray[np.uint8]:
    """``clip(exponent - lo, 0, classes - 1)`` of every element (flat, C order)."""
    if window.classes == 1:
        return np.zeros(bits.size, dtype=np.uint8)
    e = exponents(bits, dtype)
    e -= window.lo
    np.clip(e, 0, window.classes - 1, out=e)
    return e.astype(np.uint8)


def _grouped(cls: NDArray[np.uint8], classes: int) -> tuple[NDArray[np.intp], NDArray[np.int64]]:
    """Positions of a chunk's elements grouped by class (each group in index order), and
    where each class's group starts in that order (``classes + 1`` offsets)."""
    order = np.argsort(cls, kind="stable")  # a counting sort for uint8 keys
    counts = np.bincount(cls, minlength=classes).astype(_I64)
    first = np.zeros(classes + 1, dtype=_I64)
    np.cumsum(counts, out=first[1:])
    return order, first


def class_ranks(
    base: NDArray[np.unsignedinteger],
    dtype: str,
    window: ClassWindow,
    start: int,
    indices: NDArray[np.int64],
    *,
    overlay: Overlay | None = None,
) -> tuple[NDArray[np.uint8], NDArray[np.int64]]:
    """Each changed index's class and rank: how many elements of its class lie in
    ``[start, index)``. ``indices`` are flat, strictly increasing and ``>= start``."""
    n = int(indices.size)
    classes_out = np.empty(n, dtype=np.uint8)
    ranks = np.empty(n, dtype=_I64)
    if n == 0:
        return classes_out, ranks
    if window.classes == 1:
        classes_out[:] = 0
        np.subtract(indices, start, out=ranks)
        return classes_out, ranks
    flat = base.reshape(-1)
    if native.active() and overlay is None and flat.flags.c_contiguous:
        shift, width = EXPONENT_FIELDS[dtype]
        native.speedups.ctx_ranks(
            flat, flat.dtype.itemsize, shift, width, window.lo, window.classes, start, indices, classes_out, ranks
        )
        return classes_out, ranks
    before = np.zeros(window.classes, dtype=_I64)  # members of each class before the chunk
    end = int(indices[-1]) + 1
    pos = 0
    for lo in range(start, end, CHUNK):
        hi = min(lo + CHUNK, end)
        cls = element_classes(_chunk(flat, lo, hi, overlay), dtype, window)
        upto = int(np.searchsorted(indices, hi))
        if upto > pos:
            local = indices[pos:upto] - lo
            order, first = _grouped(cls, window.classes)
            where = np.empty(hi - lo, dtype=_I64)  # position of each element in `order`
            where[order] = np.arange(hi - lo, dtype=_I64)
            c = cls[local]
            classes_out[pos:upto] = c
            ranks[pos:upto] = before[c] + where[local] - first[c]
            before += first[1:] - first[:-1]
        else:
            before += np.bincount(cls, minlength=window.classes)
        pos = upto
    return classes_out, ranks


def select_ranks(
    base: NDArray[np.unsignedinteger],
    dtype: str,
    window: ClassWindow,
    start: int,
    stop: int,
    classes: NDArray[np.uint8],
    ranks: NDArray[np.int64],
    *,
    overlay: Overlay | None = None,
) -> NDArray[np.int64]:
    """The inverse of :func:`class_ranks`: for each (class, rank) pair, the index in
    ``[start, stop)`` of the rank-th (0-based) element of that class counted from
    ``start``. Pairs come in class-major order (classes non-decreasing, ranks strictly
    increasing within a class), as the entropy decoder gives them; the indices are
    returned in the same order. ``FormatError`` if a rank is not below its class's
    count of elements in the range. ``overlay`` reads the base as if its changes were
    applied (``class_ranks`` takes it too)."""
    n = int(ranks.size)
    out = np.empty(n, dtype=_I64)
    if n == 0:
        return out
    span = stop - start
    if window.classes == 1:
        if int(ranks[-1]) >= span:
            raise FormatError(f"rank {int(ranks[-1])} past the {span} elements of the range")
        np.add(ranks, start, out=out)
        return out
    flat = base.reshape(-1)
    if native.active() and flat.flags.c_contiguous:
        shift, width = EXPONENT_FIELDS[dtype]
        idx, values = overlay if overlay is not None else (_NO_INDEX, flat[:0])
        done = native.speedups.ctx_select(
            flat, flat.dtype.itemsize, shift, width, window.lo, window.classes, start, stop,
            classes, ranks, idx, values, out,
        )  # fmt: skip
        if done:
            return out
        with native.disabled():  # says which rank, in its words
            select_ranks(base, dtype, window, start, stop, classes, ranks, overlay=overlay)
    # Where each class's pairs are: classes are non-decreasing.
    bounds = np.searchsorted(classes, np.arange(window.classes + 1), side="left")
    cursor = bounds[:-1].astype(_I64)  # next pair of each class to resolve
    before = np.zeros(window.classes, dtype=_I64)
    for lo in range(start, stop, CHUNK):
        if bool(np.all(cursor == bounds[1:])):
            break
        hi = min(lo + CHUNK, stop)
        cls = element_classes(_chunk(flat, lo, hi, overlay), dtype, window)
        order, first = _grouped(cls, window.classes)
        counts = first[1:] - first[:-1]
        for c in range(window.classes):
            a, b = int(cursor[c]), int(bounds[c + 1])
            if a == b:
                continue
            # This chunk holds the class's ranks before[c] .. before[c] + counts[c] - 1.
            upto = a + int(np.searchsorted(ranks[a:b], before[c] + counts[c]))
            if upto > a:
                within = ranks[a:upto] - before[c] + first[c]
                out[a:upto] = order[within] + lo
                cursor[c] = upto
        before += counts
    if not bool(np.all(cursor == bounds[1:])):
        c = int(np.flatnonzero(cursor != bounds[1:])[0])
        raise FormatError(
            f"class {c} has {int(before[c])} elements in [{start}, {stop}), a change claims rank "
            f"{int(ranks[int(cursor[c])])}"
        )
    return out


def choose_window(
    base: NDArray[np.unsignedinteger], dtype: str, start: int, stop: int, indices: NDArray[np.int64]
) -> ClassWindow:
    """The window an encoder uses for the entry ``[start, stop)`` holding ``indices``
    (not normative: any valid window decodes). Of the windows of at most 16 classes,
    the one whose classes give the changed/unchanged pattern the least empirical
    entropy (``sum n * h(k / n)`` over classes), from exponent histograms of the range
    (a sample, :func:`sampled_histograms`) and of the changes."""
    width = exponent_width(dtype)
    if width == 0 or indices.size == 0:
        return ClassWindow(0, 1)
    flat = base.reshape(-1)
    members = np.zeros(1 << width, dtype=_I64)
    changed = np.zeros(1 << width, dtype=_I64)
    if native.active() and flat.flags.c_contiguous:
        shift, _ = EXPONENT_FIELDS[dtype]
        native.speedups.ctx_histogram(
            flat, flat.dtype.itemsize, shift, width, start, stop, WINDOW_STRIDE, WINDOW_RUN, members, indices, changed
        )
    else:
        members += sampled_histograms(flat, dtype, start, stop)[0]
        changed += np.bincount(exponents(flat[indices], dtype), minlength=1 << width)
    return window_of(members, changed)


def sampled_histograms(
    flat: NDArray[np.unsignedinteger],
    dtype: str,
    start: int,
    stop: int,
    new: NDArray[np.unsignedinteger] | None = None,
    stride: int = WINDOW_STRIDE,
    run: int = WINDOW_RUN,
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """The exponent histogram of ``flat[start:stop]``'s sample (the first ``run``
    elements of every ``stride``: ``choose_window``'s at the defaults), and that of the
    sampled elements whose bits differ in ``new`` (zeros without it); NumPy."""
    members = np.zeros(1 << exponent_width(dtype), dtype=_I64)
    changed = np.zeros_like(members)
    starts = range(start, stop, stride)
    per = max(1, CHUNK // run)  # runs gathered at a time: temporaries of CHUNK elements
    for first in range(0, len(starts), per):
        runs = starts[first : first + per]
        sample = np.concatenate([flat[k : min(k + run, stop)] for k in runs])
        e = exponents(sample, dtype)
        members += np.bincount(e, minlength=members.size)
        if new is not None:
            now = np.concatenate([new[k : min(k + run, stop)] for k in runs])
            changed += np.bincount(e[sample != now], minlength=members.size)
    return members, changed


def window_bits(
    sampled: NDArray[np.int64],
    changed: NDArray[np.int64],
    window: ClassWindow,
    scale: int = WINDOW_STRIDE // WINDOW_RUN,
) -> float:
    """What :func:`window_of` minimises, for one ``window``."""
    members = np.maximum(sampled * scale, changed)
    cls = np.clip(np.arange(members.size) - window.lo, 0, window.classes - 1)
    n = np.bincount(cls, weights=members, minlength=window.classes)
    k = np.bincount(cls, weights=changed, minlength=window.classes)
    return float(_bernoulli_bits(n.astype(np.float64), k.astype(np.float64)).sum())


def window_of(
    sampled: NDArray[np.int64], changed: NDArray[np.int64], scale: int = WINDOW_STRIDE // WINDOW_RUN
) -> ClassWindow:
    """``choose_window``'s pick from the range's sampled exponent histogram (one element
    sampled in ``scale``) and that of its changes (both of 2**exponent-width counts; the
    changes' are not all zero)."""
    # A sample estimates the range's histogram: the choice needs proportions, not
    # counts, and this keeps it off the encoder's O(model) budget.
    if native.active():
        return ClassWindow(
            *native.speedups.ctx_window(sampled.astype(_I64, copy=False), changed.astype(_I64, copy=False), scale)
        )
    members = np.maximum(sampled * scale, changed)
    present = np.flatnonzero(members)
    e_min, e_max = int(present[0]), int(present[-1])
    if e_max - e_min < MAX_CLASSES:
        return ClassWindow(e_min, e_max - e_min + 1)
    # Every window at once, lo = e_min + r for row r: its first and last classes take
    # every exponent below and above it, the classes between one exponent each, whose
    # bits are a difference of one running sum (a few array operations in all: the
    # choice runs once or twice per tensor, so its fixed cost counts on small ones).
    span = e_max - e_min + 1
    rows = span - MAX_CLASSES + 1
    # Columns: the span's exponents, then each row's first class, then its last.
    nk = np.zeros((2, span + 1), dtype=np.float64)
    nk[0, 1:], nk[1, 1:] = members[e_min : e_max + 1], changed[e_min : e_max + 1]
    cum = np.cumsum(nk, axis=1)  # exact: counts stay far below 2**53
    first, top = np.arange(1, rows + 1), np.arange(MAX_CLASSES - 1, MAX_CLASSES - 1 + rows)
    cols = np.concatenate([nk[:, 1:], cum[:, first], cum[:, -1:] - cum[:, top]], axis=1)
    h = _bernoulli_bits(cols[0], cols[1])
    each = np.concatenate([[0.0], np.cumsum(h[:span])])
    bits = h[span : span + rows] + (each[top] - each[first]) + h[span + rows :]
    best = float(bits.min())
    # Equivalent windows tie within rounding: the lowest of them wins, on every path.
    return ClassWindow(e_min + int(np.flatnonzero(bits <= best + best * WINDOW_TIE + WINDOW_TIE)[0]), MAX_CLASSES)


def _bernoulli_bits(n: NDArray[np.float64], k: NDArray[np.float64]) -> NDArray[np.float64]:
    """``n * h(k / n)`` in bits, per class (0 where a class has no elements, or none or
    all of them changed)."""
    keep = (k > 0) & (k < n)
    p = np.divide(k, n, out=np.full_like(k, 0.5), where=keep)  # 0.5 elsewhere: no log of 0
    bits: NDArray[np.float64] = -(k * np.log2(p) + (n - k) * np.log2(1 - p))
    bits[~keep] = 0.0
    return bits


# -- for measuring the model (scripts/bench_codec.py) -------------------------------------


@dataclass(frozen=True, slots=True)
class ContextStream:
    """Symbols in ``[0, alphabet)`` and the context each is coded in."""

    name: str
    symbols: NDArray[np.int64]
    contexts: NDArray[np.int64]
    alphabet: int


def _whole_window(spec: TensorSpec, base: NDArray[np.unsignedinteger], indices: NDArray[np.int64]) -> ClassWindow:
    return choose_window(base.reshape(-1), spec.dtype, 0, spec.numel, indices)


def context_symbols(
    spec: TensorSpec,
    base: NDArray[np.unsignedinteger],
    indices: NDArray[np.int64],
    delta: NDArray[np.unsignedinteger],
    window: ClassWindow | None = None,
) -> list[ContextStream]:
    """What the context codec models for one tensor coded as one entry, as two streams:
    ``position``, a changed flag (1) per element in the context of its class, and
    ``delta``, each change's delta bits (for widths over 2 bytes, its zig-zag value
    clipped to 65535) in the context of its class's nominal exponent ``lo + class``
    (0 for dtypes without an exponent). ``H(position | class) + H(delta | exponent)``
    is the bound of the model's contexts; the coder's own decisions are
    :func:`coder_trace`'s."""
    flat = base.reshape(-1)
    window = window or _whole_window(spec, flat, indices)
    classes = element_classes(flat, spec.dtype, window).astype(_I64)
    flags = np.zeros(flat.size, dtype=_I64)
    flags[indices] = 1
    nominal = (classes[indices] + window.lo) if exponent_width(spec.dtype) else np.zeros(indices.size, _I64)
    if delta.dtype.itemsize <= 2:
        symbols, alphabet = delta.astype(_I64), 1 << (8 * delta.dtype.itemsize)
    else:
        signed = delta.view(np.dtype(f"i{delta.dtype.itemsize}")).astype(np.float64)
        zigzag = np.where(signed < 0, -2 * signed - 1, 2 * signed)
        symbols, alphabet = np.minimum(zigzag, 65535).astype(_I64), 65536
    return [
        ContextStream("position", flags, classes, 2),
        ContextStream("delta", symbols, nominal.astype(_I64), alphabet),
    ]


def coder_trace(
    spec: TensorSpec,
    base: NDArray[np.unsignedinteger],
    indices: NDArray[np.int64],
    delta: NDArray[np.unsignedinteger],
    window: ClassWindow | None = None,
) -> list[ContextStream]:
    """The binary decisions the range coder codes for one tensor coded as one entry,
    each in its adaptive context's id (patcher.context_model; -1 for a direct bit),
    grouped by kind: ``more``, ``gap_length``, ``gap_bits``, ``delta``, ``direct``."""
    from patcher.context_model import trace_entry  # the model imports this module

    flat = base.reshape(-1)
    window = window or _whole_window(spec, flat, indices)
    classes, ranks = class_ranks(flat, spec.dtype, window, 0, indices)
    order = np.argsort(classes, kind="stable")
    return trace_entry(spec.dtype, window, classes[order], ranks[order], delta[order])
