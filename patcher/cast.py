"""Exact casts from training precision to the served dtype, on bits, in NumPy (which
defines them) with a compiled twin (patcher.native).

This is the CPU twin of the GPU cast in ``kernels/bulletin_kernels/common.cuh``: both are written with
integer operations only, so they agree bit for bit with each other on every input and
with ``torch``'s round-to-nearest-even on every non-NaN input.

Supported casts (safetensors names): identity (any dtype to itself), ``F32 -> BF16``
and ``F32 -> F16``.

Rounding is IEEE round-to-nearest, ties-to-even, with gradual underflow (subnormal
inputs and outputs are kept, never flushed) and overflow to infinity, which is what
``Tensor.to(torch.bfloat16)`` / ``.to(torch.float16)`` do on the CPU and on CUDA.

NaNs need a choice, because ``torch`` itself does not give one answer (measured with
torch 2.13 on x86-64; see tests/kernels/test_cast.py):

- F32 -> BF16: the vectorised CPU kernel (AVX2/AVX512, every contiguous tensor) maps
  every NaN to ``0xFFFF``; the scalar CPU path (strided or 0-d tensors, or
  ``ATEN_CPU_CAPABILITY=default``) maps every NaN to ``0x7FC0``; CUDA on sm_80+ uses
  ``cvt.rn.bf16.f32``, which returns a canonical NaN (``0x7FFF`` per the PTX ISA; not
  measured here). We use ``0xFFFF``, the answer of the common CPU path.
- F32 -> F16: the vectorised CPU kernel (F16C ``vcvtps2ph``) keeps the sign and the
  top ten payload bits and sets the quiet bit; the scalar CPU path returns
  ``sign | 0x7E00``; CUDA's ``cvt.rn.f16.f32`` returns a canonical NaN. We use the
  F16C answer, ``sign | 0x7E00 | (payload >> 13)``.

Either way a NaN stays a NaN. The choice only has to be the same on every Bulletin
node, and it is: the trainer casts with this function or its CUDA twin, never with
whatever ``torch`` path happens to run.
"""

from __future__ import annotations

from typing import Final, Literal

import numpy as np
from numpy.typing import NDArray

from patcher import native
from patcher.dtypes import bits_dtype, dtype_width
from patcher.errors import InvalidInput, UnsupportedDtype

__all__ = [
    "BF16_NAN",
    "CAST_CHUNK_ELEMENTS",
    "CastKind",
    "cast_bits",
    "cast_kind",
    "f32_to_bf16",
    "f32_to_f16",
]

CastKind = Literal["identity", "f32_bf16", "f32_f16"]

#: The bits every F32 NaN becomes in BF16 (torch's vectorised CPU answer).
BF16_NAN: Final = 0xFFFF

#: Elements converted per step: bounds the uint32 temporaries to a few MiB.
CAST_CHUNK_ELEMENTS: Final = 1 << 20

_CASTS: Final[dict[tuple[str, str], CastKind]] = {
    ("F32", "BF16"): "f32_bf16",
    ("F32", "F16"): "f32_f16",
}

_U32 = np.uint32


def cast_kind(source: str, target: str) -> CastKind:
    """Which exact cast turns ``source`` bits into ``target`` bits; raises ``UnsupportedDtype``."""
    dtype_width(source)
    dtype_width(target)
    if source == target:
        return "identity"
    try:
        return _CASTS[(source, target)]
    except KeyError:
        raise UnsupportedDtype(
            f"no exact cast from {source} to {target}; supported: identity, "
            + ", ".join(f"{s} -> {t}" for s, t in _CASTS)
        ) from None


def f32_to_bf16(x: NDArray[np.uint32], out: NDArray[np.uint16]) -> NDArray[np.uint16]:
    """Round F32 bits to BF16 bits (nearest, ties to even; NaN -> ``BF16_NAN``) into ``out``.

    ``x`` and ``out`` are 1-d and of equal length. Temporaries are the size of ``x``;
    :func:`cast_bits` calls this chunk by chunk.
    """
    # Adding 0x7FFF plus the lowest kept bit rounds to nearest-even in one step: a tie
    # carries only when the kept part is odd. Finite maxima carry into the exponent and
    # become infinity, as IEEE requires. No non-NaN input overflows 32 bits.
    r = x + _U32(0x7FFF)
    r += (x >> _U32(16)) & _U32(1)
    r >>= _U32(16)
    r[(x & _U32(0x7FFFFFFF)) > _U32(0x7F800000)] = BF16_NAN
    out[...] = r
    return out


