"""Fallback for tensors the in-place rules refuse: vLLM's sparse checkpoint patches.

vLLM 0.33.0 (vllm-project/vllm, commit ``4ba787ec9``,
``model_executor/model_loader/checkpoint_weight_patch.py``, PRs #50723 / #53751) applies
updates in *checkpoint* coordinates through the model's own ``load_weights``:
``load_checkpoint_weight_patches(model, [CheckpointWeightPatch(name, shape, dtype,
values, indices)])`` stages each sparse patch as a full checkpoint-shaped tensor of NaN
(NaN marks "unchanged"), runs the model's loaders on it with ``Tensor.copy_`` replaced
by a NaN-masked ``torch.where(..., out=destination)``, and keeps no copy of what it
overwrote: O(N) staging per tensor and call, no rollback. So every TP slicing, expert
placement or fusing the loaders do is vLLM's own, including layouts
:class:`~bulletin.engines.rank_layout.RankLayout` refuses (MoE experts through
``RoutedExperts.weight_loader``, checkpoint tensors fused on disk at TP > 1, custom
layers with a placement-only ``weight_loader``).

Bulletin uses it only for what the in-place rules refuse (:func:`bind_rank`), and only
once it has *proven* at bind that, on this rank, the loaders merely place checkpoint
elements (:func:`probe_pieces`):

1. *discovery*: the refused tensors are loaded as empty sparse patches under a
   :class:`_WriteGuard` (a ``TorchFunctionMode``) that records which parameters the
   NaN-masked final copy writes and skips those writes, and refuses any other write to a
   live parameter (``fill_``, ``__setitem__``, ``param.data = ...``: outside vLLM's
   sparse contract) before it happens: nothing live changes;
2. *probe*: those parameters (one module's at a time: bounded memory, on the host) are
   swapped for float64 copies full of NaN and each tensor is loaded twice, element ``i``
   of tensor ``k`` carrying ``c = base_k + i + 1`` and then ``-(c + 0.5)``. A placement
   leaves each landed element holding an integer code and its negated half-shifted
   twin; a scaling, offset, quantizing or mixing loader (MLA's derived weights) does not,
   and is refused (``IncompatibleLayout``), as are elements placed twice, tensors
   spread over several parameters, and placements that do not compress to one affine
   run (:func:`compress`: a :class:`~bulletin.engines.torch_module.GlobalIndex`).
   The probed parameters are not the live weights meanwhile, so the sidecar binds with
   the engine paused (``VLLMTarget._bind``).

The result is an ordinary :class:`~bulletin.engines.rank_layout.Piece` per tensor, so
partial fingerprints are computed in checkpoint (global) indices from zero-copy views
and the sidecar's :class:`~bulletin.engines.rank_layout.ReplicaPlan` checks work
unchanged. Writes go through vLLM's API (:class:`SparseTarget`), and because it is not
transactional each apply is verified around it: refused before writing when the bits
read do not fingerprint to the base partials or the new bits would not land on the
target, or when a new value is a NaN bit pattern (vLLM's "unchanged" sentinel:
:class:`~bulletin.errors.UnrepresentableNaN`); read back after writing; and after a
failure the old values of the changed elements are written back through the same API
and verified, or the rank is reported unverified (``VerificationFailed``: the sidecar
then serves nothing until it has verified or reloaded the engine).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import numpy as np
from numpy.typing import NDArray

from bulletin.engines.rank_layout import Piece, RankLayout
from bulletin.engines.torch_module import TORCH_DTYPE_NAMES, GlobalIndex, TorchTarget, torch_dtype
from bulletin.errors import (
    BulletinError,
    CorruptData,
    IncompatibleLayout,
    IncompatibleTensors,
    UnrepresentableNaN,
    VerificationFailed,
    WrongBase,
)
from bulletin.target import Held, WeightTarget
from patcher.fingerprint import format_fingerprint
from patcher.fingerprint_update import fingerprint_change
from patcher.patch import Patch, TensorDelta, TensorSpec, check_layout

if TYPE_CHECKING:
    import torch

__all__ = ["CheckpointPatch", "PatchLoader", "SparseTarget", "bind_rank", "compress", "probe_pieces", "vllm_loader"]

Bits = NDArray[np.unsignedinteger]
log = logging.getLogger("bulletin.engines.vllm_sparse")
_MASK64: Final = (1 << 64) - 1
#: vLLM's batching target per ``load_weights`` call (``_DEFAULT_PATCH_CHUNK_BYTES``).
CHUNK_BYTES: Final = 512 << 20
#: In-place methods that change metadata, not values.
_METADATA: Final = frozenset({"requires_grad_", "share_memory_", "retain_grad"})
#: Special methods that write their first argument (``param.data = x`` is ``__set__``).
_WRITING: Final = frozenset(
    {"__setitem__", "__set__"}
    | {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul")}
    | {f"__i{op}__" for op in ("and", "or", "xor", "lshift", "rshift")}
)
_SIGNED: Final[dict[int, Any]] = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_SIGNED_NAMES: Final = {1: "I8", 2: "I16", 4: "I32", 8: "I64"}


class CheckpointPatch(NamedTuple):
    """vLLM's ``CheckpointWeightPatch``, field for field: ``values`` at flat ``indices``
    of the checkpoint tensor ``name`` (global ``shape``, torch ``dtype``)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor
    indices: torch.Tensor


