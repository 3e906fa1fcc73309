"""Dtypes Bulletin carries, named as safetensors names them.

Bulletin never does arithmetic on values: every tensor is handled as an array of
unsigned integers of the same width ("bits"), so NaN payloads, -0.0 and Inf
survive exactly and the codec is the same for every dtype of a given width.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from patcher.errors import UnsupportedDtype

__all__ = ["BITS_DTYPES", "DTYPE_WIDTHS", "FLOAT_DTYPES", "SERVED_FLOAT_DTYPES", "bits_dtype", "dtype_width"]

#: safetensors dtype name -> element width in bytes.
DTYPE_WIDTHS: Final[dict[str, int]] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}

#: Dtypes a trainer may ask floating-point weights to be served in (patcher.cast casts
#: F32 to each; any dtype is served as itself).
SERVED_FLOAT_DTYPES: Final = ("BF16", "F16", "F32")
#: Floating-point dtypes a trainer's weights are cast from to the served dtype.
FLOAT_DTYPES: Final = frozenset({*SERVED_FLOAT_DTYPES, "F64"})

#: element width in bytes -> the unsigned NumPy dtype that holds its bits.
BITS_DTYPES: Final[dict[int, np.dtype[np.unsignedinteger]]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}


def dtype_width(dtype: str) -> int:
    """Element width in bytes of a safetensors dtype name; raises ``UnsupportedDtype``."""
    try:
        return DTYPE_WIDTHS[dtype]
    except (KeyError, TypeError):
        raise UnsupportedDtype(f"unsupported dtype {dtype!r}; known: {', '.join(sorted(DTYPE_WIDTHS))}") from None


def bits_dtype(dtype: str) -> np.dtype[np.unsignedinteger]:
    """The unsigned NumPy dtype that holds the bits of ``dtype``."""
    return BITS_DTYPES[dtype_width(dtype)]
