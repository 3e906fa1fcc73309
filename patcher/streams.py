"""The transforms of codec version 1: an entry's changes as bytes for the entropy coder.

Gaps: the changed indices of an entry ``[start, stop)`` become gaps ``g[0] = i[0] -
start + 1``, ``g[k] = i[k] - i[k-1]`` (all >= 1), so ``i = start - 1 + cumsum(g)``.
Each gap is split into its low byte ``g & 0xFF`` (near-uniform at the densities seen:
stored as a plain byte plane) and its high part ``g >> 8`` (mostly 0..2: a small value).

Deltas: each delta, read as a signed integer of the element width, is zig-zag mapped
(``-1 -> 1``, ``+1 -> 2``, ``-2 -> 3``, ...; never 0 since deltas are nonzero) and
``z - 1`` is a small value.

Small values ``v >= 0`` are written as 2-bit codes ``min(v, 3)``, four to a byte, and
the values of code 3 ("escapes") as ``v - 3`` in byte planes (plane ``j`` holds byte
``j``, little-endian, of every escape) of the smallest width that holds them. Both the
high gap parts and the deltas have about 1.5 bits of entropy: a byte per value would
leave Huffman coding a floor of one bit per value and invite unprofitable short matches
at fast zstd levels, four codes per byte let it get close to the entropy at any level.

Every decoder here checks what it decodes (ranges, canonical widths, padding, escape
counts) and raises ``FormatError``; none trusts its input. A shard concatenates each of
these byte strings across its entries (patcher.encode).

The NumPy code below defines every transform; where the compiled fast path is built
(patcher.native), its loops do the per-value work and the escapes (a few percent of the
values) still go through NumPy. A compiled decoder only says *that* its input is bad:
the NumPy decoder (``*_numpy``) is then run on it to say what is wrong, in its words.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Final, TypeVar

import numpy as np
from numpy.typing import NDArray

from patcher import native
from patcher.errors import FormatError, InvalidInput
from patcher.format import codes_size

__all__ = [
    "Buffer",
    "EntryBytes",
    "SmallValues",
    "byte_width",
    "decode_deltas",
    "decode_deltas_numpy",
    "decode_gaps",
    "decode_gaps_numpy",
    "encode_deltas",
    "encode_gaps",
    "escape_values",
    "join_planes",
    "pack_gaps",
    "unpack_gaps",
]

Buffer = bytes | memoryview

_U64 = np.dtype("<u8")
#: Small values 0..2 have their own 2-bit code; 3 is the escape.
_ESCAPE: Final = 3


def byte_width(max_value: int) -> int:
    """The fewest bytes (at least one) that hold ``max_value``."""
    return max(1, (int(max_value).bit_length() + 7) // 8)


@dataclass(frozen=True, slots=True)
class SmallValues:
    """Small values as 2-bit codes and escape byte planes."""

    codes: bytes
    #: Plane ``j`` holds byte ``j`` of every escaped ``v - 3``; empty without escapes.
    escapes: list[bytes]

    @property
    def escape_count(self) -> int:
        return len(self.escapes[0]) if self.escapes else 0


@dataclass(frozen=True, slots=True)
class EntryBytes:
    """What one kind of an entry's data (gaps or deltas) adds to a shard's streams."""

    #: The gaps' low bytes; empty for deltas.
    low: bytes
    small: SmallValues


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


def _small_values(codes: NDArray[np.uint8], escaped: NDArray[np.uint64]) -> SmallValues:
    """Packed codes and the escaped ``v - 3`` as they come from the compiled coders."""
    if escaped.size == 0:
        return SmallValues(codes.tobytes(), [])
    return SmallValues(codes.tobytes(), _to_planes(escaped, byte_width(int(escaped.max()))))


def _pack_small(values: NDArray[np.unsignedinteger]) -> SmallValues:
    codes = np.minimum(values, _ESCAPE).astype(np.uint8)
    padded = np.zeros(codes_size(values.size) * 4, dtype=np.uint8)
    padded[: values.size] = codes
    quads = padded.reshape(-1, 4)
    packed = quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)
    escaped = values[codes == _ESCAPE]
    if escaped.size == 0:
        return SmallValues(packed.tobytes(), [])
    escaped -= escaped.dtype.type(_ESCAPE)
    return SmallValues(packed.tobytes(), _to_planes(escaped, byte_width(int(escaped.max()))))


@cache
def _code_table() -> NDArray[np.uint8]:
    """Packed byte -> its four 2-bit codes."""
    table = (np.arange(256, dtype=np.uint8)[:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & np.uint8(3)
    table.flags.writeable = False
    return table


def _unpack_codes(codes: Buffer, count: int, escapes: int, what: str) -> tuple[NDArray[np.uint8], NDArray[np.intp]]:
    """The codes of ``count`` values and where the escapes are; checks padding and count."""
    packed = np.frombuffer(codes, dtype=np.uint8, count=codes_size(count))
    if count % 4 and int(packed[-1]) >> (2 * (count % 4)):
        raise FormatError(f"{what}: nonzero padding after the last code")
    unpacked = _code_table()[packed].reshape(-1)[:count]
    escaped_at = np.flatnonzero(unpacked == _ESCAPE)
    if escaped_at.size != escapes:
        raise FormatError(f"{what}: the codes hold {escaped_at.size} escapes, {escapes} declared")
    return unpacked, escaped_at


_A = TypeVar("_A", bound=np.ndarray)


def _into(out: _A | None, result: _A) -> _A:
    """``result``, copied into ``out`` when the caller gave one."""
    if out is None:
        return result
    out[...] = result
    return out


def join_planes(planes: Sequence[Buffer]) -> Buffer:
    """Escape byte planes as one buffer, plane after plane (what the compiled path reads)."""
    if len(planes) == 1:
        return planes[0]
    return b"".join(planes)


def escape_values(planes: Sequence[Buffer], escapes: int, limit: int, what: str) -> NDArray[np.uint64]:
    """Escaped values (``v``, not ``v - 3``) from their byte planes, each at most ``limit``;
    checks the planes' width is canonical."""
    # Canonical widths: a wider field than needed would give the same values two encodings.
    if len(planes) > 1 and not np.frombuffer(planes[-1], dtype=np.uint8, count=escapes).any():
        raise FormatError(f"{what}: escape width {len(planes)} is not the smallest that holds the values")
    values = _from_planes(planes, escapes)
    if int(values.max()) > limit - _ESCAPE:
        raise FormatError(f"{what}: an escaped value past {limit}")
    values += np.uint64(_ESCAPE)
    return values


