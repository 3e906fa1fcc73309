"""The compiled fast path of the CPU codec (patcher/_speedups.c), where it was built.

The codec's hot loops (diff, fingerprints, the stream coders, apply's scatter) each have
a NumPy form, which defines the result, and a compiled twin, which tests hold to the
same bits. Callers in patcher ask :func:`active` and take ``speedups`` when it is true.
The extension is optional (setup.py): without a C compiler the package installs and
runs on NumPy alone, slower. ``BULLETIN_NATIVE=0`` turns the compiled path off for a
process; :func:`disabled` does so for a block (tests and benchmarks compare the two).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["BUILT", "active", "disabled", "speedups"]

try:
    from patcher import _speedups as speedups
except ImportError:  # pragma: no cover - installed without a C compiler
    BUILT = False
else:
    BUILT = True


class _Switch:
    enabled = os.environ.get("BULLETIN_NATIVE", "1") != "0"


def active() -> bool:
    """Whether codec functions take the compiled path now."""
    return BUILT and _Switch.enabled


@contextmanager
def disabled() -> Iterator[None]:
    """Run the block on the NumPy path only (process-wide: for tests and benchmarks, not
    for concurrent use)."""
    was, _Switch.enabled = _Switch.enabled, False
    try:
        yield
    finally:
        _Switch.enabled = was
