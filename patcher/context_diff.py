"""The diff that ranks its changes as it finds them, for the context codec (docs/FORMAT.md 3.15).

The context encoder codes each change by its class and rank (patcher.context), which
it gets from a scan of the whole base: after the diff's own scan of the base and the
new bits, a second O(model) read. :func:`diff_ranked` does both in one scan. The
window the ranks need is guessed before the scan from a sparse sample of both versions
(the changes are not known yet), then checked against the best window for that sample
and the changes (as :func:`patcher.context.choose_window` picks it, known once the
changes are): the guess is kept when it codes the positions within 1/512 of that
window's estimated bits, else the ranks are computed again with the best window. Either way the window is valid
(any window decodes) and the shards decode to the same bits.

NumPy defines the results (diff, then choose_window and class_ranks); the compiled
scan (patcher.native) computes them bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from patcher import native
from patcher.context import (
    EXPONENT_FIELDS,
    MAX_CLASSES,
    WINDOW_RUN,
    WINDOW_STRIDE,
    ClassWindow,
    class_ranks,
    exponent_width,
    exponents,
    sampled_histograms,
    window_bits,
    window_of,
)
from patcher.diff import checked_pairs, native_scan, tensor_changes
from patcher.patch import Patch, TensorDelta, TensorSpec

__all__ = ["GUESS_SLACK", "SAMPLE_RUNS", "SAMPLE_STRIDE", "SMALLEST", "RankedDelta", "diff_ranked", "ranked_delta"]

_MASK64: Final = (1 << 64) - 1
#: The sample both the guess and the final choice of a tensor's window read
#: (:func:`_sample_runs`): as dense as choose_window's, in longer runs, since each run
#: costs a cache and TLB miss and the choice needs proportions only.
SAMPLE_STRIDE: Final = 1 << 18
SAMPLE_RUNS: Final = 64
#: A guessed window is kept when its estimated position bits exceed those of the best
#: window by at most this share (1/512: a twentieth of a per cent of a patch's bytes at
#: most); guesses from the sample miss only by near ties, so few tensors are scanned twice.
GUESS_SLACK: Final = 512
#: Tensors of fewer elements are diffed plainly (the encoder ranks them): below about
#: this size the sample and the window choice cost more than the second scan saves.
SMALLEST: Final = 1 << 18
_U8: Final = np.dtype(np.uint8)
_I64: Final = np.dtype(np.int64)


@dataclass(frozen=True, slots=True, eq=False)
class RankedDelta(TensorDelta):
    """A tensor's delta with what the context encoder codes for it as one entry
    ``[0, numel)``: the window ``choose_window`` picks for it, and each change's class
    and rank (``class_ranks`` from 0), in index order."""

    window: ClassWindow
    classes: NDArray[np.uint8]
    ranks: NDArray[np.int64]


def diff_ranked(
    specs: Mapping[str, TensorSpec],
    old: Mapping[str, NDArray[Any]],
    new: Mapping[str, NDArray[Any]],
    *,
    base_fingerprints: Mapping[str, int] | None = None,
) -> Patch:
    """:func:`patcher.diff.diff` (same arguments, checks and patch), each changed tensor
    of a dtype with an exponent and of at least SMALLEST elements given as a
    :class:`RankedDelta`."""
    return Patch(
        {
            name: ranked_delta(specs[name], a, b, base)
            for name, a, b, base in checked_pairs(specs, old, new, base_fingerprints)
        }
    )


def ranked_delta(
    spec: TensorSpec, old: NDArray[np.unsignedinteger], new: NDArray[np.unsignedinteger], base_fingerprint: int
) -> TensorDelta:
    """The delta ``old`` -> ``new`` of ``spec``'s (already checked, C-contiguous) bits,
    ranked where the dtype has an exponent and something changed."""
    a, b, dtype = old.reshape(-1), new.reshape(-1), spec.dtype
    width = exponent_width(dtype)
    # One class (the encoder's ranks are the indices themselves), or a tensor so small
    # that the encoder's own scans cost less than sampling and choosing here.
    if width == 0 or a.size < SMALLEST:
        (indices, _, delta), change = tensor_changes(a, b)
        return TensorDelta(spec, indices, delta, base_fingerprint, (base_fingerprint + change) & _MASK64)
    stride, run = _sample_runs(int(a.size))
    scale = stride // run
    sampled, sampled_changed = _sample(a, b, dtype, stride, run)
    guess = _guess(sampled, sampled_changed, scale)
    indices, delta, change, changed, ranked = _scan(a, b, dtype, guess)
    target = (base_fingerprint + change) & _MASK64
    if indices.size == 0:
        return TensorDelta(spec, indices, delta, base_fingerprint, target)
    window = _settle(sampled, changed, guess, scale)
    if ranked is None or window != guess:
        ranked = class_ranks(a, dtype, window, 0, indices)
    return RankedDelta(spec, indices, delta, base_fingerprint, target, window, *ranked)


_Ranked = tuple[NDArray[np.uint8], NDArray[np.int64]]


def _sample(
    a: NDArray[np.unsignedinteger], b: NDArray[np.unsignedinteger], dtype: str, stride: int, run: int
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """``sampled_histograms(a, dtype, 0, a.size, b, stride, run)``, compiled where it can be."""
    if not native.active():
        return sampled_histograms(a, dtype, 0, a.size, b, stride, run)
    shift, width = EXPONENT_FIELDS[dtype]
    sampled, changed = np.zeros(1 << width, dtype=np.int64), np.zeros(1 << width, dtype=np.int64)
    native.speedups.ctx_sample(a, b, a.dtype.itemsize, shift, width, 0, a.size, stride, run, sampled, changed)
    return sampled, changed


def _scan(
    a: NDArray[np.unsignedinteger], b: NDArray[np.unsignedinteger], dtype: str, window: ClassWindow
) -> tuple[NDArray[np.int64], NDArray[np.unsignedinteger], int, NDArray[np.int64], _Ranked | None]:
    """The changes' indices, deltas and fingerprint change, the exponent histogram of
    their old bits, and (compiled: in the same scan) their classes and ranks in
    ``window``."""
    shift, width = EXPONENT_FIELDS[dtype]
    if not native.active():
        (indices, was, delta), change = tensor_changes(a, b)
        return indices, delta, change, np.bincount(exponents(was, dtype), minlength=1 << width), None
    totals, changed = np.zeros(MAX_CLASSES, dtype=np.uint64), np.zeros(1 << width, dtype=np.int64)
    (indices, delta, classes, ranks), change = native_scan(
        int(a.size),
        (_I64, a.dtype, a.dtype, _U8, _I64),
        lambda pos, out: native.speedups.ctx_diff(
            a, b, a.dtype.itemsize, shift, width, window.lo, window.classes, pos, totals, changed, *out
        ),
        keep=(0, 2, 3, 4),
    )
    return indices, delta, change, changed, (classes, ranks)


def _sample_runs(numel: int) -> tuple[int, int]:
    """The sample's (stride, run): one element in WINDOW_STRIDE / WINDOW_RUN, as in
    choose_window's, in a run every SAMPLE_STRIDE elements at most, but at least
    SAMPLE_RUNS runs where the tensor has room for them at choose_window's stride."""
    stride = max(WINDOW_STRIDE, min(SAMPLE_STRIDE, numel // SAMPLE_RUNS // WINDOW_STRIDE * WINDOW_STRIDE))
    return stride, stride // (WINDOW_STRIDE // WINDOW_RUN)


def _guess(sampled: NDArray[np.int64], sampled_changed: NDArray[np.int64], scale: int) -> ClassWindow:
    """The window the changes will most likely call for, from the sample's histograms
    (any window ranks correctly; a guess :func:`_settle` rejects costs a second scan)."""
    if not sampled_changed.any():
        # No change seen in the sample: only the members' span can be guessed.
        present = np.flatnonzero(sampled)
        if present.size == 0:
            return ClassWindow(0, 1)
        sampled_changed = np.zeros_like(sampled)
        sampled_changed[present[0]] = 1
    return window_of(sampled, sampled_changed * scale, scale)


def _settle(sampled: NDArray[np.int64], changed: NDArray[np.int64], guess: ClassWindow, scale: int) -> ClassWindow:
    """The window to code with: the best for the sample and the changes (as
    ``choose_window`` picks), or the guess where its position bits are within
    ``1 / GUESS_SLACK`` of that one's."""
    best = window_of(sampled, changed, scale)
    if guess == best:
        return guess
    limit = window_bits(sampled, changed, best, scale)
    return guess if window_bits(sampled, changed, guess, scale) <= limit + limit / GUESS_SLACK else best
