"""Turning a trainer's state dict into the bits Bulletin serves.

Floating-point tensors are cast to the served dtype exactly as torch rounds
(``tensor.to(torch.bfloat16)``: round to nearest even); other tensors keep their
dtype. The result is a private copy: the training loop may change its tensors as
soon as :func:`snapshot` returns. Tensors that share storage (tied embeddings)
are served once, under the name that sorts first, as safetensors' ``save_model``
does; :func:`aliases` reports the dropped names so engines can map them back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from bulletin.device_kept import DeviceKept, on_gpu
from bulletin.engines.torch_module import torch_dtype
from bulletin.errors import InvalidInput, UnsupportedDtype
from kernels.dispatch import as_bits, dtype_name
from patcher.cast import cast_bits
from patcher.dtypes import FLOAT_DTYPES, SERVED_FLOAT_DTYPES
from patcher.names import check_tensor_name
from patcher.patch import HostChange, TensorSpec

__all__ = ["Snapshot", "cast_served", "snapshot"]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One version as the publisher needs it.

    Every tensor has a spec and either private host bits (``bits``) or, for GPU tensors
    diffed on their device, the change found there (``changes``). ``old_bits`` holds the
    previous bits of a tensor that left the GPU, which the host no longer had.
    """

    specs: dict[str, TensorSpec]
    bits: dict[str, NDArray[np.unsignedinteger]]
    aliases: dict[str, str]  # dropped name -> served name
    changes: dict[str, HostChange] = field(default_factory=dict)
    old_bits: dict[str, NDArray[np.unsignedinteger]] = field(default_factory=dict)


def _torch_bits(value: Any, served: str) -> tuple[str, NDArray[np.unsignedinteger]]:
    t = value.detach()
    name = dtype_name(t)
    if name in FLOAT_DTYPES and name != served:
        t = t.to(torch_dtype(served))  # torch's own rounding, on the tensor's device
        name = served
    host = as_bits(t.contiguous().cpu())
    # The view shares memory with the tensor; copy so the trainer cannot change what we hold.
    return name, np.array(host, copy=True)


def _numpy_bits(value: NDArray[Any], served: str) -> tuple[str, NDArray[np.unsignedinteger]]:
    name = dtype_name(value)
    array = np.ascontiguousarray(value)
    if name in FLOAT_DTYPES and name != served:
        if name != "F32":
            raise UnsupportedDtype(f"NumPy {value.dtype} arrays cannot be cast to {served}: pass float32")
        return served, cast_bits(array.view(np.uint32), "F32", served)
    return name, np.array(as_bits(array), copy=True)


def cast_served(bits: NDArray[np.unsignedinteger], dtype: str, served: str) -> tuple[str, NDArray[np.unsignedinteger]]:
    """A private copy of one tensor's bits (of safetensors dtype ``dtype``) as
    :func:`snapshot` serves them: a floating tensor cast to ``served`` exactly as a state
    dict's would be (F32 by :func:`patcher.cast.cast_bits`, the twin of torch's rounding;
    other floating dtypes by torch itself, ``Tensor.to``), anything else as it is.
    Returns the served dtype name and the bits. Casting from BF16, F16 or F64 needs
    torch (``UnsupportedDtype`` without it)."""
    if served not in SERVED_FLOAT_DTYPES:
        raise UnsupportedDtype(f"served dtype must be one of {', '.join(SERVED_FLOAT_DTYPES)}, not {served!r}")
    if dtype not in FLOAT_DTYPES or dtype == served:
        return dtype, np.array(bits, copy=True)
    if dtype == "F32":
        return served, cast_bits(np.ascontiguousarray(bits).view(np.uint32), "F32", served)
    try:
        import torch
    except ImportError:
        raise UnsupportedDtype(
            f"casting {dtype} tensors to {served} needs torch (pip install torch), which rounds them as a "
            "trainer's state dict is rounded; or serve them as they are"
        ) from None
    signed = np.ascontiguousarray(bits).view(f"<i{bits.dtype.itemsize}")  # torch has no unsigned 16/32/64 views
    cast = torch.from_numpy(signed).view(torch_dtype(dtype)).to(torch_dtype(served))
    return served, np.array(as_bits(cast), copy=True)


def _storage_key(value: Any) -> tuple[Any, ...] | None:
    """Identity of the memory a tensor views, to find tied weights."""
    if type(value).__module__.startswith("torch"):
        try:
            ptr = value.untyped_storage().data_ptr()
        except RuntimeError:  # tensors without storage (meta, sparse) have no aliases
            return None
        return (str(value.device), ptr, value.storage_offset(), tuple(value.shape), tuple(value.stride()))
    if isinstance(value, np.ndarray):
        return ("numpy", value.__array_interface__["data"][0], value.shape, value.strides, value.dtype.str)
    return None


def snapshot(
    state_dict: Mapping[str, Any], *, dtype: str = "BF16", device: DeviceKept | None = None, full: bool = True
) -> Snapshot:
    """Cast and copy a state dict (torch tensors on any device, NumPy or CuPy arrays).

    With ``device``, GPU tensors take the GPU path: unless ``full`` (a keyframe is due),
    a tensor whose bits are kept on its device is diffed there and only the change comes
    back; otherwise its served bits are copied to the host and kept on the device from
    now on.
    """
    if dtype not in SERVED_FLOAT_DTYPES:
        raise UnsupportedDtype(f"served dtype must be one of {', '.join(SERVED_FLOAT_DTYPES)}, not {dtype!r}")
    if not isinstance(state_dict, Mapping) or not state_dict:
        raise InvalidInput("state_dict must be a non-empty mapping of tensor names to tensors")
    specs: dict[str, TensorSpec] = {}
    bits: dict[str, NDArray[np.unsignedinteger]] = {}
    aliases: dict[str, str] = {}
    changes: dict[str, HostChange] = {}
    old_bits: dict[str, NDArray[np.unsignedinteger]] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name in sorted(state_dict):
        check_tensor_name(name)
        value = state_dict[name]
        key = _storage_key(value)
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        module = type(value).__module__
        if device is not None and on_gpu(value):
            specs[name] = device.spec(name, value)[0]
            change = None if full else device.diff(name, value)
            if change is not None:
                changes[name] = change
            else:
                if name in device:  # the device holds the previous bits, the host does not
                    old_bits[name] = device.host_bits(name)
                bits[name] = device.keep(name, value)
            if key is not None:
                seen[key] = name
            continue
        if device is not None and name in device:  # left the GPU: the host lacks its old bits
            old_bits[name] = device.host_bits(name)
            device.drop(name)
        if module.startswith("torch"):
            served_name, array = _torch_bits(value, dtype)
        elif module.startswith("cupy"):
            served_name, array = _numpy_bits(value.get(), dtype)
        elif isinstance(value, np.ndarray | np.generic):
            served_name, array = _numpy_bits(np.asarray(value), dtype)
        else:
            raise InvalidInput(f"{name}: expected a torch tensor, NumPy or CuPy array, got {type(value).__name__}")
        if key is not None:
            seen[key] = name
        specs[name] = TensorSpec(name, served_name, tuple(int(d) for d in array.shape))
        bits[name] = array
    return Snapshot(specs, bits, aliases, changes, old_bits)
