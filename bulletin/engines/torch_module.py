"""Apply versions in place to the live tensors of a PyTorch model.

:class:`TorchTarget` is a :class:`~bulletin.target.WeightTarget` over torch tensors that
an engine is serving from: the parameters and buffers of an ``nn.Module`` (HF
transformers models included), or views into an engine's fused parameters (the vLLM
worker extension builds those with :func:`packed_views`). Nothing is copied: a patch
changes the changed elements of the very storage the forward pass reads, so the pause
an update causes is proportional to the number of changed elements, not to the model.

- CPU tensors are patched through zero-copy NumPy views of their bits
  (:func:`bulletin_kernels.dispatch.as_bits`: ``tensor.view(torch.uint16).numpy()`` for BF16):
  the new bits and their fingerprints are computed and verified with NumPy before
  anything is written, then scattered into the same memory;
- CUDA tensors are patched by the CUDA kernels (:func:`bulletin_kernels.dispatch.backend_for`)
  on zero-copy CuPy views of the same storage, which add and fingerprint in one pass.

Both paths produce the same bits and the same fingerprints (patcher.fingerprint).

Context-coded patches (docs/FORMAT.md 3.15) decode against the bits where they live
(:meth:`TorchTarget.resolve_context`): sync runs the entropy stage on the CPU, and each
entry's ranks are resolved to indices by the tensor's backend (``select_ranks``: the
CUDA kernel for a CUDA tensor, the NumPy twin for a CPU one), one code path for both.

Tied weights (``lm_head.weight`` and ``model.embed_tokens.weight`` sharing storage)
appear under several names in a module but are served once, under the name that
sorts first, exactly as the trainer's snapshot (and safetensors' ``save_model``) drops
them; :attr:`TorchTarget.aliases` lists the dropped names.

The module must already hold the served dtypes (cast the model to BF16 before handing
it over): bits are patched, never converted.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np
from numpy.typing import NDArray

from bulletin.errors import (
    CorruptData,
    IncompatibleTensors,
    InvalidInput,
    UnsupportedDtype,
    VerificationFailed,
    WrongBase,
)
from bulletin.target import Held, WeightTarget
from bulletin_kernels.dispatch import DTYPE_NAMES, torch_reading
from patcher.context_decode import CodedChanges, needs_base, resolve_transition
from patcher.context_decode import resolve as entry_indices
from patcher.fingerprint import fingerprint, fingerprint_rows, format_fingerprint
from patcher.fingerprint_update import fingerprint_change
from patcher.format import TensorInfo
from patcher.names import check_tensor_name
from patcher.patch import Patch, TensorDelta, TensorSpec, check_names

if TYPE_CHECKING:
    import torch

    from bulletin_kernels.dispatch import Backend

__all__ = [
    "TORCH_DTYPE_NAMES",
    "GlobalIndex",
    "TorchTarget",
    "engine_drops",
    "module_tensors",
    "packed_views",
    "torch_dtype",
]

Bits = NDArray[np.unsignedinteger]
_MASK64: Final = (1 << 64) - 1

#: ``str(torch.dtype)`` -> safetensors dtype name, for the dtypes Bulletin carries.
TORCH_DTYPE_NAMES: Final[dict[str, str]] = {f"torch.{name}": st for name, st in DTYPE_NAMES.items()}


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name; raises ``UnsupportedDtype``."""
    import torch

    for torch_name, name in TORCH_DTYPE_NAMES.items():
        if name == dtype:
            return getattr(torch, torch_name.removeprefix("torch."))  # type: ignore[no-any-return]
    raise UnsupportedDtype(f"no torch dtype for {dtype!r}")


def _dtype_name(tensor: torch.Tensor, name: str) -> str:
    dtype = TORCH_DTYPE_NAMES.get(str(tensor.dtype))
    if dtype is None:
        raise UnsupportedDtype(f"{name}: torch dtype {tensor.dtype} cannot be patched bit-exactly")
    return dtype


