"""The context codec's model: which binary decisions code an entry, in which contexts.

docs/FORMAT.md 3.15.5 specifies it; this module is that text in Python (with the range
coder of patcher.rangecoder), the definition the compiled coder (patcher.native) is
held to. An entry's changes are coded class by class (class-major): for each class,
in rank order, a "more" flag (except in the last class, whose count follows from the
entry's), the gap between consecutive ranks and the change's delta.

- **Gaps** ``g >= 1`` are coded by bit length ``b`` relative to ``k``, the bit length
  of a running mean of the class's gaps (state ``(S, N)``: their sum and count), the
  two bits below the leading one in adaptive contexts, the rest as direct bits.
- **Deltas** are signed; the sign, then whether the magnitude ``m`` is 1, 2, 3, then
  an Elias-gamma code of ``m - 3`` whose length flags are adaptive, all in contexts of
  the dtype and the class's nominal exponent ``lo + class`` (shared by every tensor of
  the shard: the exponent sets the ULP, which sets how many ULPs a step is).

The model's counters persist across the entries of a shard and start afresh in each
shard, so a shard decodes on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, Protocol

import numpy as np
from numpy.typing import NDArray

from patcher.context import ClassWindow, exponent_width
from patcher.dtypes import DTYPE_WIDTHS
from patcher.errors import FormatError
from patcher.format import ContextEntry
from patcher.rangecoder import RangeDecoder, RangeEncoder

if TYPE_CHECKING:
    from patcher.context import ContextStream

__all__ = [
    "CONTEXTS",
    "DELTA_DTYPES",
    "decode_entry",
    "encode_entry",
    "entry_meta",
    "trace_entry",
]

# -- the context table (FORMAT.md 3.15.5): offsets of each kind in one flat array --------

#: More flags: 2 * class + (1 before the class's first gap, else 0).
MORE: Final = 0
#: Gap bit length: is it above k? [fraction 0..3][min(k, 24)]
GAP_LONGER: Final = MORE + 32
#: ... how far above: [fraction][min(j - k, 8) - 1]
GAP_UP: Final = GAP_LONGER + 4 * 25
#: ... how far below: [fraction][min(k - j, 8)][min(k, 24)]
GAP_DOWN: Final = GAP_UP + 4 * 8
#: The two gap bits below the leading one: [clip(b - k, -3, 3) + 3][fraction][node 0..2][min(b, 4) - 2]
GAP_BITS: Final = GAP_DOWN + 4 * 9 * 25
#: Delta contexts: [dtype][nominal exponent mod 256][slot], slot 0 the sign, 1..3 the
#: magnitude flags, 4..23 the Elias-gamma length flags.
DELTA: Final = GAP_BITS + 7 * 4 * 3 * 3
DELTA_SLOTS: Final = 24
#: The dtypes in the order of their delta tables.
DELTA_DTYPES: Final = tuple(DTYPE_WIDTHS)
CONTEXTS: Final = DELTA + len(DELTA_DTYPES) * 256 * DELTA_SLOTS

#: Gaps are below 2**63 (indices are int64).
MAX_GAP_BITS: Final = 63
#: What a gap adds to the running sum, at most: keeps the sum of 64 gaps in 64 bits.
GAP_SUM_CAP: Final = 1 << 32
#: The running mean forgets: at this count, sum and count are halved.
GAP_WINDOW: Final = 64

_DTYPE_INDEX: Final = {name: i for i, name in enumerate(DELTA_DTYPES)}


class _Bits(Protocol):
    """What a gap or delta codes through: a range encoder, or a decoder's trace."""

    def bit(self, ctx: int, bit: int) -> None: ...
    def direct(self, value: int, count: int) -> None: ...


def rate(s: int, n: int) -> tuple[int, int]:
    """``(k, fraction)`` of the running mean ``s / n`` (``s >= n >= 1``): ``q = floor(256 s
    / n)``, ``k = bit_length(q) - 8`` and the two bits of ``q`` below its leading one."""
    q = (s << 8) // n
    b = q.bit_length()
    return b - 8, (q >> (b - 3)) & 3


def next_state(s: int, n: int, g: int) -> tuple[int, int]:
    s += min(g, GAP_SUM_CAP)
    n += 1
    if n == GAP_WINDOW:
        return (s + 1) >> 1, n >> 1
    return s, n


