"""NumPy twins of the CUDA kernels: the same functions, signatures and bits, on the CPU.

Every function of :mod:`bulletin_kernels.cuda` has a twin here with the same name and signature
(tests/kernels/test_backends.py checks it), built on the pure codecs of ``patcher``.
Both backends check their arguments the same way (kernels/bulletin_kernels/_checks.py) and raise from
``patcher.errors`` before anything is written. Work is chunked: temporaries are
O(chunk + changed elements), never the size of the tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from bulletin_kernels._checks import (
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
from patcher.apply import apply as _apply_patch
from patcher.cast import cast_bits
from patcher.diff import diff_bits
from patcher.dtypes import bits_dtype
from patcher.errors import InvalidInput
from patcher.fingerprint import fingerprint as _fingerprint
from patcher.fingerprint_update import fingerprint_change
from patcher.patch import Change, Patch

__all__ = [
    "CHUNK_ELEMENTS",
    "apply",
    "apply_delta",
    "apply_ranks",
    "cast",
    "decode_gaps",
    "diff_cast",
    "fingerprint",
    "select_ranks",
]

#: Elements per step of diff_cast and apply_delta.
CHUNK_ELEMENTS: Final = 1 << 20

_MASK64: Final = (1 << 64) - 1


def _numpy(array: object, what: str) -> NDArray[Any]:
    if not isinstance(array, np.ndarray):
        raise InvalidInput(f"{what}: the NumPy backend needs a numpy.ndarray, got {type(array).__name__}")
    return array


def cast(current: BitsArray, current_dtype: str, served_dtype: str) -> BitsArray:
    """A new array holding ``current``'s bits cast exactly to ``served_dtype`` (patcher.cast)."""
    src = _numpy(current, "current")
    check_bits(src, "current", dtype=current_dtype)
    return cast_bits(src, current_dtype, served_dtype)


def diff_cast(
    current: BitsArray, kept: BitsArray, *, current_dtype: str, served_dtype: str
) -> Change[IndexArray, BitsArray]:
    """Cast ``current`` to the served dtype, diff it against ``kept``, and update ``kept``.

    ``current`` holds the bits of the trainer's weights (``current_dtype``: ``F32``
    masters, or already the served dtype); ``kept`` the bits last published, in
    ``served_dtype``, same shape, C-contiguous, writable. Returns the
    :class:`~patcher.patch.Change`: the changed flat indices (ascending) and their deltas
    ``(new - old) mod 2**bits``, exactly ``patcher.diff.diff_bits(kept, cast(current))``,
    and the fingerprint change; afterwards ``kept`` holds the new bits.
    """
    cur, old = _numpy(current, "current"), _numpy(kept, "kept")
    kind = check_diff_cast(cur, old, current_dtype, served_dtype)
    check_disjoint((cur.ctypes.data, cur.nbytes), (old.ctypes.data, old.nbytes), "current and kept")
    cur_flat, kept_flat = cur.reshape(-1), old.reshape(-1)
    served = bits_dtype(served_dtype)
    # The cast of one chunk at a time, into one reused buffer; an identity diff reads
    # `current` directly.
    buffer = None if kind == "identity" else np.empty(min(cur_flat.size, CHUNK_ELEMENTS), dtype=served)
    index_parts: list[NDArray[np.int64]] = []
    delta_parts: list[NDArray[np.unsignedinteger]] = []
    fp = 0
    for start in range(0, cur_flat.size, CHUNK_ELEMENTS):
        src = cur_flat[start : start + CHUNK_ELEMENTS]
        dst = kept_flat[start : start + CHUNK_ELEMENTS]
        new = src if buffer is None else cast_bits(src, current_dtype, served_dtype, out=buffer[: src.size])
        idx, delta = diff_bits(dst, new)
        if idx.size == 0:
            continue
        now = new[idx]
        global_idx = idx + start
        fp += fingerprint_change(global_idx, dst[idx], now)
        dst[idx] = now
        index_parts.append(global_idx)
        delta_parts.append(delta)
    if not index_parts:
        return Change(np.empty(0, dtype=np.int64), np.empty(0, dtype=served), 0)
    return Change(np.concatenate(index_parts), np.concatenate(delta_parts), fp & _MASK64)


def decode_gaps(gaps: IntArray, start: int = 0) -> IndexArray:
    """Indices of a codec entry from its decoded index gaps (int64).

    The convention is the codec's (docs/FORMAT.md, ``patcher.streams``): for an entry
    covering elements ``[start, stop)``, ``gaps[0] = indices[0] - start + 1`` and
    ``gaps[k] = indices[k] - indices[k-1]``, so ``indices = start - 1 + cumsum(gaps)``.
    The gaps come from the codec's entropy decoder, which checked them (all >= 1, sum
    within the entry); ``apply_delta`` checks the resulting indices again.
    """
    g = _numpy(gaps, "gaps")
    check_gaps(g, start)
    indices = np.cumsum(g, dtype=np.int64)
    indices += start - 1
    return indices