def _storage_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    # The same key the trainer's snapshot uses to find tied weights: one view of one storage.
    return (
        str(tensor.device),
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )


def module_tensors(
    module: torch.nn.Module, *, include_buffers: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A module's served tensors and its aliases (dropped name -> served name).

    Served tensors are the module's ``state_dict`` entries (parameters and persistent
    buffers; non-persistent buffers such as rotary tables are derived, not weights),
    detached but sharing storage with the live ones. Entries that view the same memory
    as another are aliases; the name that sorts first is served.
    """
    state = module.state_dict(keep_vars=True)
    if not include_buffers:
        params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
        state = {k: v for k, v in state.items() if k in params}
    served: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name in sorted(state):
        tensor = state[name].detach()
        key = _storage_key(tensor)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        served[name] = tensor
    return served, aliases


#: Checkpoint tensors an engine's loader drops because it derives them (vLLM
#: ``model_executor/models/utils.py``, ``AutoWeightsLoader.REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER``):
#: rotary tables some trainers save.
_ROTARY_CACHES: Final = (
    "rotary_pos_emb.inv_freq",
    "rotary_emb.inv_freq",
    "rotary_emb.cos_cached",
    "rotary_emb.sin_cached",
)
#: Layer prefixes of a checkpoint's layers; an index past the engine's last layer is a
#: multi-token-prediction layer (vLLM ``get_spec_layer_idx_from_weight_name``).
_LAYER: Final = re.compile(r"(?:model\.language_model\.|model\.)?layers\.(\d+)\.")


def engine_drops(name: str, params: Mapping[str, object]) -> bool:
    """Whether a served tensor that has no engine parameter is one the engine's own
    loader drops, by an explicit rule (docs/ENGINES.md, "Tensors the engine does not serve"):

    - rotary caches (``*.rotary_emb.inv_freq``, ``cos_cached``, ``sin_cached``,
      ``rotary_pos_emb.inv_freq``): derived from the config, never loaded;
    - multi-token-prediction layers: ``[model.[language_model.]]layers.<k>.*`` with ``k``
      past the last layer the engine has (DeepSeek-style MTP heads, loaded only into a
      speculative drafter, which changes speed, never the served distribution).

    Such tensors stay in the node's folder (verified and patched like the others) and are
    not applied to the engine. Any other missing tensor is an incompatibility.
    """
    if name.endswith(_ROTARY_CACHES):
        return True
    match = _LAYER.match(name)
    if match is None:
        return False
    prefix = name[: match.start(1)]
    layers = [int(m.group(1)) for p in params if (m := _LAYER.match(p)) and p[: m.start(1)] == prefix]
    return bool(layers) and int(match.group(1)) > max(layers)


def packed_views(
    params: Mapping[str, torch.Tensor],
    specs: Mapping[str, TensorSpec],
    packed_modules_mapping: Mapping[str, Sequence[str]] | None = None,
    *,
    drops: Callable[[str, Mapping[str, object]], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Views of an engine's parameters that hold each served tensor, without copying.

    Inference engines fuse checkpoint tensors (vLLM's ``qkv_proj`` is ``q_proj``,
    ``k_proj`` and ``v_proj`` stacked along dim 0; ``gate_up_proj`` likewise) and pad
    vocabularies. For a contiguous parameter, a served tensor stacked along dim 0 (or a
    vocabulary padded at the end) is a contiguous flat range of it, so this returns
    ``param.view(-1)[offset : offset + numel].view(shape)``. Resolution per served name:

    1. a parameter of the same name whose trailing dims match and whose first dim is at
       least the served one (equal, or padded at the end);
    2. else, for a name segment ``m`` listed in ``packed_modules_mapping[p]``, the
       parameter with ``m`` replaced by ``p``, at the offset of the members before ``m``
       (their sizes come from ``specs``); the members must tile the parameter exactly.

    A tensor found neither way is left out of the result if ``drops(name, params)``
    says the engine does not serve it (:func:`engine_drops`); anything else
    (tensor-parallel shards, transposed or quantized storage) raises
    ``IncompatibleTensors`` naming the tensors that could not be placed. Placement is
    then proven by fingerprints: a wrong view fails the first base-fingerprint check
    before anything is written.
    """
    packed = {p: tuple(members) for p, members in (packed_modules_mapping or {}).items()}
    member_of = {m: p for p, members in packed.items() for m in members}
    views: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for name, spec in specs.items():
        view = _direct_view(params.get(name), spec)
        if view is None:
            view = _packed_view(params, specs, name, spec, packed, member_of)
        if view is not None:
            views[name] = view
        elif drops is None or not drops(name, params):
            missing.append(name)
    if missing:
        raise IncompatibleTensors(
            f"{len(missing)} served tensors have no matching engine parameter "
            f"(tensor-parallel shards and quantized weights are not supported): {missing[:5]}"
        )
    return views


