"""Per-tensor fingerprints that a patch can update in O(changed elements).

A fingerprint is the sum, modulo 2**64, of one 64-bit hash per element::

    fp(bits) = sum_i H(i, bits[i])  mod 2**64
    H(i, b)  = mix64((i * K_INDEX  mod 2**64) XOR b)

where ``mix64`` is the splitmix64 finaliser (a bijection on 64-bit words) and ``b`` is
the element's bits zero-extended to 64 bits. Because the sum is over elements, an
apply that changes elements ``I`` from ``old`` to ``new`` moves the fingerprint by
``sum_{i in I} H(i, new[i]) - H(i, old[i])``: no pass over the whole tensor. Because
``mix64`` is a bijection and the XOR with a fixed index word is too, a single wrong
element always changes the fingerprint; several wrong elements cancel only by a
2**-64 accident. It is an integrity check against bugs, crashes and wrong bases,
not against an adversary: shard and keyframe bytes are covered by SHA-256.

The exact definition is normative (docs/FORMAT.md); this NumPy form defines it, and the
compiled fast path (patcher.native) and the CUDA kernels (kernels/bulletin_kernels/fingerprint.cu)
compute it bit for bit.
"""

from __future__ import annotations

import re
from typing import Final

import numpy as np
from numpy.typing import NDArray

from patcher import native

__all__ = [
    "CHUNK_ELEMENTS",
    "K_INDEX",
    "element_hashes",
    "fingerprint",
    "fingerprint_rows",
    "format_fingerprint",
    "parse_fingerprint",
]

K_INDEX: Final = 0x9E3779B97F4A7C15
M1: Final = 0xBF58476D1CE4E5B9
M2: Final = 0x94D049BB133111EB

#: Elements hashed per step of a full fingerprint: bounds temporaries to ~4 x 8 MiB.
CHUNK_ELEMENTS: Final = 1 << 20

_U64 = np.uint64
_WIRE: Final = re.compile("[0-9a-f]{16}")


def element_hashes(indices: NDArray[np.integer], bits: NDArray[np.unsignedinteger]) -> NDArray[np.uint64]:
    """``H(i, b)`` for each pair; ``indices`` and ``bits`` have equal length."""
    with np.errstate(over="ignore"):
        x = indices.astype(_U64, copy=False) * _U64(K_INDEX)
        x ^= bits.astype(_U64, copy=False)
        x ^= x >> _U64(30)
        x *= _U64(M1)
        x ^= x >> _U64(27)
        x *= _U64(M2)
        x ^= x >> _U64(31)
    return x


def _sum64(h: NDArray[np.uint64]) -> int:
    # NumPy's uint64 sum wraps modulo 2**64, which is exactly the group we sum in.
    return int(h.sum(dtype=_U64))


def fingerprint(bits: NDArray[np.unsignedinteger]) -> int:
    """Full fingerprint of a tensor's bits (any shape, C order), as an int in [0, 2**64)."""
    if native.active() and bits.flags.c_contiguous and bits.dtype.kind == "u" and bits.dtype.isnative:
        return native.speedups.fingerprint(bits, bits.dtype.itemsize, 0)
    flat = bits.reshape(-1)
    total = 0
    for start in range(0, flat.size, CHUNK_ELEMENTS):
        chunk = flat[start : start + CHUNK_ELEMENTS]
        idx = np.arange(start, start + chunk.size, dtype=_U64)
        total = (total + _sum64(element_hashes(idx, chunk))) & 0xFFFFFFFFFFFFFFFF
    return total


def fingerprint_rows(bits: NDArray[np.unsignedinteger], first_index: int, row_stride: int) -> int:
    """The part of a larger tensor's fingerprint that the elements of ``bits`` contribute.

    ``bits`` (``rows x run``, C order, or 1-D for one row) holds elements of a flat tensor
    whose element ``(r, c)`` has index ``first_index + r * row_stride + c`` there: a
    tensor-parallel shard of a checkpoint tensor, say. Fingerprints are sums over
    elements, so the parts of disjoint shards add up (mod 2**64) to the tensor's
    :func:`fingerprint`. O(elements) plus O(rows) calls.
    """
    rows = bits.reshape(-1, bits.shape[-1]) if bits.ndim else bits.reshape(1, 1)
    count, run = rows.shape
    if count <= 1 or row_stride == run:
        flat = rows.reshape(-1)
        if native.active() and flat.flags.c_contiguous and flat.dtype.kind == "u" and flat.dtype.isnative:
            return native.speedups.fingerprint(flat, flat.dtype.itemsize, first_index)
        return _fingerprint_from(flat, first_index, count * run, run, run)
    if native.active() and rows.flags.c_contiguous and rows.dtype.kind == "u" and rows.dtype.isnative and run >= 256:
        total = 0
        for r in range(count):  # one compiled pass per row: each is contiguous in both
            total += native.speedups.fingerprint(rows[r], rows.dtype.itemsize, first_index + r * row_stride)
        return total & 0xFFFFFFFFFFFFFFFF
    return _fingerprint_from(rows.reshape(-1), first_index, count * run, run, row_stride)


def _fingerprint_from(flat: NDArray[np.unsignedinteger], first: int, size: int, run: int, stride: int) -> int:
    """NumPy form of :func:`fingerprint_rows` over ``flat`` (rows of ``run`` back to back)."""
    total = 0
    step = max(run, CHUNK_ELEMENTS // run * run)  # whole rows per chunk
    for lo in range(0, size, step):
        pos = np.arange(lo, min(lo + step, size), dtype=np.int64)
        idx = (first + (pos // run) * stride + pos % run).astype(_U64)
        total = (total + _sum64(element_hashes(idx, flat[lo : lo + pos.size]))) & 0xFFFFFFFFFFFFFFFF
    return total


def format_fingerprint(fp: int) -> str:
    """The wire form: 16 lowercase hex digits."""
    return f"{fp:016x}"


def parse_fingerprint(text: str) -> int:
    """Inverse of :func:`format_fingerprint`; raises ``ValueError`` on anything else."""
    if not isinstance(text, str) or _WIRE.fullmatch(text) is None:
        raise ValueError(f"fingerprint must be 16 lowercase hex digits, got {text!r}")
    return int(text, 16)