# -- gaps --------------------------------------------------------------------------------


def encode_gaps(indices: NDArray[np.int64], start: int) -> EntryBytes:
    """The gap bytes of sorted unique ``indices`` (at least one, all >= ``start``)."""
    if native.active() and indices.dtype == np.int64 and indices.flags.c_contiguous:
        n = indices.size
        low, codes = np.empty(n, dtype=np.uint8), np.empty(codes_size(n), dtype=np.uint8)
        escaped = np.empty(n, dtype=np.uint64)
        count = native.speedups.encode_gaps(indices, start, low, codes, escaped)
        return EntryBytes(low.tobytes(), _small_values(codes, escaped[:count]))
    gaps = np.empty(indices.size, dtype=np.int64)
    gaps[0] = indices[0] - (start - 1)
    np.subtract(indices[1:], indices[:-1], out=gaps[1:])
    g = gaps.view(np.uint64)
    return EntryBytes((g & np.uint64(0xFF)).astype(np.uint8).tobytes(), _pack_small(g >> np.uint64(8)))


def decode_gaps(
    low: Buffer,
    codes: Buffer,
    escape_planes: Sequence[Buffer],
    count: int,
    escapes: int,
    start: int,
    stop: int,
    what: str,
    *,
    out: NDArray[np.int64] | None = None,
) -> NDArray[np.int64]:
    """Indices of an entry from its gap bytes; checks they are increasing and < ``stop``.

    ``out``, if given, is a C-contiguous int64 array of ``count`` elements to decode into
    (and is returned).
    """
    if out is not None and (out.dtype != np.int64 or out.shape != (count,) or not out.flags.c_contiguous):
        raise InvalidInput(f"out must be a C-contiguous int64 array of {count} elements")
    if not native.active() or len(low) != count or len(codes) != codes_size(count):
        return _into(out, decode_gaps_numpy(low, codes, escape_planes, count, escapes, start, stop, what))
    if out is None:
        out = np.empty(count, dtype=np.int64)
    planes = join_planes(escape_planes)
    if native.speedups.decode_gaps(low, codes, planes, len(escape_planes), escapes, count, start, stop, out):
        return out
    decode_gaps_numpy(low, codes, escape_planes, count, escapes, start, stop, what)  # says what is wrong
    raise FormatError(f"{what}: gap streams do not decode")  # pragma: no cover - both decoders agree


def decode_gaps_numpy(
    low: Buffer,
    codes: Buffer,
    escape_planes: Sequence[Buffer],
    count: int,
    escapes: int,
    start: int,
    stop: int,
    what: str,
) -> NDArray[np.int64]:
    """:func:`decode_gaps` in NumPy alone: the definition the compiled decoder is held to."""
    span = stop - start
    high, escaped_at = _unpack_codes(codes, count, escapes, f"{what}: gap codes")
    gaps = high.astype(np.uint64)
    if escapes:
        # A high part above span >> 8 would make a gap past the range (or overflow).
        gaps[escaped_at] = escape_values(escape_planes, escapes, span >> 8, f"{what}: gaps")
    gaps <<= np.uint64(8)
    gaps += np.frombuffer(low, dtype=np.uint8, count=count)
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
    """An entry's gap bytes in one string (low bytes, codes, escape planes); returns it and
    the escape width. For tests and tools; a shard keeps the three parts apart."""
    parts = encode_gaps(indices, start)
    return parts.low + parts.small.codes + b"".join(parts.small.escapes), len(parts.small.escapes)