def _flat(param: torch.Tensor) -> torch.Tensor | None:
    if not param.is_contiguous():
        return None
    return param.detach().reshape(-1)


def _direct_view(param: torch.Tensor | None, spec: TensorSpec) -> torch.Tensor | None:
    if param is None or TORCH_DTYPE_NAMES.get(str(param.dtype)) != spec.dtype:
        return None
    shape = tuple(param.shape)
    if shape == spec.shape:
        return param.detach()
    if spec.shape and len(shape) == len(spec.shape) and shape[1:] == spec.shape[1:] and shape[0] >= spec.shape[0]:
        flat = _flat(param)  # a vocabulary padded at the end: the served rows come first
        return None if flat is None else flat[: spec.numel].view(spec.shape)
    return None


def _packed_view(
    params: Mapping[str, torch.Tensor],
    specs: Mapping[str, TensorSpec],
    name: str,
    spec: TensorSpec,
    packed: Mapping[str, tuple[str, ...]],
    member_of: Mapping[str, str],
) -> torch.Tensor | None:
    parts = name.split(".")
    for i, part in enumerate(parts):
        group = member_of.get(part)
        if group is None:
            continue
        param = params.get(".".join([*parts[:i], group, *parts[i + 1 :]]))
        if param is None or TORCH_DTYPE_NAMES.get(str(param.dtype)) != spec.dtype:
            continue
        members = [".".join([*parts[:i], m, *parts[i + 1 :]]) for m in packed[group]]
        member_specs = [specs.get(m) for m in members]
        if any(s is None or s.shape[1:] != spec.shape[1:] for s in member_specs):
            continue
        sizes = [s.numel for s in member_specs if s is not None]
        flat = _flat(param)
        if flat is None or sum(sizes) != flat.numel() or tuple(param.shape[1:]) != spec.shape[1:]:
            continue
        offset = sum(sizes[: members.index(name)])
        return flat[offset : offset + spec.numel].view(spec.shape)
    return None


@dataclass(frozen=True, slots=True)
class GlobalIndex:
    """Where a tensor's elements sit in a larger flat tensor (a checkpoint tensor of which
    it is a tensor-parallel shard): element ``j`` of the tensor, read flat, is element
    ``start + (j // run) * stride + j % run`` there, for ``rows`` rows of ``run``.

    A :class:`TorchTarget` tensor with one is patched and fingerprinted in those
    (global) indices: its fingerprints are partial fingerprints of the larger tensor,
    which add up over disjoint shards to the larger tensor's own.
    """

    start: int
    rows: int
    run: int
    stride: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.rows < 1 or self.run < 1 or (self.rows > 1 and self.stride < self.run):
            raise InvalidInput(f"not a layout of disjoint rows: {self}")

    @property
    def numel(self) -> int:
        return self.rows * self.run

    @property
    def contiguous(self) -> bool:
        """Whether the elements are one run of the larger tensor."""
        return self.rows == 1 or self.stride == self.run

    @property
    def identity(self) -> bool:
        """Whether local and global indices are the same (the whole tensor from 0)."""
        return self.start == 0 and self.contiguous

    @property
    def stop(self) -> int:
        """One past the largest global index."""
        return self.start + (self.rows - 1) * self.stride + self.run

    def of(self, local: NDArray[np.int64]) -> NDArray[np.int64]:
        """Global indices of local (flat) ones."""
        if self.contiguous:
            return local + self.start if self.start else local
        rows, cols = np.divmod(local, self.run)
        out: NDArray[np.int64] = self.start + rows * self.stride + cols
        return out

    def fingerprint(self, bits: NDArray[np.unsignedinteger]) -> int:
        """The partial fingerprint (global indices) of the tensor's host ``bits``."""
        return fingerprint_rows(bits.reshape(self.rows, self.run), self.start, self.stride)


