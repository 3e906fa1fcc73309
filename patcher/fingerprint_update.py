"""The O(changed) fingerprint update, fused and cache-blocked.

Computes exactly :func:`patcher.fingerprint.fingerprint_delta` (the normative
definition; a test holds the two equal), about twice as fast: ``i * K_INDEX`` is
computed once for the old and the new bits, and the splitmix64 finaliser runs in place
over blocks that stay in L1/L2 instead of allocating a full-size temporary per step.
Diff and apply call it once per changed element, so it is on both hot paths; where the
compiled fast path is built (patcher.native) it runs there.
"""

from __future__ import annotations

from typing import Final

import numpy as np
from numpy.typing import NDArray

from patcher import native
from patcher.fingerprint import K_INDEX, M1, M2

__all__ = ["fingerprint_change"]

#: Elements per block: three uint64 buffers of 256 KiB each (fastest of 8 Ki..128 Ki, measured).
BLOCK: Final = 1 << 15
_U64 = np.uint64
_MASK64: Final = (1 << 64) - 1


def _finalise(x: NDArray[np.uint64], tmp: NDArray[np.uint64]) -> None:
    """splitmix64's finaliser, in place (wrapping multiplication is the definition)."""
    np.right_shift(x, _U64(30), out=tmp)
    x ^= tmp
    x *= _U64(M1)
    np.right_shift(x, _U64(27), out=tmp)
    x ^= tmp
    x *= _U64(M2)
    np.right_shift(x, _U64(31), out=tmp)
    x ^= tmp


def fingerprint_change(
    indices: NDArray[np.integer], old: NDArray[np.unsignedinteger], new: NDArray[np.unsignedinteger]
) -> int:
    """What to add (mod 2**64) to a fingerprint when ``old`` becomes ``new`` at ``indices``.

    ``indices`` are non-negative; ``old`` and ``new`` are unsigned bits of equal length.
    """
    n = int(indices.size)
    if n == 0:
        return 0
    if (
        native.active()
        and indices.dtype == np.int64
        and old.dtype == new.dtype
        and old.dtype.kind == "u"
        and old.dtype.isnative
        and old.size == new.size == n
        and all(a.flags.c_contiguous for a in (indices, old, new))
    ):
        return native.speedups.fingerprint_change(indices, old, new, old.dtype.itemsize)
    key, other, tmp = np.empty((3, min(n, BLOCK)), dtype=_U64)
    total = 0
    for lo in range(0, n, BLOCK):
        hi = min(lo + BLOCK, n)
        k, o, t = key[: hi - lo], other[: hi - lo], tmp[: hi - lo]
        ix = indices[lo:hi]
        # Non-negative int64 reinterpreted as uint64 is what astype gives, without a copy
        # (and int64 * uint64 would promote to float64).
        ix = ix.view(_U64) if ix.dtype == np.int64 else ix.astype(_U64)
        np.multiply(ix, _U64(K_INDEX), out=k)
        np.bitwise_xor(k, new[lo:hi], out=o, casting="unsafe")
        np.bitwise_xor(k, old[lo:hi], out=k, casting="unsafe")
        _finalise(o, t)
        _finalise(k, t)
        # uint64 sums wrap mod 2**64, the group fingerprints live in.
        total += int(o.sum(dtype=_U64)) - int(k.sum(dtype=_U64))
    return total & _MASK64
