"""Turning a trainer's state dict into the bits Bulletin serves, without copying more than once.

Floating-point tensors are cast to the served dtype exactly as torch rounds
(``tensor.to(torch.bfloat16)``: round to nearest even); other tensors keep their
dtype. Tensors that share storage (tied embeddings) are served once, under the name
that sorts first, as safetensors' ``save_model`` does; :class:`Snapshot` reports the
dropped names so engines can map them back.

A :class:`Snapshot` is taken in two passes: the layout first (every name, type and dtype
checked, nothing read), so that bad input is refused before anything is diffed; then
each tensor's source or change. Without ``copy`` (``publish``, a checkpoint's memory
maps: nothing changes them before the publish ends) a host tensor's bits are read when
the publisher reaches it, a zero-copy view, or its cast then. With ``copy``
(``publish_async``: the caller may change its tensors as soon as the snapshot is taken)
a host tensor of a patch version is read now (a view, or its cast: one tensor at a
time) and diffed against the base of the next diff
(:meth:`~bulletin.base.PublishedBase.diff_next`), and only the change is kept; a
keyframe's (the first version, a new layout, every ``keyframe_every``-th) is copied
once, by its cast or, already in the served dtype, by a plain copy, since it is stored
whole. A GPU tensor whose served bits the device keeps is diffed there now and only the
change comes back.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from bulletin.device_kept import on_gpu
from bulletin.engines.torch_module import torch_dtype
from bulletin.errors import InternalError, InvalidInput, UnsupportedDtype
from bulletin_kernels.dispatch import as_bits, dtype_name, torch_reading
from patcher.cast import cast_bits
from patcher.dtypes import FLOAT_DTYPES, SERVED_FLOAT_DTYPES
from patcher.names import check_tensor_name
from patcher.patch import TensorDelta, TensorSpec

if TYPE_CHECKING:
    from bulletin.base import PublishedBase

__all__ = ["ServedBits", "Snapshot", "TensorBits", "cast_served", "layout", "read_served", "snapshot", "take_snapshot"]

Bits = NDArray[np.unsignedinteger]
#: A tensor's served bits, produced when called (a view, a cast, or the copy taken).
Source = Callable[[], Bits]


@dataclass(slots=True)
class TensorBits:
    """Each tensor's bits for a publish, taken once (the holder then lets go of them):
    ``copies`` taken with the snapshot, ``reads`` read in place when taken (the tensor,
    its dtype and its served dtype: plain tuples rather than closures, since each object
    a publish holds is one more for the interpreter's collector to trace), ``later``
    made when taken (a GPU tensor's host copy, a checkpoint's tensor)."""

    copies: dict[str, Bits] = field(default_factory=dict)
    reads: dict[str, tuple[Any, str, str]] = field(default_factory=dict)
    later: dict[str, Source] = field(default_factory=dict)

    def take(self, name: str) -> Bits:
        """The served bits of ``name``: a view, its cast, or the copy taken."""
        bits = self.copies.pop(name, None)
        if bits is not None:
            return bits
        read = self.reads.pop(name, None)
        if read is not None:
            return read_served(*read, False)
        try:
            return self.later.pop(name)()
        except KeyError:
            raise InternalError(f"{name}: taken twice, or diffed when the snapshot was taken") from None

    def source(self, name: str, served: str) -> tuple[Bits, str]:
        """The bits of ``name`` (served as ``served``) to diff, and their dtype: a tensor
        read in place whose served bits are a cast of F32 as its F32 bits, for the diff
        to cast (:func:`~bulletin.blocks.block_diff`: no cast copy), else its served bits."""
        read = self.reads.get(name)
        if read is None or read[1] != "F32" or read[2] == "F32":
            return self.take(name), served
        del self.reads[name]
        value, source, _ = read
        return read_served(value, source, source, False), source


@dataclass(slots=True)
class Snapshot:
    """One version as the publisher needs it: every tensor's served spec, and either its
    host bits to take (``bits``) or its change from the snapshot before, found when the
    snapshot was taken (``changes``: on its device, or for ``publish_async`` on the
    host)."""

    version: int
    specs: dict[str, TensorSpec]
    aliases: dict[str, str]  # dropped name -> served name
    bits: TensorBits = field(default_factory=TensorBits)
    changes: dict[str, TensorDelta] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ServedBits:
    """A state dict's served bits, private copies (:func:`snapshot`)."""

    specs: dict[str, TensorSpec]
    bits: dict[str, Bits]
    aliases: dict[str, str]  # dropped name -> served name


@dataclass(frozen=True, slots=True)
class Layout:
    """What a state dict serves, found without reading any tensor's data."""

    specs: dict[str, TensorSpec]
    aliases: dict[str, str]
    values: dict[str, Any]  # served name -> the caller's tensor
    source_dtypes: dict[str, str]


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


def _kind(value: Any) -> str:
    module = type(value).__module__
    if module.startswith("torch") and hasattr(value, "detach"):
        return "torch"
    if module.startswith("cupy"):
        return "cupy"
    if isinstance(value, np.ndarray | np.generic):
        return "numpy"
    return ""


def layout(state_dict: Mapping[str, Any], dtype: str) -> Layout:
    """The served layout of ``state_dict``: every name, type and dtype checked (``InvalidInput``,
    ``UnsupportedDtype``), tied tensors found; no tensor's data is read."""
    if dtype not in SERVED_FLOAT_DTYPES:
        raise UnsupportedDtype(f"served dtype must be one of {', '.join(SERVED_FLOAT_DTYPES)}, not {dtype!r}")
    if not isinstance(state_dict, Mapping) or not state_dict:
        raise InvalidInput("state_dict must be a non-empty mapping of tensor names to tensors")
    specs: dict[str, TensorSpec] = {}
    aliases: dict[str, str] = {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name in sorted(state_dict):
        check_tensor_name(name)
        value = state_dict[name]
        key = _storage_key(value)
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        kind = _kind(value)
        if not kind:
            raise InvalidInput(f"{name}: expected a torch tensor, NumPy or CuPy array, got {type(value).__name__}")
        if kind == "numpy" and not isinstance(value, np.ndarray):
            value = np.asarray(value)  # a NumPy scalar; an array (a memmap, ...) stays what it is
        source = dtype_name(value)
        served = source
        if source in FLOAT_DTYPES and source != dtype:
            if kind != "torch" and source != "F32" and not on_gpu(value):
                raise UnsupportedDtype(f"NumPy {value.dtype} arrays cannot be cast to {dtype}: pass float32")
            served = dtype
        if key is not None:
            seen[key] = name
        specs[name] = TensorSpec(name, served, tuple(int(d) for d in value.shape))
        values[name] = value
        sources[name] = source
    return Layout(specs, aliases, values, sources)


def _torch_bits(value: Any, served: str, copy: bool) -> Bits:
    t = value.detach()
    private = False
    if dtype_name(t) in FLOAT_DTYPES and dtype_name(t) != served:
        t = t.to(torch_dtype(served))  # torch's own rounding, on the tensor's device: the one copy
        private = True
    if not t.is_contiguous():
        t, private = t.contiguous(), True
    if t.device.type != "cpu":
        t, private = t.cpu(), True
    bits = as_bits(t)
    # A view shares memory with the caller's tensor: copy it once where they may change it.
    return np.array(bits, copy=True) if copy and not private else bits


def _numpy_bits(value: NDArray[Any], source: str, served: str, copy: bool) -> Bits:
    # np.ascontiguousarray makes 0-d arrays 1-d: keep the caller's shape.
    array = value if value.flags.c_contiguous else np.ascontiguousarray(value).reshape(value.shape)
    if source != served:
        return cast_bits(array.view(np.uint32), "F32", served)
    bits = as_bits(array)
    # A view shares memory with the caller's array: copy it once where they may change it.
    return np.array(bits, copy=True) if copy and array is value else bits


def read_served(value: Any, source: str, served: str, copy: bool) -> Bits:
    """The served bits of one host tensor of a :func:`layout` (its ``source_dtypes``
    entry and served dtype), read now: a private copy with ``copy``, else a view of the
    caller's memory where no cast is needed. The sharded publisher reads its blocks so."""
    kind = _kind(value)
    if kind == "torch":
        return _torch_bits(value, served, copy)
    if kind == "cupy":
        return _numpy_bits(value.get(), source, served, False)  # .get() is a private copy
    return _numpy_bits(value, source, served, copy)


def cast_served(bits: Bits, dtype: str, served: str) -> tuple[str, Bits]:
    """One tensor's bits (of safetensors dtype ``dtype``) as :func:`snapshot` serves them:
    a floating tensor cast to ``served`` exactly as a state dict's would be (F32 by
    :func:`patcher.cast.cast_bits`, the twin of torch's rounding; other floating dtypes
    by torch itself, ``Tensor.to``), a new array; anything else as it is (``bits``
    itself, not a copy). Returns the served dtype name and the bits. Casting from BF16,
    F16 or F64 needs torch (``UnsupportedDtype`` without it)."""
    if served not in SERVED_FLOAT_DTYPES:
        raise UnsupportedDtype(f"served dtype must be one of {', '.join(SERVED_FLOAT_DTYPES)}, not {served!r}")
    if dtype not in FLOAT_DTYPES or dtype == served:
        return dtype, bits
    if dtype == "F32":
        return served, cast_bits(np.ascontiguousarray(bits).view(np.uint32), "F32", served)
    if importlib.util.find_spec("torch") is None:
        raise UnsupportedDtype(
            f"casting {dtype} tensors to {served} needs torch (pip install torch), which rounds them as a "
            "trainer's state dict is rounded; or serve them as they are"
        )
    signed = np.ascontiguousarray(bits).view(f"<i{bits.dtype.itemsize}")  # torch has no unsigned 16/32/64 views
    cast = torch_reading(signed).view(torch_dtype(dtype)).to(torch_dtype(served))
    return served, as_bits(cast)


def snapshot(state_dict: Mapping[str, Any], *, dtype: str = "BF16") -> ServedBits:
    """The served bits of ``state_dict`` (torch tensors on any device, NumPy or CuPy
    arrays), each a private copy: the caller may change its tensors at once."""
    found = layout(state_dict, dtype)
    bits = {
        name: read_served(value, found.source_dtypes[name], found.specs[name].dtype, True)
        for name, value in found.values.items()
    }
    return ServedBits(found.specs, bits, found.aliases)


def take_snapshot(
    state_dict: Mapping[str, Any], *, dtype: str, base: PublishedBase, full: bool, copy: bool, ranked: bool = False
) -> Snapshot:
    """A snapshot of ``state_dict`` (torch tensors on any device, NumPy or CuPy arrays)
    for the base's next version.

    ``copy``: all that reads the caller's tensors happens now (see the module's text):
    host tensors of a patch version are diffed against the base of the next diff
    (``ranked``: as the context codec wants it), a keyframe's copied.
    ``full``: a keyframe is due, so nothing is diffed now; a layout other than the last
    snapshot's is published in full too.
    """
    found = layout(state_dict, dtype)
    version = base.next_version
    full = full or dict(found.specs) != base.prepared_specs
    snap = Snapshot(version, found.specs, found.aliases)
    on_device: set[str] = set()
    copies: dict[str, Bits] = {}
    for name, value in found.values.items():
        spec = found.specs[name]
        if on_gpu(value):
            on_device.add(name)
            delta = None if full else base.device_delta(spec, value)
            if delta is not None:
                snap.changes[name] = delta
            elif copy:
                copies[name] = base.device_keep(name, value)
            else:
                snap.bits.later[name] = lambda name=name, value=value: base.device_keep(name, value)  # type: ignore[misc]
            continue
        source = found.source_dtypes[name]
        if copy and not full:
            delta = base.diff_next(spec, read_served(value, source, spec.dtype, False), ranked=ranked)
            if delta is not None:
                snap.changes[name] = delta
                continue
        if copy:
            copies[name] = read_served(value, source, spec.dtype, True)
        else:
            snap.bits.reads[name] = (value, source, spec.dtype)
    snap.bits.copies.update(copies)
    base.prepared(version, found.specs, on_device, changes=snap.changes, bits=copies)
    return snap