def class_start(s: int, n: int) -> tuple[int, int]:
    """The state a class starts in after the one before ended in ``(s, n)``: a mean gap
    twice that class's (one exponent up, half the change rate)."""
    return max(2, (2 * s) // n), 1


FIRST_STATE: Final = (2, 1)


def _gap_length_ctx(k: int, fr: int) -> tuple[int, int]:
    kb = min(k, 24)
    return GAP_LONGER + fr * 25 + kb, kb


def encode_gap(coder: _Bits, g: int, k: int, fr: int) -> None:
    """Code gap ``g >= 1`` in a class whose state gives ``(k, fr)``."""
    b = g.bit_length()
    ctx, kb = _gap_length_ctx(k, fr)
    if b > k:
        coder.bit(ctx, 1)
        j = k + 1
        while j < MAX_GAP_BITS:
            done = b == j
            coder.bit(GAP_UP + fr * 8 + min(j - k, 8) - 1, 0 if done else 1)
            if done:
                break
            j += 1
    else:
        coder.bit(ctx, 0)
        j = k
        while j > 1:
            done = b == j
            coder.bit(GAP_DOWN + (fr * 9 + min(k - j, 8)) * 25 + kb, 0 if done else 1)
            if done:
                break
            j -= 1
    _mantissa(coder, g, b, k, fr)


def _mantissa_ctx(b: int, k: int, fr: int, node: int) -> int:
    rel = max(-3, min(3, b - k)) + 3
    return GAP_BITS + ((rel * 4 + fr) * 3 + node) * 3 + min(b, 4) - 2


def _mantissa(coder: _Bits, g: int, b: int, k: int, fr: int) -> None:
    below = b - 1
    if below >= 1:
        top = (g >> (below - 1)) & 1
        coder.bit(_mantissa_ctx(b, k, fr, 0), top)
        if below >= 2:
            coder.bit(_mantissa_ctx(b, k, fr, 1 + top), (g >> (below - 2)) & 1)
            if below > 2:
                coder.direct(g, below - 2)


def decode_gap(dec: RangeDecoder, k: int, fr: int) -> int:
    ctx, kb = _gap_length_ctx(k, fr)
    if dec.bit(ctx):
        b = k + 1
        while b < MAX_GAP_BITS and dec.bit(GAP_UP + fr * 8 + min(b - k, 8) - 1):
            b += 1
    else:
        b = k
        while b > 1 and dec.bit(GAP_DOWN + (fr * 9 + min(k - b, 8)) * 25 + kb):
            b -= 1
    g = 1
    below = b - 1
    if below >= 1:
        top = dec.bit(_mantissa_ctx(b, k, fr, 0))
        g = (g << 1) | top
        if below >= 2:
            g = (g << 1) | dec.bit(_mantissa_ctx(b, k, fr, 1 + top))
            if below > 2:
                g = (g << (below - 2)) | dec.direct(below - 2)
    return g


def delta_row(dtype: str, window: ClassWindow, cls: int) -> int:
    """The first context of the delta table of ``dtype`` and class ``cls`` of ``window``."""
    row = (window.lo + cls) & 255 if exponent_width(dtype) else 0
    return DELTA + (_DTYPE_INDEX[dtype] * 256 + row) * DELTA_SLOTS


def encode_delta(coder: _Bits, s: int, row: int, width: int) -> None:
    """Code the nonzero signed delta ``s`` of a ``width``-byte element."""
    negative = s < 0
    coder.bit(row, 1 if negative else 0)
    m = -s if negative else s
    for t in (1, 2, 3):
        if m == t:
            coder.bit(row + t, 0)
            return
        coder.bit(row + t, 1)
    v = m - 3
    b = v.bit_length()
    most = 8 * width - 1
    j = 1
    while j < most:
        done = b == j
        coder.bit(row + 3 + min(j, 20), 0 if done else 1)
        if done:
            break
        j += 1
    coder.direct(v, b - 1)


def decode_delta(dec: RangeDecoder, row: int, width: int) -> int:
    negative = dec.bit(row)
    m = 1
    while m <= 3 and dec.bit(row + m):
        m += 1
    if m == 4:
        most = 8 * width - 1
        b = 1
        while b < most and dec.bit(row + 3 + min(b, 20)):
            b += 1
        m = ((1 << (b - 1)) | dec.direct(b - 1)) + 3
    half = 1 << (8 * width - 1)
    if m > (half if negative else half - 1):
        raise FormatError(f"{dec.what}: a delta of magnitude {m} does not fit {width} bytes")
    return -m if negative else m


def signed(delta: NDArray[np.unsignedinteger]) -> NDArray[np.signedinteger]:
    """The deltas read as two's-complement integers of their width."""
    return delta.view(np.dtype(f"i{delta.dtype.itemsize}"))


def encode_entry(
    enc: _Bits,
    dtype: str,
    window: ClassWindow,
    classes: NDArray[np.uint8],
    ranks: NDArray[np.int64],
    delta: NDArray[np.unsignedinteger],
) -> None:
    """Code one entry's changes, given class-major (classes non-decreasing, ranks
    increasing within a class) with their deltas."""
    count = int(ranks.size)
    if count == 0:
        return
    cls_list = classes.tolist()
    rank_list = ranks.tolist()
    deltas = signed(delta).tolist()
    width = delta.dtype.itemsize
    last = window.classes - 1
    s, n = FIRST_STATE
    pos = 0
    for c in range(window.classes):
        if pos == count:
            break
        row = delta_row(dtype, window, c)
        prev, first = -1, 1
        while pos < count:
            here = cls_list[pos] == c
            if c < last:
                enc.bit(MORE + 2 * c + first, 1 if here else 0)
            if not here:
                break
            g = rank_list[pos] - prev
            k, fr = rate(s, n)
            encode_gap(enc, g, k, fr)
            s, n = next_state(s, n, g)
            encode_delta(enc, deltas[pos], row, width)
            prev, first, pos = rank_list[pos], 0, pos + 1
        s, n = class_start(s, n)


def decode_entry(
    dec: RangeDecoder, dtype: str, window: ClassWindow, count: int, span: int, bits_dtype: np.dtype[np.unsignedinteger]
) -> tuple[NDArray[np.uint8], NDArray[np.int64], NDArray[np.unsignedinteger]]:
    """One entry's ``count`` changes in class-major order: classes, ranks (each below
    ``span``, the entry's element count) and deltas (as the bits dtype)."""
    classes = np.empty(count, dtype=np.uint8)
    ranks = np.empty(count, dtype=np.int64)
    values: list[int] = []
    width = bits_dtype.itemsize
    last = window.classes - 1
    s, n = FIRST_STATE
    pos = 0
    for c in range(window.classes):
        if pos == count:
            break
        row = delta_row(dtype, window, c)
        prev, first = -1, 1
        while pos < count:
            if c < last and not dec.bit(MORE + 2 * c + first):
                break
            k, fr = rate(s, n)
            g = decode_gap(dec, k, fr)
            rank = prev + g
            if rank >= span:
                raise FormatError(f"{dec.what}: class {c} rank {rank} past the entry's {span} elements")
            s, n = next_state(s, n, g)
            values.append(decode_delta(dec, row, width))
            classes[pos], ranks[pos] = c, rank
            prev, first, pos = rank, 0, pos + 1
        s, n = class_start(s, n)
    mask = (1 << (8 * width)) - 1
    delta = np.array([v & mask for v in values], dtype=np.uint64).astype(bits_dtype)
    return classes, ranks, delta


def entry_meta(entries: Sequence[ContextEntry], dtypes: Sequence[str], extra: Sequence[int]) -> NDArray[np.int64]:
    """The compiled coder's description of entries: per entry, count, lo, classes, delta
    table, width, exponent bits and ``extra`` (a header cost, or the entry's span)."""
    meta = np.empty((len(entries), 7), dtype=np.int64)
    for i, (e, dtype, x) in enumerate(zip(entries, dtypes, extra, strict=True)):
        meta[i] = (e.count, e.lo, e.classes, _DTYPE_INDEX[dtype], DTYPE_WIDTHS[dtype], exponent_width(dtype), x)
    return meta


def new_encoder() -> RangeEncoder:
    return RangeEncoder(CONTEXTS)


def new_decoder(data: bytes | memoryview, what: str) -> RangeDecoder:
    return RangeDecoder(data, CONTEXTS, what)


class _Trace:
    """A coder that records the decisions it is given instead of coding them."""

    def __init__(self) -> None:
        self.decisions: list[tuple[int, int]] = []

    def bit(self, ctx: int, bit: int) -> None:
        self.decisions.append((ctx, bit))

    def direct(self, value: int, count: int) -> None:
        self.decisions.extend((-1, (value >> k) & 1) for k in range(count - 1, -1, -1))


def _kind(ctx: int) -> str:
    if ctx < 0:
        return "direct"
    if ctx < GAP_LONGER:
        return "more"
    if ctx < GAP_BITS:
        return "gap_length"
    return "gap_bits" if ctx < DELTA else "delta"


def trace_entry(
    dtype: str,
    window: ClassWindow,
    classes: NDArray[np.uint8],
    ranks: NDArray[np.int64],
    delta: NDArray[np.unsignedinteger],
) -> list[ContextStream]:
    """Every decision :func:`encode_entry` codes for this entry, by kind: 0/1 symbols in
    their context ids (direct bits in context 0 of kind ``direct``)."""
    from patcher.context import ContextStream  # the module imports this one

    trace = _Trace()
    encode_entry(trace, dtype, window, classes, ranks, delta)
    by_kind: dict[str, tuple[list[int], list[int]]] = {}
    for ctx, bit in trace.decisions:
        symbols, contexts = by_kind.setdefault(_kind(ctx), ([], []))
        symbols.append(bit)
        contexts.append(max(ctx, 0))
    return [
        ContextStream(kind, np.array(sym, dtype=np.int64), np.array(ctx, dtype=np.int64), 2)
        for kind, (sym, ctx) in sorted(by_kind.items())
    ]