def f32_to_f16(x: NDArray[np.uint32], out: NDArray[np.uint16]) -> NDArray[np.uint16]:
    """Round F32 bits to F16 bits (nearest, ties to even, subnormals kept) into ``out``.

    NaNs keep their sign and top ten payload bits and become quiet, as F16C does.
    """
    a = x & _U32(0x7FFFFFFF)
    with np.errstate(over="ignore"):
        # Normal results: rebias the exponent (127 -> 15) and round off 13 bits; a carry
        # out of the mantissa correctly bumps the exponent.
        r = a - _U32(0x38000000)
        h = r + _U32(0xFFF)
        h += (r >> _U32(13)) & _U32(1)
        h >>= _U32(13)
        # Subnormal results (|x| < 2**-14): the value in units of 2**-24 is the full
        # significand shifted right by 126 - exponent, rounded to nearest-even.
        e = a >> _U32(23)
        shift = np.clip(_U32(126) - e, 14, 24).astype(_U32)
        m = (a & _U32(0x7FFFFF)) | _U32(0x800000)
        sub = m + (_U32(1) << (shift - _U32(1))) - _U32(1)
        sub += (m >> shift) & _U32(1)
        sub >>= shift
    h = np.where(a >= _U32(0x38800000), h, np.where(e >= _U32(102), sub, _U32(0)))
    h[a >= _U32(0x477FF000)] = 0x7C00  # rounds past 65504: infinity (and infinity itself)
    nan = a > _U32(0x7F800000)
    h[nan] = _U32(0x7E00) | ((a[nan] >> _U32(13)) & _U32(0x3FF))
    h |= (x >> _U32(16)) & _U32(0x8000)
    out[...] = h
    return out


def cast_bits(
    bits: NDArray[np.unsignedinteger],
    source: str,
    target: str,
    *,
    out: NDArray[np.unsignedinteger] | None = None,
) -> NDArray[np.unsignedinteger]:
    """Cast the bits of a ``source`` tensor to ``target`` bits, exactly (see module doc).

    ``bits`` holds ``source`` bits (its unsigned bits dtype, any shape, C-contiguous);
    the result has the same shape and ``target``'s bits dtype. An identity cast returns
    a copy (or fills ``out``). ``out``, if given, must be C-contiguous, of the target's
    bits dtype and of the same shape; it is filled and returned.
    """
    kind = cast_kind(source, target)
    src_dtype, dst_dtype = bits_dtype(source), bits_dtype(target)
    if not isinstance(bits, np.ndarray) or bits.dtype != src_dtype:
        raise InvalidInput(f"cast from {source} needs a {src_dtype} bits array")
    if not bits.flags.c_contiguous:
        raise InvalidInput("cast needs a C-contiguous array")
    if out is None:
        out = np.empty(bits.shape, dtype=dst_dtype)
    elif (
        not isinstance(out, np.ndarray)
        or out.dtype != dst_dtype
        or out.shape != bits.shape
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise InvalidInput(f"out must be a writable C-contiguous {dst_dtype} array of shape {bits.shape}")
    src, dst = bits.reshape(-1), out.reshape(-1)
    if kind == "identity":
        dst[...] = src
        return out
    if native.active():  # one pass, no temporaries; the same bits (tests/kernels/test_cast.py)
        native.speedups.cast(src.view(np.uint32), dst.view(np.uint16), 0 if kind == "f32_bf16" else 1)
        return out
    convert = f32_to_bf16 if kind == "f32_bf16" else f32_to_f16
    for start in range(0, src.size, CAST_CHUNK_ELEMENTS):
        stop = start + CAST_CHUNK_ELEMENTS
        convert(src[start:stop].view(np.uint32), dst[start:stop].view(np.uint16))
    return out
