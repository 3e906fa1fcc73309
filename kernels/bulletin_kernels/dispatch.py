"""Pick the backend for an array, and take zero-copy bits views of tensors.

``backend_for(x)`` returns :mod:`bulletin_kernels.numpy_twin` for NumPy arrays and CPU torch
tensors and :mod:`bulletin_kernels.cuda` for CuPy arrays and CUDA torch tensors. ``as_bits(x)``
returns the array the backends work on: the same memory, read as unsigned integers of
the element width. Neither imports torch or CuPy: an object can only be a torch tensor
or a CuPy array if its module is already loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final, Protocol, cast

import numpy as np

from bulletin_kernels.types import BitsArray, ClassArray, ClassWindowLike, IndexArray, IntArray
from patcher.dtypes import BITS_DTYPES
from patcher.errors import InvalidInput, UnsupportedDtype
from patcher.patch import Change, Patch

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPE_NAMES", "Backend", "as_bits", "backend_for", "dtype_name", "torch_reading"]


class Backend(Protocol):
    """What both :mod:`bulletin_kernels.numpy_twin` and :mod:`bulletin_kernels.cuda` provide."""

    def cast(self, current: BitsArray, current_dtype: str, served_dtype: str) -> BitsArray: ...

    def diff_cast(
        self, current: BitsArray, kept: BitsArray, *, current_dtype: str, served_dtype: str
    ) -> Change[IndexArray, BitsArray]: ...

    def decode_gaps(self, gaps: IntArray, start: int = 0) -> IndexArray: ...

    def apply_delta(self, bits: BitsArray, indices: IndexArray, delta: BitsArray) -> int: ...

    def fingerprint(self, bits: BitsArray) -> int: ...

    def apply(
        self, patch: Patch, tensors: Mapping[str, BitsArray], fingerprints: Mapping[str, int]
    ) -> dict[str, int]: ...

    def apply_ranks(
        self,
        bits: BitsArray,
        dtype: str,
        window: ClassWindowLike,
        start: int,
        stop: int,
        classes: ClassArray,
        ranks: IndexArray,
        delta: BitsArray,
    ) -> int: ...

    def select_ranks(
        self,
        base: BitsArray,
        dtype: str,
        window: ClassWindowLike,
        start: int,
        stop: int,
        classes: ClassArray,
        ranks: IndexArray,
    ) -> IndexArray: ...


#: torch / NumPy / CuPy dtype name (``torch.`` prefix removed) -> safetensors name.
#: NumPy's bfloat16 and float8 names are ml_dtypes' (the same as torch's).
DTYPE_NAMES: Final = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "uint16": "U16",
    "int16": "I16",
    "float16": "F16",
    "bfloat16": "BF16",
    "uint32": "U32",
    "int32": "I32",
    "float32": "F32",
    "uint64": "U64",
    "int64": "I64",
    "float64": "F64",
}


def _loaded(module: str) -> Any:
    return sys.modules.get(module)


def _is_torch_tensor(x: object) -> bool:
    torch = _loaded("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_cupy_array(x: object) -> bool:
    cupy = _loaded("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def backend_for(array: object) -> Backend:
    """The backend that works on ``array`` (a NumPy/CuPy array or a torch tensor)."""
    if isinstance(array, np.ndarray):
        from bulletin_kernels import numpy_twin

        return cast(Backend, numpy_twin)
    if _is_cupy_array(array):
        return _cuda()
    if _is_torch_tensor(array):
        device = array.device.type  # type: ignore[attr-defined]
        if device == "cpu":
            from bulletin_kernels import numpy_twin

            return cast(Backend, numpy_twin)
        if device == "cuda":
            return _cuda()
        raise InvalidInput(f"no Bulletin backend for torch tensors on {device!r}")
    raise InvalidInput(f"no Bulletin backend for {type(array).__name__}")


def _cuda() -> Backend:
    from bulletin_kernels import cuda

    module: ModuleType = cuda
    return cast(Backend, module)


def dtype_name(array: object) -> str:
    """The safetensors dtype name of a torch tensor or a NumPy/CuPy array.

    NumPy and CuPy have no bfloat16, so their 2-byte unsigned arrays read as ``U16``:
    pass the dtype explicitly when the array holds bits of another type.
    """
    if not (isinstance(array, np.ndarray) or _is_torch_tensor(array) or _is_cupy_array(array)):
        raise InvalidInput(f"not a tensor or array: {type(array).__name__}")
    dtype = array.dtype  # type: ignore[attr-defined]
    # str() of a NumPy dtype costs microseconds, and a publish asks once or twice per tensor.
    known = _NAMES_BY_DTYPE.get(dtype)
    if known is not None:
        return known
    name = str(dtype).removeprefix("torch.")
    try:
        found = DTYPE_NAMES[name]
    except KeyError:
        raise UnsupportedDtype(f"dtype {name} cannot be carried bit-exactly") from None
    _NAMES_BY_DTYPE[dtype] = found
    return found


#: dtype objects (NumPy's, torch's, CuPy's) already named: a few dozen at most.
_NAMES_BY_DTYPE: dict[object, str] = {}


def _torch_bits(tensor: torch.Tensor) -> BitsArray:
    import torch

    dtype_name(tensor)  # refuses complex, quantized and the other dtypes we do not carry
    if not tensor.is_contiguous():
        raise InvalidInput("tensor must be contiguous (a bits view never copies)")
    width = tensor.element_size()
    unsigned = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}[width]
    # detach() shares storage; it only drops autograd, which refuses numpy()/DLPack.
    view = tensor.detach().view(unsigned)
    device = tensor.device.type
    if device == "cpu":
        return view.numpy()
    if device == "cuda":
        try:
            import cupy
        except ImportError as exc:
            raise InvalidInput("bits views of CUDA tensors need CuPy") from exc
        return cupy.from_dlpack(view)
    raise InvalidInput(f"no bits view for torch tensors on {device!r}")


def torch_reading(array: np.ndarray[Any, Any]) -> torch.Tensor:
    """A CPU torch tensor viewing ``array`` (no copy) for torch to read: to send, copy or
    cast. A read-only array (a memory map of a checkpoint or a cache) is viewed too,
    without torch's warning, which is about writes through such a view."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        return torch.from_numpy(array)


def as_bits(tensor: object) -> BitsArray:
    """A zero-copy view of ``tensor``'s bits: same memory, same shape, unsigned dtype of
    the element width (uint16 for BF16/F16, uint32 for F32, ...).

    Accepts torch tensors on the CPU (a NumPy view) or on CUDA (a CuPy view through
    DLPack, ordered after the work queued on torch's current stream at this call), and
    NumPy or CuPy arrays. Never copies: a non-contiguous input is ``InvalidInput``.
    Writes through the view change the tensor; that is how patches are applied in place.
    """
    if _is_torch_tensor(tensor):
        return _torch_bits(cast("torch.Tensor", tensor))
    if isinstance(tensor, np.ndarray) or _is_cupy_array(tensor):
        array: Any = tensor
        dtype_name(array)
        if not array.flags.c_contiguous:
            raise InvalidInput("array must be C-contiguous (a bits view never copies)")
        return array.view(BITS_DTYPES[array.dtype.itemsize])
    raise InvalidInput(f"not a tensor or array: {type(tensor).__name__}")