class _Slot:
    """One served tensor: the live tensor, its bits view, and the backend that patches it.

    ``where`` (a :class:`GlobalIndex`) makes its indices and fingerprints global ones."""

    __slots__ = ("backend", "bits", "device", "spec", "tensor", "where")

    def __init__(self, tensor: torch.Tensor, spec: TensorSpec, where: GlobalIndex | None = None) -> None:
        from bulletin_kernels.dispatch import as_bits, backend_for

        self.tensor = tensor
        self.spec = spec
        self.bits: Any = as_bits(tensor)  # NumPy view (CPU) or CuPy view (CUDA), zero-copy
        self.backend: Backend = backend_for(self.bits)
        self.device = tensor.device
        # Identity coordinates need no translation: the kernels' own indices are global.
        self.where = None if where is None or where.identity else where

    @property
    def host_plan(self) -> bool:
        """Whether an apply is computed and verified on the host before any write: CPU
        tensors, and tensors in global coordinates (the kernels hash local indices)."""
        return self.on_cpu or self.where is not None

    def gather(self, indices: NDArray[np.int64]) -> NDArray[np.unsignedinteger]:
        """The bits at flat ``indices``, on the host (a copy)."""
        if self.on_cpu:
            return self.bits.reshape(-1)[indices]  # type: ignore[no-any-return]
        return self.download(self.bits.reshape(-1)[self.to_device(indices)])

    def scatter(self, indices: NDArray[np.int64], values: NDArray[np.unsignedinteger]) -> None:
        """Write host ``values`` at flat ``indices``."""
        if self.on_cpu:
            self.bits.reshape(-1)[indices] = values
            return
        import cupy

        with cupy.cuda.Device(self.device.index):
            self.bits.reshape(-1)[cupy.asarray(indices)] = cupy.asarray(values)

    def expected(self, bits: NDArray[np.unsignedinteger]) -> int:
        """The fingerprint ``bits`` (host, this tensor's shape) have in this slot's indices."""
        return fingerprint(bits) if self.where is None else self.where.fingerprint(np.ascontiguousarray(bits))

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def to_device(self, array: NDArray[Any]) -> Any:
        """``array`` on the tensor's GPU (host to device copy)."""
        import cupy

        with cupy.cuda.Device(self.device.index):
            return cupy.asarray(array)

    def upload(self, array: NDArray[Any]) -> Any:
        """``array`` where the tensor's backend reads it: the array itself for a CPU
        tensor (C-contiguous), a copy on its GPU for a CUDA one."""
        return np.ascontiguousarray(array) if self.on_cpu else self.to_device(array)

    def download(self, array: Any) -> NDArray[Any]:
        """An array the backend returned, on the host."""
        if self.on_cpu:
            return np.asarray(array)
        import cupy

        return cupy.asnumpy(array)  # type: ignore[no-any-return]

    def resolve(self, changes: CodedChanges, step: TensorDelta | None) -> NDArray[np.int64]:
        """The indices of one context-coded entry's changes (class-major, as ``changes``
        orders them), resolved by the backend against the bits held, read through
        ``step`` (earlier changes not yet applied) where given. Reads only."""
        e = changes.entry
        if not needs_base(e):
            return entry_indices(changes, self.spec.dtype, None)  # one class: a rank is an offset
        if self.on_cpu:
            return self._select(changes, step)
        import cupy

        with cupy.cuda.Device(self.device.index):  # the copy below is made on the tensor's GPU
            return self._select(changes, step)

    def _select(self, changes: CodedChanges, step: TensorDelta | None) -> NDArray[np.int64]:
        e = changes.entry
        bits, start, stop = self.bits.reshape(-1), e.start, e.stop
        if step is not None and step.changed:
            lo, hi = (int(i) for i in np.searchsorted(step.indices, (e.start, e.stop)))
            if hi > lo:
                # The base as the earlier transitions leave it: a copy of the entry's range
                # (on the tensor's device) with their changes added; the live bits stay.
                bits, start, stop = bits[e.start : e.stop].copy(), 0, e.stop - e.start
                self.backend.apply_delta(
                    bits, self.upload(step.indices[lo:hi] - e.start), self.upload(step.delta[lo:hi])
                )
        found = self.backend.select_ranks(
            bits, self.spec.dtype, changes.window, start, stop, self.upload(changes.classes), self.upload(changes.ranks)
        )
        indices: NDArray[np.int64] = self.download(found).astype(np.int64, copy=False)
        return indices + (e.start - start) if start != e.start else indices

    def fingerprint(self) -> int:
        if self.where is None:
            return self.backend.fingerprint(self.bits)
        if self.on_cpu:
            return self.where.fingerprint(self.bits)
        # The kernels hash local indices; a partial fingerprint reads the bits on the host,
        # a block of rows at a time (load verification and sweeps only, never an apply).
        flat, total = self.bits.reshape(self.where.rows, self.where.run), 0
        block = max(1, (1 << 24) // self.where.run)
        for lo in range(0, self.where.rows, block):
            rows = self.download(flat[lo : lo + block])
            total += fingerprint_rows(rows, self.where.start + lo * self.where.stride, self.where.stride)
        return total & _MASK64

    def overwrite(self, source: NDArray[np.unsignedinteger]) -> None:
        if self.on_cpu:
            np.copyto(self.bits, source.reshape(self.spec.shape), casting="no")
            return
        import torch

        host = torch_reading(np.ascontiguousarray(source).reshape(-1).view(np.uint8))
        self.tensor.reshape(-1).view(torch.uint8).copy_(host)


def _negate(delta: Any) -> Any:
    # (-d) mod 2**bits without overflow: d != 0 in a patch, so ~d + 1 <= the dtype's max.
    return ~delta + delta.dtype.type(1)


@dataclass(eq=False, slots=True)
class _HostWrite:
    """A change computed and verified on the host before anything is written: what
    :meth:`TorchTarget.apply` writes is only ``new[k]`` at ``indices[k]`` of ``flat``.

    Everything the write needs is made in :meth:`TorchTarget.prepare`: the flat view of
    the live bits (NumPy over the tensor's memory, or CuPy over a CUDA tensor's), and for
    a CUDA tensor the indices and new bits already on its device. A NumPy fancy-index
    store is the write on the CPU: on this kind of machine it runs at the memory's pace
    for scattered elements (each change a cache line of its own), faster than torch's
    ``index_put_`` on one thread and as fast on two (``scripts/bench_pause.py`` prints
    the floor it sets next to a full reload)."""

    slot: _Slot
    indices: NDArray[np.int64]
    old: NDArray[np.unsignedinteger]
    new: NDArray[np.unsignedinteger]
    flat: Any
    device_indices: Any = None
    device_new: Any = None

    @classmethod
    def of(
        cls, slot: _Slot, indices: NDArray[np.int64], old: NDArray[np.unsignedinteger], new: NDArray[np.unsignedinteger]
    ) -> _HostWrite:
        flat = slot.bits.reshape(-1)
        if slot.on_cpu:
            return cls(slot, indices, old, new, flat)
        return cls(slot, indices, old, new, flat, slot.to_device(indices), slot.to_device(new))

    def write(self) -> None:
        if self.device_indices is None:
            self.flat[self.indices] = self.new
        else:
            import cupy

            with cupy.cuda.Device(self.slot.device.index):
                self.flat[self.device_indices] = self.device_new

    def restore(self) -> None:
        """Put the old bits back (after a failure, or an abort): a rare path, so a CUDA
        tensor's old bits are uploaded only now."""
        if self.device_indices is None:
            self.flat[self.indices] = self.old
        else:
            self.slot.scatter(self.indices, self.old)


@dataclass(eq=False, slots=True)
class _DeviceWrite:
    """A CUDA tensor's change, uploaded ahead; the kernel adds and fingerprints it."""

    slot: _Slot
    delta: TensorDelta
    indices: Any
    values: Any

    def add(self, *, undo: bool = False) -> int:
        values = _negate(self.values) if undo else self.values
        return self.slot.backend.apply_delta(self.slot.bits, self.indices, values)


@dataclass(eq=False, slots=True)
class _Prepared:
    patch: Patch
    base: dict[str, int]
    fingerprints: dict[str, int]
    host: list[_HostWrite]
    device: list[_DeviceWrite]


class TorchTarget(WeightTarget):
    """A :class:`~bulletin.target.WeightTarget` over live torch tensors, patched in place.

    ``tensors`` maps served names to the tensors the engine computes with (contiguous,
    CPU or CUDA, in the served dtype). ``on_activate`` is called with each version made
    live, after the bits are verified (an engine hook, a log line).

    An apply has two phases so that the engine pauses only for the writes:

    - :meth:`prepare` (requests may still run; it only reads) checks every base
      fingerprint, the patch's indices, and for CPU tensors gathers the old bits,
      computes the new ones and their fingerprints and verifies them against the
      patch's targets; CUDA deltas are uploaded to their devices. A bad patch is
      refused here, before anything is written.
    - :meth:`apply` (requests held off by the caller) writes: one scatter per CPU
      tensor, the CUDA kernels (which add and fingerprint in one pass) for GPU ones,
      verified as they land; on any failure everything written is put back
      (``VerificationFailed``). ``apply`` prepares first if :meth:`prepare` was not
      called with the same patch and fingerprints.

    Until :meth:`activate` the previous bits are kept (the gathered old values, the
    deltas), so :meth:`abort` can put the previous version back. The caller is the only
    writer of these tensors between ``prepare`` and ``apply`` (the sync thread is).
    """

    #: Live weights change during ``load_full`` and ``apply``, not only at ``activate``.
    in_place = True
    #: ``load_full`` overwrites the live tensors and keeps no copy of what they held.
    restores_loads = False

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        aliases: Mapping[str, str] | None = None,
        on_activate: Callable[[int], None] | None = None,
        coordinates: Mapping[str, GlobalIndex] | None = None,
    ) -> None:
        import torch

        if not tensors:
            raise InvalidInput("a TorchTarget needs at least one tensor")
        self.aliases: dict[str, str] = dict(aliases or {})
        self._on_activate = on_activate
        self._slots: dict[str, _Slot] = {}
        for name, tensor in tensors.items():
            check_tensor_name(name)
            if tensor.layout != torch.strided:
                raise IncompatibleTensors(f"{name}: only dense (strided) tensors can be patched")
            if tensor.device.type not in ("cpu", "cuda"):
                raise IncompatibleTensors(f"{name}: tensors on {tensor.device} are not supported")
            if not tensor.is_contiguous():
                raise IncompatibleTensors(f"{name}: tensor is not contiguous; patch its storage instead")
            spec = TensorSpec(name, _dtype_name(tensor, name), tuple(int(d) for d in tensor.shape))
            where = (coordinates or {}).get(name)
            if where is not None and where.numel != spec.numel:
                raise InvalidInput(f"{name}: coordinates for {where.numel} elements, the tensor has {spec.numel}")
            self._slots[name] = _Slot(tensor.detach(), spec, where)
        self._specs = {name: slot.spec for name, slot in self._slots.items()}
        self._prepared: _Prepared | None = None
        self._undo: _Prepared | None = None
        self.version: int | None = None
        #: SHA-256 of the run manifest of ``version``, kept for this process's lifetime.
        self.manifest_digest: str | None = None

    @classmethod
    def from_module(
        cls,
        module: torch.nn.Module,
        *,
        include_buffers: bool = True,
        on_activate: Callable[[int], None] | None = None,
    ) -> TorchTarget:
        """Target a module's parameters and persistent buffers, aliases dropped."""
        tensors, aliases = module_tensors(module, include_buffers=include_buffers)
        return cls(tensors, aliases=aliases, on_activate=on_activate)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The live tensors, by served name."""
        return {name: slot.tensor for name, slot in self._slots.items()}

    # -- WeightTarget ----------------------------------------------------------------------

    def layout(self) -> Mapping[str, TensorSpec]:
        return self._specs

    def restored(self) -> Held | None:
        # Live tensors hold whatever the process loaded; nothing is known to be verified.
        return None

    @property
    def resolves_context(self) -> bool:
        # Context-coded patches are resolved where the bits live (resolve_context), CPU
        # and CUDA tensors alike; context_bits stays None: nothing is copied to the host.
        # Not for shards of larger tensors: a context-coded entry ranks the whole tensor.
        return all(slot.where is None for slot in self._slots.values())

    def resolve_context(
        self,
        changes: Sequence[CodedChanges],
        tensors: Mapping[str, TensorInfo],
        fingerprints: Mapping[str, int],
        *,
        pending: Patch | None = None,
    ) -> Patch:
        """One context-coded transition's patch, resolved against the live bits by each
        tensor's backend (see :class:`~bulletin.target.WeightTarget`). Reads only, and
        runs before :meth:`prepare` (outside the sidecar's gate); what it returns is
        applied as any patch is, with every fingerprint checked again."""
        if not self.resolves_context:
            raise InvalidInput("tensors that are shards of larger ones cannot resolve context-coded changes")
        _check_same_layout({name: info.spec for name, info in tensors.items()}, self._specs)
        return resolve_transition(
            changes,
            tensors,
            fingerprints,
            lambda ch, step: self._slots[ch.entry.tensor].resolve(ch, step),
            pending=pending,
            holder="the engine",
        )

    def load_full(self, tensors: Mapping[str, Bits], specs: Mapping[str, TensorSpec]) -> None:
        """Overwrite every tensor with ``tensors`` (bits arrays); checks everything first."""
        _check_same_layout(specs, self._specs)
        for name, spec in specs.items():
            array = tensors.get(name)
            if array is None or array.dtype != spec.bits_dtype or array.size != spec.numel:
                raise IncompatibleTensors(f"{name}: expected {spec.numel} x {spec.bits_dtype}")
        self._prepared = self._undo = None
        for name, slot in self._slots.items():
            slot.overwrite(tensors[name])
        # Read back from the live tensors (on their device): the engine computes with
        # these bits, so a copy that did not land is found before the version is activated.
        bad = [name for name, slot in self._slots.items() if slot.fingerprint() != slot.expected(tensors[name])]
        if bad:
            raise VerificationFailed(f"{len(bad)} tensors did not load bit for bit: {bad[:3]}")

    def prepare(self, patch: Patch, fingerprints: Mapping[str, int]) -> None:
        """Check and precompute an apply without writing anything (see the class notes)."""
        self._prepared = self._plan(patch, fingerprints)

    def _plan(self, patch: Patch, fingerprints: Mapping[str, int]) -> _Prepared:
        patch.check_layout(self._specs)
        for name, td in patch.tensors.items():
            held = fingerprints.get(name)
            if held != td.base_fingerprint:
                raise WrongBase(
                    f"{name}: the patch was made for base {format_fingerprint(td.base_fingerprint)}, "
                    f"the engine holds {'nothing known' if held is None else format_fingerprint(held)}"
                )
            if not td.changed and td.target_fingerprint != td.base_fingerprint:
                raise CorruptData(f"{name}: an unchanged tensor cannot change its fingerprint")
            td.validate()
        new = {name: fingerprints[name] for name in patch.tensors}
        host: list[_HostWrite] = []
        device: list[_DeviceWrite] = []
        for name, td in patch.tensors.items():
            if not td.changed:
                continue
            slot = self._slots[name]
            if slot.host_plan:
                old = slot.gather(td.indices)
                values = old + td.delta  # unsigned: wraps, as deltas are defined
                hashed = td.indices if slot.where is None else slot.where.of(td.indices)
                new[name] = (new[name] + fingerprint_change(hashed, old, values)) & _MASK64
                if new[name] != td.target_fingerprint:
                    raise VerificationFailed(
                        f"{name}: the patched bits would fingerprint to {format_fingerprint(new[name])}, "
                        f"not {format_fingerprint(td.target_fingerprint)}; nothing was written"
                    )
                host.append(_HostWrite.of(slot, td.indices, old, values))
            else:
                device.append(_DeviceWrite(slot, td, slot.to_device(td.indices), slot.to_device(td.delta)))
        return _Prepared(patch, dict(fingerprints), new, host, device)

    def apply(self, patch: Patch, fingerprints: Mapping[str, int]) -> dict[str, int]:
        """Apply in place; ``WrongBase`` / ``VerificationFailed`` leave the old bits."""
        plan, self._prepared = self._prepared, None
        if plan is None or plan.patch is not patch or plan.base != dict(fingerprints):
            plan = self._plan(patch, fingerprints)
        written: list[_HostWrite] = []
        added: list[_DeviceWrite] = []
        try:
            for change in plan.host:
                change.write()
                written.append(change)
            for write in plan.device:
                total = write.add()
                added.append(write)
                name = write.delta.spec.name
                landed = (plan.base[name] + total) & _MASK64
                if landed != write.delta.target_fingerprint:
                    raise VerificationFailed(
                        f"{name}: bits after the apply fingerprint to {format_fingerprint(landed)}, "
                        f"not {format_fingerprint(write.delta.target_fingerprint)}; the previous bits are restored"
                    )
        except BaseException:
            for write in reversed(added):
                write.add(undo=True)
            for change in reversed(written):
                change.restore()
            raise
        self._undo = plan
        return dict(plan.fingerprints)

    def abort(self) -> None:
        """Undo an apply that will not be activated (the caller's own check failed)."""
        plan, self._undo, self._prepared = self._undo, None, None
        if plan is None:
            return
        for write in reversed(plan.device):
            write.add(undo=True)
        for change in reversed(plan.host):
            change.restore()

    def full_fingerprints(self) -> dict[str, int]:
        return {name: slot.fingerprint() for name, slot in self._slots.items()}

    def activate(self, version: int, *, manifest_digest: str | None = None) -> None:
        self._undo = self._prepared = None
        self.version = version
        self.manifest_digest = manifest_digest
        if self._on_activate is not None:
            self._on_activate(version)


def _check_same_layout(given: Mapping[str, TensorSpec], held: Mapping[str, TensorSpec]) -> None:
    check_names(held, given, "tensor sets differ from the engine's")
    for name, spec in given.items():
        mine = held[name]
        if spec != mine:
            raise IncompatibleTensors(
                f"{name}: version has {spec.dtype}{list(spec.shape)}, engine has {mine.dtype}{list(mine.shape)}"
            )
