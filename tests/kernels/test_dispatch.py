"""backend_for / as_bits / dtype_name on NumPy arrays and CPU torch tensors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from numpy.typing import NDArray

import bulletin_kernels
from bulletin.errors import InvalidInput, UnsupportedDtype
from bulletin_kernels import numpy_twin

TORCH_DTYPES = [
    (torch.bool, "BOOL", np.uint8),
    (torch.uint8, "U8", np.uint8),
    (torch.int8, "I8", np.uint8),
    (torch.float8_e4m3fn, "F8_E4M3", np.uint8),
    (torch.float8_e5m2, "F8_E5M2", np.uint8),
    (torch.int16, "I16", np.uint16),
    (torch.uint16, "U16", np.uint16),
    (torch.float16, "F16", np.uint16),
    (torch.bfloat16, "BF16", np.uint16),
    (torch.int32, "I32", np.uint32),
    (torch.uint32, "U32", np.uint32),
    (torch.float32, "F32", np.uint32),
    (torch.int64, "I64", np.uint64),
    (torch.uint64, "U64", np.uint64),
    (torch.float64, "F64", np.uint64),
]


@pytest.mark.parametrize("dtype,name,bits", TORCH_DTYPES)
def test_torch_cpu_bits_are_zero_copy_views(dtype: torch.dtype, name: str, bits: type) -> None:
    tensor = torch.zeros((3, 5), dtype=dtype)
    view = bulletin_kernels.as_bits(tensor)
    assert isinstance(view, np.ndarray)
    assert view.dtype == bits and view.shape == (3, 5)
    assert bulletin_kernels.dtype_name(tensor) == name
    assert view.ctypes.data == tensor.data_ptr()
    view[1, 2] = 1  # writes land in the tensor: how patches are applied in place
    assert tensor.view(torch.uint8).reshape(-1).nonzero().numel() == 1
    assert bulletin_kernels.backend_for(tensor) is numpy_twin


def test_torch_bits_of_parameters_and_offset_views() -> None:
    weight = torch.nn.Parameter(torch.ones(4, 8, dtype=torch.bfloat16))  # requires grad
    row = weight[1]  # a view at a storage offset, still tracked by autograd
    bits = bulletin_kernels.as_bits(row)
    assert bits.ctypes.data == row.data_ptr() and bits[0] == 0x3F80
    bits[3] = 0x4000  # 2.0
    assert float(weight.detach()[1, 3]) == 2.0
    assert bulletin_kernels.as_bits(weight).shape == (4, 8)


def test_bf16_torch_round_trip_through_the_twin() -> None:
    # Cast FP32 masters with the twin into a BF16 tensor's own memory: torch sees the cast.
    master = torch.randn(1000)
    served = torch.zeros(1000, dtype=torch.bfloat16)
    twin = bulletin_kernels.backend_for(served)
    result = twin.diff_cast(
        bulletin_kernels.as_bits(master), bulletin_kernels.as_bits(served), current_dtype="F32", served_dtype="BF16"
    )
    assert torch.equal(served, master.to(torch.bfloat16))
    assert result.indices.size == int((master.to(torch.bfloat16) != 0).sum())


def test_numpy_bits() -> None:
    for dtype, bits in [(np.float32, np.uint32), (np.int8, np.uint8), (np.bool_, np.uint8), (np.float64, np.uint64)]:
        array: NDArray[Any] = np.zeros(6, dtype=dtype)
        view = bulletin_kernels.as_bits(array)
        assert view.dtype == bits and np.shares_memory(view, array)
    assert bulletin_kernels.dtype_name(np.zeros(2, dtype=np.float16)) == "F16"
    assert bulletin_kernels.dtype_name(np.zeros(2, dtype=np.uint16)) == "U16"  # NumPy has no bfloat16
    assert bulletin_kernels.backend_for(np.zeros(2)) is numpy_twin


@pytest.mark.parametrize(
    "value",
    [
        torch.zeros(4, 4)[:, 1],
        torch.zeros(4, 4).t(),
        np.zeros((4, 4))[:, 1],
    ],
)
def test_non_contiguous_is_refused(value: Any) -> None:
    with pytest.raises(InvalidInput, match="contiguous"):
        bulletin_kernels.as_bits(value)


@pytest.mark.parametrize("value", [torch.zeros(2, dtype=torch.complex64), np.zeros(2, dtype=np.complex64)])
def test_unsupported_dtypes(value: Any) -> None:
    with pytest.raises(UnsupportedDtype):
        bulletin_kernels.as_bits(value)
    with pytest.raises(UnsupportedDtype):
        bulletin_kernels.dtype_name(value)


@pytest.mark.parametrize("value", [[1, 2], 3.0, "x", memoryview(b"ab"), torch.zeros(2, device="meta")])
def test_not_arrays(value: object) -> None:
    with pytest.raises(InvalidInput):
        bulletin_kernels.as_bits(value)
    with pytest.raises(InvalidInput):
        bulletin_kernels.backend_for(value)
