"""The binary range coder of the context codec (docs/FORMAT.md 3.15.4), in plain Python.

LZMA's range coder (Igor Pavlov's LZMA SDK; read in tukaani-project/xz,
src/liblzma/rangecoder/range_encoder.h at 369f72fd), with 16-bit probabilities and a
count-driven adaptation rate: integers only, so every platform, the compiled fast path
(patcher.native) and any other implementation produce and read the same bytes.

- **Adaptive bit.** A context holds ``p``, the probability of a 0 bit in units of
  2**-16 (``1 <= p <= 65535``, initially 32768), and ``n``, how many bits it has coded
  (saturating at 255). Coding a bit moves ``p`` towards it by ``1 / 2**s`` of the way,
  ``s = min(bit_length(n + 2) - 1, 7)``: the first bits count about as much as a plain
  average would give them, later ones as a window of about 128.
- **Coding.** With ``bound = (range >> 16) * p``: a 0 keeps ``[low, low + bound)``, a
  1 takes the rest. A **direct bit** (probability 1/2, no context) halves the range.
  After every bit, while ``range < 2**24``, one byte is shifted out.
- **Bytes.** The encoder's first output byte is always 0 and its last five bytes
  flush ``low``; a decoder reads exactly every byte the encoder wrote, never more.

These classes are the definition the compiled coder is held to; they are slow (a
Python call per bit) and used for small inputs, tests and when nothing is compiled.
"""

from __future__ import annotations

from typing import Final

from patcher.errors import FormatError

__all__ = ["MAX_COUNT", "PROB_INIT", "RangeDecoder", "RangeEncoder", "adapt"]

PROB_BITS: Final = 16
PROB_INIT: Final = 1 << (PROB_BITS - 1)
#: Counts saturate here; the rate stops changing long before (at n = 126).
MAX_COUNT: Final = 255
MAX_SHIFT: Final = 7
_TOP: Final = 1 << 24
_MASK32: Final = 0xFFFFFFFF

#: The adaptation shift for each count (bit_length(n + 2) - 1, at most MAX_SHIFT).
SHIFTS: Final = tuple(min((n + 2).bit_length() - 1, MAX_SHIFT) for n in range(MAX_COUNT + 1))


def adapt(p: int, n: int, bit: int) -> int:
    """The probability after coding ``bit`` with ``(p, n)``."""
    s = SHIFTS[n]
    return p + ((65536 - p) >> s) if bit == 0 else p - (p >> s)


class RangeEncoder:
    """Adaptive binary range encoder over a flat table of contexts."""

    __slots__ = ("_cache", "_cache_size", "_low", "_range", "counts", "out", "probs")

    def __init__(self, contexts: int) -> None:
        self.probs = [PROB_INIT] * contexts
        self.counts = [0] * contexts
        self.out = bytearray()
        self._low = 0
        self._range = _MASK32
        self._cache = 0
        self._cache_size = 1

    def _shift_low(self) -> None:
        low = self._low
        if low < 0xFF000000 or low > _MASK32:
            carry = low >> 32
            temp = self._cache
            while True:
                self.out.append((temp + carry) & 0xFF)
                temp = 0xFF
                self._cache_size -= 1
                if self._cache_size == 0:
                    break
            self._cache = (low >> 24) & 0xFF
        self._cache_size += 1
        self._low = (low & 0x00FFFFFF) << 8

    def bit(self, ctx: int, bit: int) -> None:
        """Code ``bit`` (0 or 1) in context ``ctx`` and adapt it."""
        p, n = self.probs[ctx], self.counts[ctx]
        bound = (self._range >> PROB_BITS) * p
        if bit:
            self._low += bound
            self._range -= bound
        else:
            self._range = bound
        self.probs[ctx] = adapt(p, n, bit)
        if n < MAX_COUNT:
            self.counts[ctx] = n + 1
        while self._range < _TOP:
            self._range = (self._range << 8) & _MASK32
            self._shift_low()

    def direct(self, value: int, count: int) -> None:
        """Code the ``count`` low bits of ``value``, most significant first, at p = 1/2."""
        for k in range(count - 1, -1, -1):
            self._range >>= 1
            if (value >> k) & 1:
                self._low += self._range
            while self._range < _TOP:
                self._range = (self._range << 8) & _MASK32
                self._shift_low()

    def size_bound(self) -> int:
        """At least what :meth:`finish` would return now: bytes out, pending, flush."""
        return len(self.out) + self._cache_size + 5

    def finish(self) -> bytes:
        """Flush and return every byte written."""
        for _ in range(5):
            self._shift_low()
        return bytes(self.out)


class RangeDecoder:
    """The decoder of :class:`RangeEncoder`'s bytes, checking everything it reads."""

    __slots__ = ("_code", "_data", "_pos", "_range", "counts", "probs", "what")

    def __init__(self, data: bytes | memoryview, contexts: int, what: str) -> None:
        self.what = what
        if len(data) < 5:
            raise FormatError(f"{what}: a coded stream has at least 5 bytes, this one {len(data)}")
        if data[0] != 0:
            raise FormatError(f"{what}: a coded stream starts with a 0 byte")
        self._data = data
        self._code = int.from_bytes(bytes(data[1:5]), "big")
        if self._code == _MASK32:
            raise FormatError(f"{what}: coded stream starts outside its range")
        self._pos = 5
        self._range = _MASK32
        self.probs = [PROB_INIT] * contexts
        self.counts = [0] * contexts

    def _next(self) -> int:
        if self._pos >= len(self._data):
            raise FormatError(f"{self.what}: coded stream ends before its last change")
        byte = self._data[self._pos]
        self._pos += 1
        return byte

    def bit(self, ctx: int) -> int:
        p, n = self.probs[ctx], self.counts[ctx]
        bound = (self._range >> PROB_BITS) * p
        if self._code < bound:
            self._range = bound
            bit = 0
        else:
            self._code -= bound
            self._range -= bound
            bit = 1
        self.probs[ctx] = adapt(p, n, bit)
        if n < MAX_COUNT:
            self.counts[ctx] = n + 1
        while self._range < _TOP:
            self._range = (self._range << 8) & _MASK32
            self._code = (self._code << 8) | self._next()
        return bit

    def direct(self, count: int) -> int:
        value = 0
        for _ in range(count):
            self._range >>= 1
            bit = 1 if self._code >= self._range else 0
            if bit:
                self._code -= self._range
                if self._code >= self._range:  # only a stream no encoder wrote gets here
                    raise FormatError(f"{self.what}: coded stream leaves its range")
            value = (value << 1) | bit
            while self._range < _TOP:
                self._range = (self._range << 8) & _MASK32
                self._code = (self._code << 8) | self._next()
        return value

    def finish(self) -> None:
        """``FormatError`` unless every byte of the stream was read."""
        if self._pos != len(self._data):
            raise FormatError(f"{self.what}: {len(self._data) - self._pos} bytes after the last change")
