"""Types shared by the two backends, so that their signatures are literally the same.

An array argument is a NumPy array for :mod:`bulletin_kernels.numpy_twin` and a CuPy array for
:mod:`bulletin_kernels.cuda`. CuPy ships no type information, so to a type checker a CuPy array
is ``Any`` and these aliases read as "a NumPy array, or a CuPy one".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    import cupy

__all__ = ["BitsArray", "ClassArray", "ClassWindowLike", "IndexArray", "IntArray"]

#: Bits of a tensor: an unsigned integer array of the element width (see ``as_bits``).
BitsArray: TypeAlias = "NDArray[np.unsignedinteger[Any]] | cupy.ndarray"
#: Flat element indices: a 1-d int64 array.
IndexArray: TypeAlias = "NDArray[np.int64] | cupy.ndarray"
#: A 1-d array of any integer dtype (decoded index gaps).
IntArray: TypeAlias = "NDArray[np.integer[Any]] | cupy.ndarray"
#: Exponent classes of the context codec: a 1-d uint8 array.
ClassArray: TypeAlias = "NDArray[np.uint8] | cupy.ndarray"


class ClassWindowLike(Protocol):
    """The window of exponent classes (``patcher.context.ClassWindow``): classes are
    ``clip(exponent - lo, 0, classes - 1)``."""

    @property
    def lo(self) -> int: ...

    @property
    def classes(self) -> int: ...
