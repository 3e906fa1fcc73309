"""Types shared by the two backends, so that their signatures are literally the same.

An array argument is a NumPy array for :mod:`kernels.numpy_twin` and a CuPy array for
:mod:`kernels.cuda`. CuPy ships no type information, so to a type checker a CuPy array
is ``Any`` and these aliases read as "a NumPy array, or a CuPy one".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    import cupy

__all__ = ["BitsArray", "IndexArray", "IntArray"]

#: Bits of a tensor: an unsigned integer array of the element width (see ``as_bits``).
BitsArray: TypeAlias = "NDArray[np.unsignedinteger[Any]] | cupy.ndarray"
#: Flat element indices: a 1-d int64 array.
IndexArray: TypeAlias = "NDArray[np.int64] | cupy.ndarray"
#: A 1-d array of any integer dtype (decoded index gaps).
IntArray: TypeAlias = "NDArray[np.integer[Any]] | cupy.ndarray"
