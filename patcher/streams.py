"""The transforms of codec version 1 that turn an entry's changes into byte planes.

Gaps: the changed indices of an entry ``[start, stop)`` become gaps ``g[0] = i[0] -
start + 1``, ``g[k] = i[k] - i[k-1]`` (all >= 1), split into ``w`` byte planes (plane
``j`` holds byte ``j`` of every gap, little-endian), ``w`` the fewest bytes that hold
the largest gap. Low planes are near-uniform, high planes nearly constant: kept apart
(a shard concatenates each plane across its entries), the entropy coder sees
homogeneous bytes. Decoding is a transpose and a cumulative sum, which is also how the
GPU decodes them.

Deltas: each delta, read as a signed integer of the element width, is zig-zag mapped
(``-1 -> 1``, ``+1 -> 2``, ``-2 -> 3``, ...; never 0 since deltas are nonzero). Values
1..3 become 2-bit codes 0..2, packed four to a byte; code 3 is an escape whose value
minus 4 follows in byte planes after the codes. One-step BF16 deltas are mostly +-1 ULP,
about 1.7 bits of entropy: a byte per delta would leave the entropy coder a one-bit floor
per symbol (Huffman), four per byte lets it get close to the entropy at any level.

Every ``unpack_*`` checks what it decodes (ranges, canonical widths, padding) and raises
``FormatError``; none trusts its input.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Final

import numpy as np
from numpy.typing import NDArray

from bulletin.errors import FormatError
from patcher.format import codes_size

__all__ = [
    "byte_width",
    "delta_parts",
    "deltas_from_parts",
    "gap_planes",
    "gaps_from_planes",
    "pack_deltas",
    "pack_gaps",
    "unpack_deltas",
    "unpack_gaps",
]

Buffer = bytes | memoryview

_U64 = np.dtype("<u8")
#: zig-zag values 1..3 have their own code; 3 is the escape.
_ESCAPE: Final = 3
_ESCAPE_BIAS: Final = 4


def byte_width(max_value: int) -> int:
    """The fewest bytes (at least one) that hold ``max_value``."""
    return max(1, (int(max_value).bit_length() + 7) // 8)


def _to_planes(values: NDArray[np.unsignedinteger], width: int) -> list[bytes]:
    """Plane ``j`` holds byte ``j`` (little-endian) of every value."""
    le = values.astype(_U64, copy=False).view(np.uint8).reshape(values.size, 8)
    planes = np.ascontiguousarray(le[:, :width].T)
    return [plane.tobytes() for plane in planes]


def _from_planes(planes: Sequence[Buffer], count: int) -> NDArray[np.uint64]:
    """Values from their byte planes (a fresh, writable uint64 array)."""
    # Horner over the planes, top first: contiguous passes, no strided transpose.
    values: NDArray[np.uint64] = np.frombuffer(planes[-1], dtype=np.uint8, count=count).astype(np.uint64)
    for plane in reversed(planes[:-1]):
        values <<= np.uint64(8)
        values += np.frombuffer(plane, dtype=np.uint8, count=count)
    return values


def _check_top_plane(planes: Sequence[Buffer], count: int, what: str) -> None:
    # Canonical widths: a wider field than needed would give the same values two encodings.
    if len(planes) > 1 and not np.frombuffer(planes[-1], dtype=np.uint8, count=count).any():
        raise FormatError(f"{what}: width {len(planes)} is not the smallest that holds the values")


def _split(raw: Buffer, count: int, width: int) -> list[memoryview]:
    view = memoryview(raw)
    return [view[j * count : (j + 1) * count] for j in range(width)]


def gap_planes(indices: NDArray[np.int64], start: int) -> list[bytes]:
    """Byte planes of the gaps of sorted unique ``indices`` (all >= ``start``, at least one)."""
    gaps = np.empty(indices.size, dtype=np.int64)
    gaps[0] = indices[0] - (start - 1)
    np.subtract(indices[1:], indices[:-1], out=gaps[1:])
    return _to_planes(gaps.view(np.uint64), byte_width(int(gaps.max())))


def gaps_from_planes(planes: Sequence[Buffer], count: int, start: int, stop: int, what: str) -> NDArray[np.int64]:
    """Indices from the ``count``-byte gap planes of an entry; checks they are increasing and < ``stop``."""
    _check_top_plane(planes, count, f"{what}: gaps")
    gaps = _from_planes(planes, count)
    span = stop - start
    if int(gaps.min()) < 1:
        raise FormatError(f"{what}: a gap of 0 (indices must be strictly increasing)")
    if int(gaps.max()) > span:
        raise FormatError(f"{what}: a gap larger than the entry's range {span}")
    ends = np.cumsum(gaps, out=gaps)
    # Each gap is <= span < 2**63, so a wrap of the uint64 running sum would show as a
    # decrease; it cannot happen at all when count * span < 2**64.
    if count * span >= 1 << 64 and count > 1 and not bool(np.all(ends[1:] > ends[:-1])):
        raise FormatError(f"{what}: gaps overflow the entry's range")
    if int(ends[-1]) > span:
        raise FormatError(f"{what}: an index at or past the entry's end {stop}")
    indices = ends.view(np.int64)
    indices += start - 1
    return indices


def pack_gaps(indices: NDArray[np.int64], start: int) -> tuple[bytes, int]:
    """The gap planes of an entry, concatenated; returns (bytes, width)."""
    planes = gap_planes(indices, start)
    return b"".join(planes), len(planes)


def unpack_gaps(raw: Buffer, count: int, width: int, start: int, stop: int, what: str) -> NDArray[np.int64]:
    """Inverse of :func:`pack_gaps`, with the checks of :func:`gaps_from_planes`."""
    return gaps_from_planes(_split(raw, count, width), count, start, stop, what)


def _zigzag(delta: NDArray[np.unsignedinteger]) -> NDArray[np.unsignedinteger]:
    t = delta.dtype.type
    sign = delta >> t(delta.dtype.itemsize * 8 - 1)
    z: NDArray[np.unsignedinteger] = (delta << t(1)) ^ (t(0) - sign)
    return z


def _unzigzag(z: NDArray[np.unsignedinteger]) -> NDArray[np.unsignedinteger]:
    t = z.dtype.type
    delta: NDArray[np.unsignedinteger] = (z >> t(1)) ^ (t(0) - (z & t(1)))
    return delta


@cache
def _code_table(dtype: np.dtype[np.unsignedinteger]) -> NDArray[np.unsignedinteger]:
    """Packed byte -> its four deltas; an escape decodes to 0, which no delta can be."""
    codes = (np.arange(256, dtype=np.uint32)[:, None] >> np.array([0, 2, 4, 6], dtype=np.uint32)) & 3
    table = _unzigzag((codes + 1).astype(dtype))
    table[codes == _ESCAPE] = 0
    table.flags.writeable = False
    return table


def delta_parts(delta: NDArray[np.unsignedinteger]) -> tuple[bytes, list[bytes]]:
    """The packed 2-bit codes of nonzero ``delta`` and the byte planes of its escapes."""
    z = _zigzag(delta)
    codes = np.minimum(z, _ESCAPE + 1).astype(np.uint8)
    codes -= 1
    padded = np.zeros(codes_size(z.size) * 4, dtype=np.uint8)
    padded[: z.size] = codes
    quads = padded.reshape(-1, 4)
    packed = quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)
    escaped = z[codes == _ESCAPE]
    if escaped.size == 0:
        return packed.tobytes(), []
    escaped -= escaped.dtype.type(_ESCAPE_BIAS)
    return packed.tobytes(), _to_planes(escaped, byte_width(int(escaped.max())))


def deltas_from_parts(
    codes: Buffer,
    escape_planes: Sequence[Buffer],
    count: int,
    escapes: int,
    dtype: np.dtype[np.unsignedinteger],
    what: str,
) -> NDArray[np.unsignedinteger]:
    """Deltas from an entry's packed codes and escape planes; checks padding, escape count and range."""
    packed = np.frombuffer(codes, dtype=np.uint8, count=codes_size(count))
    if count % 4 and int(packed[-1]) >> (2 * (count % 4)):
        raise FormatError(f"{what}: nonzero padding after the last delta code")
    # One table lookup per packed byte yields four finished deltas.
    delta = _code_table(dtype)[packed].reshape(-1)[:count]
    escaped_at = np.flatnonzero(delta == 0)
    if escaped_at.size != escapes:
        raise FormatError(f"{what}: delta codes hold a different number of escapes than declared")
    if escapes:
        _check_top_plane(escape_planes, escapes, f"{what}: escapes")
        values = _from_planes(escape_planes, escapes)
        limit = (1 << (dtype.itemsize * 8)) - 1 - _ESCAPE_BIAS
        if int(values.max()) > limit:
            raise FormatError(f"{what}: an escaped delta outside the element width")
        z = values.astype(dtype)
        z += dtype.type(_ESCAPE_BIAS)
        delta[escaped_at] = _unzigzag(z)
    return delta


def pack_deltas(delta: NDArray[np.unsignedinteger]) -> tuple[bytes, int, int]:
    """Codes then escape planes, concatenated; returns (bytes, escapes, escape width)."""
    codes, planes = delta_parts(delta)
    escapes = len(planes[0]) if planes else 0
    return codes + b"".join(planes), escapes, len(planes)


def unpack_deltas(
    raw: Buffer, count: int, escapes: int, escape_width: int, dtype: np.dtype[np.unsignedinteger], what: str
) -> NDArray[np.unsignedinteger]:
    """Inverse of :func:`pack_deltas`, with the checks of :func:`deltas_from_parts`."""
    n_codes = codes_size(count)
    view = memoryview(raw)
    planes = _split(view[n_codes:], escapes, escape_width)
    return deltas_from_parts(view[:n_codes], planes, count, escapes, dtype, what)
