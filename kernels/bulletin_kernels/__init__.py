"""CuPy raw kernels and their NumPy twins (same signatures, same bits).

``backend_for(x)`` picks :mod:`bulletin_kernels.numpy_twin` (NumPy arrays, CPU torch tensors) or
:mod:`bulletin_kernels.cuda` (CuPy arrays, CUDA torch tensors); ``as_bits(x)`` takes the zero-copy
unsigned view of a tensor that both backends work on. Importing this package imports
neither CuPy nor torch.
"""

from bulletin_kernels.dispatch import Backend, as_bits, backend_for, dtype_name
from bulletin_kernels.types import BitsArray, IndexArray, IntArray

__all__ = [
    "Backend",
    "BitsArray",
    "IndexArray",
    "IntArray",
    "as_bits",
    "backend_for",
    "dtype_name",
]