def unpack_gaps(raw: Buffer, count: int, width: int, start: int, stop: int, what: str) -> NDArray[np.int64]:
    """Inverse of :func:`pack_gaps` (``width``: the escape width), with every check."""
    view = memoryview(raw)
    n_codes = codes_size(count)
    codes = view[count : count + n_codes]
    escapes = int(np.count_nonzero(_code_table()[np.frombuffer(codes, dtype=np.uint8)].reshape(-1)[:count] == _ESCAPE))
    tail = view[count + n_codes :]
    if len(tail) != escapes * width:
        raise FormatError(f"{what}: {len(tail)} escape bytes for {escapes} escapes of width {width}")
    planes = [tail[j * escapes : (j + 1) * escapes] for j in range(width)]
    return decode_gaps(view[:count], codes, planes, count, escapes, start, stop, what)


# -- deltas ------------------------------------------------------------------------------


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
def _delta_table(dtype: np.dtype[np.unsignedinteger]) -> NDArray[np.unsignedinteger]:
    """Packed byte -> its four deltas; an escape decodes to 0, which no delta can be."""
    codes = _code_table()
    table = _unzigzag((codes.astype(dtype) + dtype.type(1)).astype(dtype))
    table[codes == _ESCAPE] = 0
    table.flags.writeable = False
    return table


def encode_deltas(delta: NDArray[np.unsignedinteger]) -> EntryBytes:
    """The delta bytes of nonzero ``delta``: codes and escapes of ``zigzag(delta) - 1``."""
    if native.active() and delta.dtype.isnative and delta.flags.c_contiguous:
        n = delta.size
        codes, escaped = np.empty(codes_size(n), dtype=np.uint8), np.empty(n, dtype=np.uint64)
        count = native.speedups.encode_deltas(delta, delta.dtype.itemsize, codes, escaped)
        return EntryBytes(b"", _small_values(codes, escaped[:count]))
    z = _zigzag(delta)
    z -= z.dtype.type(1)
    return EntryBytes(b"", _pack_small(z))


def decode_deltas(
    codes: Buffer,
    escape_planes: Sequence[Buffer],
    count: int,
    escapes: int,
    dtype: np.dtype[np.unsignedinteger],
    what: str,
    *,
    out: NDArray[np.unsignedinteger] | None = None,
) -> NDArray[np.unsignedinteger]:
    """Deltas of an entry from its codes and escape planes; checks padding, escapes and range.

    ``out``, if given, is a C-contiguous array of ``dtype`` and ``count`` elements to decode
    into (and is returned).
    """
    if out is not None and (out.dtype != dtype or out.shape != (count,) or not out.flags.c_contiguous):
        raise InvalidInput(f"out must be a C-contiguous {dtype} array of {count} elements")
    if not native.active() or len(codes) != codes_size(count):
        return _into(out, decode_deltas_numpy(codes, escape_planes, count, escapes, dtype, what))
    if out is None:
        out = np.empty(count, dtype=dtype)
    planes = join_planes(escape_planes)
    if native.speedups.decode_deltas(codes, planes, len(escape_planes), escapes, count, dtype.itemsize, out):
        return out
    decode_deltas_numpy(codes, escape_planes, count, escapes, dtype, what)  # says what is wrong
    raise FormatError(f"{what}: delta streams do not decode")  # pragma: no cover - both decoders agree


def decode_deltas_numpy(
    codes: Buffer,
    escape_planes: Sequence[Buffer],
    count: int,
    escapes: int,
    dtype: np.dtype[np.unsignedinteger],
    what: str,
) -> NDArray[np.unsignedinteger]:
    """:func:`decode_deltas` in NumPy alone: the definition the compiled decoder is held to."""
    packed = np.frombuffer(codes, dtype=np.uint8, count=codes_size(count))
    if count % 4 and int(packed[-1]) >> (2 * (count % 4)):
        raise FormatError(f"{what}: delta codes: nonzero padding after the last code")
    # One table lookup per packed byte yields four finished deltas.
    delta = _delta_table(dtype)[packed].reshape(-1)[:count]
    escaped_at = np.flatnonzero(delta == 0)
    if escaped_at.size != escapes:
        raise FormatError(f"{what}: delta codes: the codes hold {escaped_at.size} escapes, {escapes} declared")
    if escapes:
        # z - 1 <= 2**bits - 2: a larger z would not fit the width, or wrap to a zero delta.
        z = escape_values(escape_planes, escapes, (1 << (8 * dtype.itemsize)) - 2, f"{what}: deltas")
        z += np.uint64(1)
        delta[escaped_at] = _unzigzag(z.astype(dtype))
    return delta