def apply_delta(bits: BitsArray, indices: IndexArray, delta: BitsArray) -> int:
    """Add ``delta`` (wrapping) to ``bits`` at flat ``indices``, in place; return the
    fingerprint change (mod 2**64).

    ``bits`` is the tensor's writable C-contiguous bits array (any shape); ``indices``
    strictly increasing int64 in ``[0, bits.size)``; ``delta`` of ``bits``' dtype. All of
    it is checked before the first write (``InvalidInput``), so bad input changes nothing.
    """
    b = _numpy(bits, "bits")
    idx = _numpy(indices, "indices")
    d = _numpy(delta, "delta")
    check_apply(b, idx, d)
    if idx.size:
        if idx[0] < 0 or idx[-1] >= b.size:
            raise InvalidInput(f"index out of range [0, {b.size})")
        for start in range(1, idx.size, CHUNK_ELEMENTS):
            # Overlapping by one element checks every adjacent pair across chunk edges.
            window = idx[start - 1 : start + CHUNK_ELEMENTS]
            if not bool(np.all(window[1:] > window[:-1])):
                raise InvalidInput("indices must be strictly increasing")
    flat = b.reshape(-1)
    fp = 0
    for start in range(0, idx.size, CHUNK_ELEMENTS):
        i = idx[start : start + CHUNK_ELEMENTS]
        old = flat[i]
        new = old + d[start : start + CHUNK_ELEMENTS]  # unsigned arrays wrap, as intended
        fp += fingerprint_change(i, old, new)
        flat[i] = new
    return fp & _MASK64


def fingerprint(bits: BitsArray) -> int:
    """Full fingerprint of a bits array (patcher.fingerprint), an int in [0, 2**64)."""
    b = _numpy(bits, "bits")
    check_bits(b, "bits")
    return _fingerprint(b)


def select_ranks(
    base: BitsArray,
    dtype: str,
    window: ClassWindowLike,
    start: int,
    stop: int,
    classes: ClassArray,
    ranks: IndexArray,
) -> IndexArray:
    """The flat index of each (class, rank) query: ``patcher.context.select_ranks``.

    ``base`` holds the tensor's bits (any shape, read flat); ``window`` its exponent
    classes; each query asks for the ``rank``-th (0-based) element of class ``class``
    in ``[start, stop)``. Queries come as the context codec's entropy decoder yields
    them (uint8 classes non-decreasing, int64 ranks strictly increasing within a class)
    and the indices are returned in the same order (int64). ``FormatError`` for queries
    out of that order or past the count of their class; ``InvalidInput`` for bad
    arguments.
    """
    from patcher.context import ClassWindow
    from patcher.context import select_ranks as _select_ranks

    b, c, r = _numpy(base, "base"), _numpy(classes, "classes"), _numpy(ranks, "ranks")
    check_select_ranks(b, dtype, window, start, stop, c, r)
    check_select_order(np, c, r, window.classes)
    own = ClassWindow(window.lo, window.classes)
    indices: NDArray[np.int64] = _select_ranks(b.reshape(-1), dtype, own, start, stop, c, r)
    return indices


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
    """Add ``delta`` (wrapping) at the elements :func:`select_ranks` finds for the queries,
    in place; return the fingerprint change (mod 2**64). What a GPU decode of the
    context codec does with the decoded (class, rank, delta) of an entry in one pass.

    ``bits`` (writable) is the base the ranks count in; ``delta`` one value of its dtype
    per query, in the queries' order. Every check, and every index, is done before the
    first write, so bad input changes nothing.
    """
    b, c = _numpy(bits, "bits"), _numpy(classes, "classes")
    r, d = _numpy(ranks, "ranks"), _numpy(delta, "delta")
    check_apply_ranks(b, dtype, window, start, stop, c, r, d)
    indices = select_ranks(b, dtype, window, start, stop, c, r)
    flat = b.reshape(-1)
    old = flat[indices]
    new = old + d  # unsigned arrays wrap, as intended
    fp = fingerprint_change(indices, old, new)
    flat[indices] = new
    return fp & _MASK64


def apply(patch: Patch, tensors: Mapping[str, BitsArray], fingerprints: Mapping[str, int]) -> dict[str, int]:
    """Apply a whole patch in place to NumPy bits arrays (``patcher.apply.apply``).

    ``tensors`` maps every tensor of the patch, and nothing else, to its bits array;
    ``fingerprints`` holds their current fingerprints. Layout and base fingerprints are
    checked first, as on the GPU; then the codec applies, verifies every target and
    restores everything if one fails. Returns the new fingerprints.
    """
    arrays = {name: _numpy(array, name) for name, array in tensors.items()}
    check_patch_targets(patch, arrays, fingerprints)
    return _apply_patch(patch, arrays, fingerprints)
