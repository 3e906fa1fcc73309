"""Applying context-coded entries in place, resolving and scattering in one pass (CPU).

The entropy stage (patcher.context_decode) gives an entry's changes as (class, rank,
delta), class-major. The compiled loop (patcher.native ``ctx_apply``) then walks the
entry's range of the target once: it reads each element's class from the bits held
(the base, before it changes), counts it against its class's next rank, and where a
rank is reached adds the delta, updating the fingerprint. It records what it changed,
so that a failed apply (a rank never reached, a missed target fingerprint) can be
undone exactly. Entries without classes to resolve (one class: the rank is the offset)
go through the plain checked scatter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from patcher import native
from patcher.context import EXPONENT_FIELDS, select_ranks
from patcher.context_decode import CodedChanges, needs_base
from patcher.errors import FormatError

__all__ = ["ContextTask", "apply_changes", "refuse", "undo_changes"]


@dataclass(slots=True)
class ContextTask:
    """One entry's changes and, once applied, what was changed (for an undo)."""

    changes: CodedChanges
    dtype: str
    #: Indices written and the class-major position of each one's delta.
    written: NDArray[np.int64] = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    positions: NDArray[np.int64] = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    #: The bits overwritten (entries scattered without classes keep them).
    old: NDArray[np.unsignedinteger] | None = None


def apply_changes(task: ContextTask, target: NDArray[np.unsignedinteger]) -> tuple[int, int, bool]:
    """Apply one entry to the flat ``target``: (changes applied, fingerprint change, all
    ranks reached). Compiled path only."""
    ch = task.changes
    e = ch.entry
    width = target.dtype.itemsize
    if not needs_base(e):
        indices = ch.ranks + e.start
        old = np.empty(e.count, dtype=target.dtype)
        after = e.start - 1
        done, fp = native.speedups.scatter_add(target, width, indices, ch.delta, old, after)
        task.written, task.positions, task.old = indices[:done], np.arange(done, dtype=np.int64), old[:done]
        return done, fp, done == e.count
    shift, ebits = EXPONENT_FIELDS[task.dtype]
    written = np.empty(e.count, dtype=np.int64)
    positions = np.empty(e.count, dtype=np.int64)
    done, fp, ok = native.speedups.ctx_apply(
        target, width, shift, ebits, e.lo, e.classes, e.start, e.stop,
        ch.classes, ch.ranks, ch.delta, written, positions,
    )  # fmt: skip
    task.written, task.positions = written[:done], positions[:done]
    return done, fp, ok


def undo_changes(task: ContextTask, target: NDArray[np.unsignedinteger]) -> None:
    """Put back what :func:`apply_changes` wrote."""
    if task.written.size == 0:
        return
    if task.old is not None:
        target[task.written] = task.old
    else:
        target[task.written] -= task.changes.delta[task.positions]


def refuse(task: ContextTask, target: NDArray[np.unsignedinteger]) -> FormatError:
    """The NumPy resolve's own error for an entry whose ranks the compiled loop did not
    all reach (run on the restored target)."""
    ch = task.changes
    e = ch.entry
    with native.disabled():
        select_ranks(target, task.dtype, ch.window, e.start, e.stop, ch.classes, ch.ranks)
    return FormatError(f"{ch.what}: ranks not reached")  # pragma: no cover - both resolves agree