#: Applies sparse checkpoint patches to a model (vLLM's ``load_checkpoint_weight_patches``).
PatchLoader = Callable[["torch.nn.Module", list[CheckpointPatch]], object]


def vllm_loader() -> PatchLoader | None:
    """vLLM's own sparse loader, or None where this vLLM has none (before 0.33)."""
    try:
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (  # type: ignore[import-not-found, unused-ignore]
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )
    except ImportError:
        return None

    def load(model: torch.nn.Module, patches: list[CheckpointPatch]) -> object:
        return load_checkpoint_weight_patches(
            model, [CheckpointWeightPatch(*p) for p in patches], max_chunk_bytes=CHUNK_BYTES
        )

    return load


# -- placement maps ------------------------------------------------------------------------


def compress(positions: NDArray[np.int64], indices: NDArray[np.int64], what: str) -> tuple[int, GlobalIndex]:
    """One affine run for a placement: ``positions`` (ascending flat indices into a
    parameter) hold checkpoint elements ``indices``. Returns the flat offset and the
    :class:`GlobalIndex` of a :class:`Piece`; ``IncompatibleLayout`` unless the positions
    are one contiguous range whose elements are ``rows`` equal runs at a fixed stride."""
    n = int(positions.size)
    if n == 0 or indices.size != n:
        raise IncompatibleLayout(f"{what}: an empty placement")
    offset = int(positions[0])
    if int(positions[-1]) - offset != n - 1:
        raise IncompatibleLayout(f"{what}: its elements are not one contiguous range of the parameter")
    start = int(indices[0])
    breaks = np.flatnonzero(np.diff(indices) != 1)
    run = int(breaks[0]) + 1 if breaks.size else n
    if run == n:
        return offset, GlobalIndex(start, 1, n, n)
    stride = int(indices[run]) - start
    m = np.arange(n, dtype=np.int64)
    if n % run or stride < run or not np.array_equal(indices, start + (m // run) * stride + m % run):
        raise IncompatibleLayout(f"{what}: the placement is not rows of equal runs at one stride (not compressible)")
    return offset, GlobalIndex(start, n // run, run, stride)


def _storage(tensor: torch.Tensor) -> int | None:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


class _Outside(Exception):
    """A loader wrote a live parameter outside vLLM's sparse contract (raised before it did)."""


def _write_guard(
    live: Mapping[int, str], allowed: Collection[str] = (), *, skip: bool = False
) -> Any:  # a TorchFunctionMode; torch is imported lazily
    from torch.overrides import TorchFunctionMode

    class WriteGuard(TorchFunctionMode):
        """Every write to a live parameter's storage during a loader call: only the
        NaN-masked final copy (``torch.where(..., out=param view)``) into ``allowed``
        parameters runs; with ``skip`` (discovery) it is only recorded, not run. Any
        other write to a live parameter raises :class:`_Outside` before it happens."""

        def __init__(self) -> None:
            super().__init__()
            self.written: set[str] = set()

        def __torch_function__(
            self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
        ) -> Any:
            import torch

            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            out = kwargs.get("out")
            targets = [out] if isinstance(out, torch.Tensor) else []
            mutating = (name.endswith("_") and not name.endswith("__") and name not in _METADATA) or name in _WRITING
            if mutating and args and isinstance(args[0], torch.Tensor):
                targets.append(args[0])
            final = False
            for tensor in targets:
                key = _storage(tensor)
                param = live.get(key) if key is not None else None
                if param is None:
                    continue
                if func is not torch.where or tensor is not out:
                    raise _Outside(f"{name} writes {param} (only a final same-shaped copy_ is vLLM's sparse contract)")
                if not skip and param not in allowed:
                    raise _Outside(f"the loader writes {param}, which this patch does not place")
                self.written.add(param)
                final = True
            if final and skip:
                return out
            return func(*args, **kwargs)

    return WriteGuard()


def _live(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[int, str]]:
    """The model's parameters and buffers by (first) name, and their storages."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(t) not in seen:
            seen.add(id(t))
            tensors[name] = t
    storages: dict[int, str] = {}
    for name, t in tensors.items():
        key = _storage(t)
        if key is not None:
            storages.setdefault(key, name)
    return tensors, storages


def _groups(model: torch.nn.Module, names: Sequence[str]) -> list[list[str]]:
    """Tensors by the deepest module whose prefix their name has: one group's parameters
    are probed together (memory bound), which is all the grouping decides."""
    prefixes = sorted((p for p, _ in model.named_modules() if p), key=len, reverse=True)
    out: dict[str, list[str]] = {}
    for name in names:
        owner = next((p for p in prefixes if name.startswith(p + ".")), name.rpartition(".")[0])
        out.setdefault(owner, []).append(name)
    return list(out.values())


def _empty(spec: TensorSpec) -> CheckpointPatch:
    import torch

    dtype = torch_dtype(spec.dtype)
    return CheckpointPatch(spec.name, spec.shape, dtype, torch.empty(0, dtype=dtype), torch.empty(0, dtype=torch.int64))


def probe_pieces(
    model: torch.nn.Module, specs: Mapping[str, TensorSpec], load: PatchLoader
) -> tuple[dict[str, Piece], frozenset[str]]:
    """Where ``load`` (vLLM's sparse loader) puts each tensor of ``specs`` on this rank:
    a :class:`Piece` per tensor it places here, and the names it places nowhere here
    (another rank's experts or slices). ``IncompatibleLayout`` for what is not a pure,
    compressible placement into one parameter in the checkpoint's dtype (see the module
    notes). Nothing live is written: discovery skips the writes, probes land in float64
    copies, and any other write to a live parameter is refused before it happens."""
    for spec in specs.values():
        if not torch_dtype(spec.dtype).is_floating_point:
            raise IncompatibleLayout(f"{spec.name}: {spec.dtype}: vLLM's sparse patches need a floating dtype (NaN)")
    params, live = _live(model)
    pieces: dict[str, Piece] = {}
    absent: set[str] = set()
    for group in _groups(model, list(specs)):
        guard = _write_guard(live, skip=True)
        try:
            with guard:
                load(model, [_empty(specs[n]) for n in group])
        except _Outside as exc:
            raise IncompatibleLayout(f"{group[0]}: {exc}") from None
        except Exception as exc:
            raise IncompatibleLayout(f"{group[0]}: vLLM's loader refuses a sparse patch: {exc}") from exc
        if not guard.written:
            absent.update(group)
            continue
        placed = _probe(model, params, live, sorted(guard.written), [specs[n] for n in group], load)
        for name in group:
            found = placed.get(name)
            if found is None:
                absent.add(name)
                continue
            if len(found) > 1:
                raise IncompatibleLayout(f"{name}: placed in several parameters {sorted(found)}")
            ((pname, (positions, indices)),) = found.items()
            param = params[pname]
            if TORCH_DTYPE_NAMES.get(str(param.dtype)) != specs[name].dtype:
                raise IncompatibleLayout(
                    f"{name}: parameter {pname} holds {param.dtype}, the checkpoint {specs[name].dtype}"
                )
            if not param.is_contiguous():
                raise IncompatibleLayout(f"{name}: parameter {pname} is not contiguous")
            offset, where = compress(positions, indices, name)
            pieces[name] = Piece(pname, offset, where)
    return pieces, frozenset(absent)


def _probe(
    model: torch.nn.Module,
    params: Mapping[str, torch.Tensor],
    live: Mapping[int, str],
    targets: Sequence[str],
    specs: Sequence[TensorSpec],
    load: PatchLoader,
) -> dict[str, dict[str, tuple[NDArray[np.int64], NDArray[np.int64]]]]:
    """Load two index-valued probes of ``specs`` into float64 copies of ``targets``:
    tensor name -> parameter -> (positions, checkpoint indices), ascending positions."""
    import torch

    sizes = np.array([s.numel for s in specs], dtype=np.int64)
    bases = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    total = int(sizes.sum())
    if total >= 1 << 52:
        raise IncompatibleLayout(f"{specs[0].name}: too many elements to probe exactly in float64")
    originals = {p: params[p].data for p in targets}
    shadows = {p: torch.full(tuple(t.shape), float("nan"), dtype=torch.float64) for p, t in originals.items()}
    codes: dict[str, NDArray[np.float64]] = {}
    try:
        for p, shadow in shadows.items():
            params[p].data = shadow
        for second in (False, True):
            patches = []
            for spec, base in zip(specs, bases, strict=True):
                code = torch.arange(1, spec.numel + 1, dtype=torch.float64) + float(base)
                values = -(code + 0.5) if second else code
                patches.append(
                    CheckpointPatch(
                        spec.name, spec.shape, torch.float64, values, torch.arange(spec.numel, dtype=torch.int64)
                    )
                )
            try:
                with _write_guard(live):  # every live parameter is outside: the probe lands in shadows only
                    load(model, patches)
            except _Outside as exc:
                raise IncompatibleLayout(f"{specs[0].name}: {exc}") from None
            except Exception as exc:
                raise IncompatibleLayout(f"{specs[0].name}: vLLM's loader fails on a probe: {exc}") from exc
            for p, shadow in shadows.items():
                flat = shadow.reshape(-1).numpy()
                if not second:
                    codes[p] = flat.copy()
                    shadow.fill_(float("nan"))
                else:
                    _check_twin(codes[p], flat, total, p)
    finally:
        for p, original in originals.items():
            params[p].data = original
    out: dict[str, dict[str, tuple[NDArray[np.int64], NDArray[np.int64]]]] = {}
    seen: list[NDArray[np.int64]] = []
    for p, first in codes.items():
        positions = np.flatnonzero(~np.isnan(first))
        flat_codes = first[positions].astype(np.int64) - 1
        seen.append(flat_codes)
        which = np.searchsorted(bases, flat_codes, side="right") - 1
        for k in np.unique(which):
            mine = which == k
            out.setdefault(specs[int(k)].name, {})[p] = (positions[mine], flat_codes[mine] - bases[k])
    every = np.concatenate(seen) if seen else np.empty(0, np.int64)
    if np.unique(every).size != every.size:
        raise IncompatibleLayout(f"{specs[0].name}: the loader places some checkpoint elements twice on this rank")
    return out


def _check_twin(first: NDArray[np.float64], second: NDArray[np.float64], total: int, param: str) -> None:
    """Both probes landed as a placement would leave them (see the module notes)."""
    held = ~np.isnan(first)
    bad = held != ~np.isnan(second)
    v = np.where(held, first, 1.0)
    bad |= held & ((v != np.floor(v)) | (v < 1) | (v > total) | (second != -(v + 0.5)))
    if bool(bad.any()):
        at = int(np.flatnonzero(bad)[0])
        raise IncompatibleLayout(
            f"{param}: the loader transforms values (element {at} holds {first[at]!r} and {second[at]!r}, "
            "not a placed checkpoint element): quantized, scaled or derived weights cannot take sparse patches"
        )


# -- binding -------------------------------------------------------------------------------


def bind_rank(
    model: torch.nn.Module,
    specs: Mapping[str, TensorSpec],
    *,
    tp_rank: int | None = None,
    tp_size: int | None = None,
    pp_rank: int = 0,
    load: PatchLoader | None = None,
) -> tuple[RankLayout, WeightTarget | None]:
    """This rank's layout and target: :class:`RankLayout`'s in-place rules, and for the
    tensors they refuse, where an engine offers it (``load``: default vLLM's
    ``load_checkpoint_weight_patches``, and the model a ``load_weights``), the probed
    placement with writes through vLLM's sparse patches (:class:`SparseTarget`).
    ``tp_rank`` / ``tp_size`` / ``pp_rank`` as :meth:`RankLayout.of_module` takes them.
    ``IncompatibleLayout`` for what neither can take."""
    try:
        layout = RankLayout.of_module(model, specs, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank)
    except IncompatibleLayout as exc:
        loader = load if load is not None else vllm_loader()
        if loader is None or not callable(getattr(model, "load_weights", None)):
            raise
        refused: dict[str, str] = {}
        layout = RankLayout.of_module(model, specs, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, refused=refused)
        if not refused:
            raise
        try:
            pieces, absent = probe_pieces(model, {n: specs[n] for n in refused}, loader)
        except IncompatibleLayout as probed:
            name = next((n for n in refused if str(probed).startswith(n)), next(iter(refused)))
            raise IncompatibleLayout(
                f"{refused[name]}; nor can vLLM's sparse checkpoint patches take it: {probed}"
            ) from exc
        _check_disjoint(layout.pieces, pieces)
        merged = RankLayout(
            {**layout.pieces, **pieces},
            dropped=layout.dropped,
            absent=layout.absent | absent,
            tp_rank=layout.tp_rank,
            tp_size=layout.tp_size,
            pp_rank=layout.pp_rank,
        )
        log.info(
            "rank %s: %d checkpoint tensors (such as %s) go through vLLM's sparse checkpoint patches, "
            "O(tensor) staging per apply: %s",
            merged.key,
            len(pieces),
            next(iter(sorted(pieces)), None),
            next(iter(refused.values())),
        )
        return merged, (SparseTarget(model, merged, frozenset(pieces), loader, specs) if merged.pieces else None)
    return layout, (layout.target(model) if layout.pieces else None)


def _check_disjoint(inplace: Mapping[str, Piece], probed: Mapping[str, Piece]) -> None:
    ranges = sorted((p.param, p.offset, p.offset + p.numel, n) for n, p in {**inplace, **probed}.items())
    for (pa, _, end, na), (pb, start, _, nb) in itertools.pairwise(ranges):
        if pa == pb and start < end:
            raise IncompatibleLayout(f"{na} and {nb} share elements of parameter {pa}")


# -- writes through vLLM's API ---------------------------------------------------------------


def _host_bits(view: torch.Tensor, spec: TensorSpec) -> Bits:
    """The bits of a flat view on the host: zero-copy on the CPU, a copy from a GPU."""
    ints = view.detach().reshape(-1).view(torch_dtype(_SIGNED_NAMES[spec.width]))
    array: NDArray[Any] = (ints if ints.device.type == "cpu" else ints.to("cpu")).numpy()
    return array.view(spec.bits_dtype)


def _values(bits: Bits, dtype: str, device: torch.device) -> torch.Tensor:
    """Bits as a torch tensor of checkpoint ``dtype`` (bits copied, never converted)."""
    import torch

    signed = np.ascontiguousarray(bits).view(_SIGNED[bits.dtype.itemsize])
    return torch.from_numpy(signed).view(torch_dtype(dtype)).to(device)


@dataclass(eq=False, slots=True)
class _Change:
    """One tensor's sparse write on this rank, with what undoes it."""

    name: str
    spec: TensorSpec  # the checkpoint tensor's (global shape)
    where: GlobalIndex
    indices: torch.Tensor  # global flat indices, on the parameter's device
    old: torch.Tensor
    new: torch.Tensor
    base: int
    target: int


class SparseTarget(WeightTarget):
    """One rank's pieces: those the in-place rules place through a
    :class:`~bulletin.engines.torch_module.TorchTarget` (transactional, O(changed)),
    those in ``sparse`` through ``load`` (vLLM's sparse checkpoint patches: O(tensor)
    staging, verified around each call as the module notes say). Fingerprints are
    partial ones in checkpoint indices for both. ``specs`` are the checkpoint's."""

    in_place = True
    restores_loads = False

    def __init__(
        self,
        model: torch.nn.Module,
        layout: RankLayout,
        sparse: frozenset[str],
        load: PatchLoader,
        specs: Mapping[str, TensorSpec],
    ) -> None:
        views = layout.views(model)
        inplace = {n: v for n, v in views.items() if n not in sparse}
        self.inner = TorchTarget(inplace, coordinates={n: layout.pieces[n].where for n in inplace}) if inplace else None
        self.model = model
        self.load = load
        self.sparse = {n: views[n] for n in sorted(sparse)}
        self.where = {n: layout.pieces[n].where for n in self.sparse}
        self.params = {n: layout.pieces[n].param for n in self.sparse}
        self.specs = {n: specs[n] for n in self.sparse}
        self._layout = layout.local_specs(specs)
        self._undo: list[_Change] | None = None
        self.version: int | None = None

    # -- reads ------------------------------------------------------------------------------

    def layout(self) -> Mapping[str, TensorSpec]:
        return self._layout

    def restored(self) -> Held | None:
        return None

    def _partial(self, name: str) -> int:
        return self.where[name].fingerprint(_host_bits(self.sparse[name], self._layout[name]))

    def full_fingerprints(self) -> dict[str, int]:
        held = self.inner.full_fingerprints() if self.inner is not None else {}
        return {**held, **{n: self._partial(n) for n in self.sparse}}

    # -- writes -----------------------------------------------------------------------------

    def _write(self, changes: Sequence[_Change], *, undo: bool = False) -> None:
        patches = [
            CheckpointPatch(c.name, c.spec.shape, torch_dtype(c.spec.dtype), c.old if undo else c.new, c.indices)
            for c in changes
        ]
        _, live = _live(self.model)
        try:
            with _write_guard(live, {self.params[c.name] for c in changes}):
                self.load(self.model, patches)
        except _Outside as exc:
            raise VerificationFailed(f"vLLM's loader wrote outside the probed placement: {exc}") from None

    def _check_nan(self, name: str, values: torch.Tensor, indices: torch.Tensor) -> None:
        import torch

        nan = torch.isnan(values)
        if bool(nan.any()):
            at = int(indices[int(torch.nonzero(nan)[0, 0])])
            raise UnrepresentableNaN(
                f"{name}: element {at} would become a NaN bit pattern, which vLLM's sparse checkpoint patches "
                f"read as 'unchanged'; nothing was written (the rank keeps the version it holds)"
            )

    def _plan(self, tensors: Mapping[str, TensorDelta], fingerprints: Mapping[str, int]) -> list[_Change]:
        """Checks and the values to write, reading only: refused before any write."""
        import torch

        changes: list[_Change] = []
        for name, td in tensors.items():
            held = fingerprints.get(name)
            if held != td.base_fingerprint:
                raise WrongBase(
                    f"{name}: the patch was made for base {format_fingerprint(td.base_fingerprint)}, the rank holds "
                    f"{'nothing known' if held is None else format_fingerprint(held)}"
                )
            if not td.changed:
                if td.target_fingerprint != td.base_fingerprint:
                    raise CorruptData(f"{name}: an unchanged tensor cannot change its fingerprint")
                continue
            td.validate()
            spec, where, view = self.specs[name], self.where[name], self.sparse[name]
            bits = _host_bits(view, self._layout[name])
            found = where.fingerprint(bits)
            if found != held:
                raise VerificationFailed(
                    f"{name}: this rank's bits fingerprint to {format_fingerprint(found)}, not the base "
                    f"{format_fingerprint(td.base_fingerprint)}; nothing was written"
                )
            old = bits[td.indices]
            new = old + td.delta  # unsigned: wraps, as deltas are defined
            hashed = where.of(td.indices)
            landed = (held + fingerprint_change(hashed, old, new)) & _MASK64
            if landed != td.target_fingerprint:
                raise VerificationFailed(
                    f"{name}: the patched bits would fingerprint to {format_fingerprint(landed)}, not "
                    f"{format_fingerprint(td.target_fingerprint)}; nothing was written"
                )
            indices = torch.from_numpy(hashed).to(view.device)
            values = (_values(old, spec.dtype, view.device), _values(new, spec.dtype, view.device))
            change = _Change(name, spec, where, indices, *values, held, td.target_fingerprint)
            self._check_nan(name, change.new, indices)
            changes.append(change)
        return changes

    def _landed(self, changes: Sequence[_Change], *, undo: bool = False) -> list[str]:
        return [c.name for c in changes if self._partial(c.name) != (c.base if undo else c.target)]

    def _restore(self, changes: Sequence[_Change]) -> bool:
        """Write the old values of the changed elements back through the same API and
        verify them; False where that cannot be done (an old value is NaN) or fails."""
        import torch

        if not changes:
            return True
        if any(bool(torch.isnan(c.old).any()) for c in changes):
            return False
        try:
            self._write(changes, undo=True)
        except Exception:  # the restore itself failed: what the rank holds is unknown
            log.exception("restoring %d tensors through vLLM's sparse patches failed", len(changes))
            return False
        return not self._landed(changes, undo=True)

    def apply(self, patch: Patch, fingerprints: Mapping[str, int]) -> dict[str, int]:
        """In-place pieces first (transactional), then the sparse ones through vLLM,
        read back; on a failure both are put back (see the class notes)."""
        patch.check_layout(self._layout)
        inner = Patch({n: td for n, td in patch.tensors.items() if n not in self.sparse})
        changes = self._plan({n: td for n, td in patch.tensors.items() if n in self.sparse}, fingerprints)
        held: dict[str, int] = {}
        if self.inner is not None:
            held = self.inner.apply(inner, {n: fingerprints[n] for n in inner.tensors})
        try:
            if changes:
                self._write(changes)
            bad = self._landed(changes)
            if bad:
                raise VerificationFailed(f"{len(bad)} tensors did not land on their targets through vLLM: {bad[:3]}")
        except BaseException as exc:
            restored = self._restore(changes)
            if self.inner is not None:
                self.inner.abort()
            if not restored:
                raise VerificationFailed(
                    f"vLLM's sparse patches failed mid-apply ({exc}) and the old values could not be restored "
                    "and verified: this rank's weights are unverified"
                ) from exc
            if isinstance(exc, BulletinError):
                raise
            raise VerificationFailed(f"vLLM's sparse patches failed ({exc}); the previous bits are restored") from exc
        self._undo = changes
        out = {n: fingerprints[n] for n in patch.tensors}
        out.update(held)
        out.update({c.name: c.target for c in changes})
        return out

    def abort(self) -> None:
        changes, self._undo = self._undo, None
        if self.inner is not None:
            self.inner.abort()
        if changes and not self._restore(changes):
            raise VerificationFailed("the sparse writes could not be undone and verified: this rank is unverified")

    def load_full(self, tensors: Mapping[str, Bits], specs: Mapping[str, TensorSpec]) -> None:
        """Every piece from ``tensors`` (this rank's elements, flat): the sparse ones as one
        sparse patch each over all their elements, NaN refused before anything is written."""
        import torch

        check_layout(self._layout, specs)
        for name, spec in specs.items():
            array = tensors.get(name)
            if array is None or array.dtype != spec.bits_dtype or array.size != spec.numel:
                raise IncompatibleTensors(f"{name}: expected {spec.numel} x {spec.bits_dtype}")
        changes = []
        for name, view in self.sparse.items():
            spec = self.specs[name]
            local = np.arange(view.numel(), dtype=np.int64)
            indices = torch.from_numpy(self.where[name].of(local)).to(view.device)
            values = _values(tensors[name].reshape(-1), spec.dtype, view.device)
            self._check_nan(name, values, indices)
            target = self.where[name].fingerprint(tensors[name].reshape(-1))
            changes.append(_Change(name, spec, self.where[name], indices, values, values, target, target))
        self._undo = None
        if self.inner is not None:
            self.inner.load_full({n: tensors[n] for n in self.inner.layout()}, self.inner.layout())
        if changes:
            self._write(changes)
        bad = self._landed(changes)
        if bad:
            raise VerificationFailed(f"{len(bad)} tensors did not load bit for bit through vLLM: {bad[:3]}")

    def activate(self, version: int, *, manifest_digest: str | None = None) -> None:
        if self.inner is not None:
            self.inner.activate(version, manifest_digest=manifest_digest)
        self._undo = None
        self.version = version
