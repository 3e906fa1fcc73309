"""The interpreter's cyclic garbage collector, held off while a patch step runs.

A step makes a few objects per tensor that live until it ends (changes, entries,
descriptions). Each generation-1 collection that meets them promotes them, and once the
promoted objects reach a quarter of the old generation the interpreter runs a full
collection: with torch loaded, about 0.1 s, on whichever rank and phase it falls. In a
sharded job every other rank then waits for it at the next collective, so the more ranks,
the more steps one of them stalls. Held off, the step's temporaries are freed by their
reference counts before any collection sees them; objects that outlive the step are
collected as usual afterwards. Reference counting frees everything else meanwhile, so
memory does not grow: only garbage cycles (of every thread: the trainer's too) wait for
the end of the step, which is why a keyframe step, minutes long for a large model, runs
with the collector as it is.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused"]


class _Pause:
    """How many blocks hold the collector off, and whether it ran before the first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders = 0
        self.was_enabled = False


_pause = _Pause()


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic cyclic collection inside the block (any number of threads, nested);
    the collector is enabled again when the last one leaves, if it was enabled before."""
    with _pause.lock:
        if _pause.holders == 0:
            _pause.was_enabled = gc.isenabled()
            gc.disable()
        _pause.holders += 1
    try:
        yield
    finally:
        with _pause.lock:
            _pause.holders -= 1
            if _pause.holders == 0 and _pause.was_enabled:
                gc.enable()
