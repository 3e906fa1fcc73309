"""Where each checkpoint tensor lives on one tensor-parallel rank, from the engine's own metadata.

A tensor-parallel engine shards every checkpoint tensor (HF names, global shapes) over
its ranks. :class:`RankLayout` maps, for one rank's ``torch.nn.Module``, every checkpoint
tensor the rank holds to the :class:`Piece` of one local parameter that holds it: a
contiguous range of the parameter's elements, which are ``rows`` runs of a checkpoint
tensor (a :class:`~bulletin.engines.torch_module.GlobalIndex`). The rules are vLLM's
(vllm-project/vllm 0.33.0, commit ``4ba787ec9``), taken per layer *class* from the
metadata vLLM puts on layers and parameters, not from a table per model:

==============================  ====================================================================
layer class                     what rank ``r`` of ``tp`` holds (``model_executor/layers/linear.py``,
                                ``vocab_parallel_embedding.py``, ``parameter.py``)
==============================  ====================================================================
``ColumnParallelLinear``        params with ``output_dim``: the slice ``r * local`` of that dim
                                (``weight_loader``); params without: the whole tensor
``MergedColumnParallelLinear``  member ``i`` of ``packed_modules_mapping`` (``gate_proj``,
                                ``up_proj``): its ``output_sizes[i] / tp`` rows from ``r * size``,
                                at ``sum(output_sizes[:i]) / tp`` in the parameter
``QKVParallelLinear``           ``q``: ``num_heads * head_size`` rows from ``r * size``; ``k``,
                                ``v``: ``num_kv_heads * head_size`` rows from
                                ``(r // num_kv_head_replicas) * size`` (GQA: with tp > KV heads
                                several ranks hold the same KV rows)
``RowParallelLinear``           params with ``input_dim``: the slice ``r * local`` of that dim
                                (``rows`` runs, one per output row); the bias whole
``ReplicatedLinear``            whole tensors (``MergedReplicatedLinear``: members stacked)
``VocabParallelEmbedding``,     rows ``shard_indices.org_vocab_start_index`` to
``ParallelLMHead``              ``org_vocab_end_index`` at local row 0; the padded rows after
                                them hold no checkpoint element (the loader zero-fills them)
any other module                parameters without vLLM sharding metadata (no ``output_dim`` /
                                ``input_dim`` / custom ``weight_loader``; norms): whole tensors,
                                replicated, as ``default_weight_loader`` copies them
==============================  ====================================================================

Each layer's own ``tp_rank`` / ``tp_size`` attributes are used (``disable_tp`` layers and
``DCPGroupColumnParallelLinear`` set them). What cannot be mapped is refused with
:class:`~bulletin.errors.IncompatibleLayout` naming the parameter: MoE experts and
MLA attention (expert placement, weights derived after loading), quantized or repacked
parameters (a quant method other than the unquantized one, ``packed_dim``,
``is_sharded_weight``, a dtype other than the checkpoint's), parameters of unknown
classes that carry sharding metadata, subclasses of the parallel layers that may shard
otherwise, and checkpoint tensors fused on disk (one tensor, several pieces).

:class:`ReplicaPlan` combines the layouts of every rank of one engine (tensor x
pipeline parallel): pieces of one tensor are either the same elements (a replica set:
norms, replicated KV heads) or disjoint, and together they must cover every element of
every tensor that is not dropped by the engine (pipeline stages hold parts of the
model; a tensor no rank holds is refused). Each rank's *partial fingerprint* of a
tensor is the sum over the elements its piece holds, hashed with their checkpoint
(global) indices (docs/FORMAT.md: fingerprints are sums over elements), so one owner
per replica set sums to the tensor's fingerprint and the other members of the set
must equal the owner.

:meth:`RankLayout.local_patch` translates a patch in checkpoint indices into this
rank's patch over its pieces (a sorted-index filter per piece: O(changes in range)
for contiguous pieces, O(rows + local changes) for row-parallel ones), which
:meth:`RankLayout.target` (a :class:`~bulletin.engines.torch_module.TorchTarget` over
zero-copy views of the pieces, in global coordinates) applies with the usual
discipline: refused before any write when the bits read do not land on the expected
partial fingerprints, rolled back on failure.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np
from numpy.typing import NDArray

from bulletin.engines.torch_module import (
    TORCH_DTYPE_NAMES,
    GlobalIndex,
    TorchTarget,
    engine_drops,
    packed_views,
)
from bulletin.errors import IncompatibleLayout, InvalidInput, VerificationFailed
from patcher.fingerprint import fingerprint_rows, format_fingerprint
from patcher.fingerprint_update import fingerprint_change
from patcher.patch import Patch, TensorDelta, TensorSpec

if TYPE_CHECKING:
    import torch

__all__ = ["Piece", "RankLayout", "ReplicaPlan", "with_dropped"]

Bits = NDArray[np.unsignedinteger]
_MASK64: Final = (1 << 64) - 1

#: vLLM layer classes (exact class names) and the rule each follows; a subclass not
#: listed may shard otherwise (MinimaxM3QKVParallelLinearWithIndexer does) and is refused.
_RULES: Final[dict[str, str]] = {
    "ColumnParallelLinear": "column",
    "DCPGroupColumnParallelLinear": "column",
    "MergedColumnParallelLinear": "merged",
    "QKVParallelLinear": "qkv",
    "RowParallelLinear": "row",
    "ReplicatedLinear": "replicated",
    "MergedReplicatedLinear": "replicated",
    "VocabParallelEmbedding": "vocab",
    "ParallelLMHead": "vocab",
}
_BASES: Final = frozenset({"LinearBase", *_RULES})
#: Modules whose weights are placed by expert or derived after loading (vLLM
#: ``layers/fused_moe``, ``layers/attention/mla_attention.py``: ``W_UK``/``W_UV`` are
#: computed from ``kv_b_proj`` in ``process_weights_after_loading``).
_REFUSED: Final = re.compile(r"MoE|Moe|MLA|LatentAttention")
_UNQUANTIZED: Final = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
_QKV: Final = ("q", "k", "v")
_EMPTY: Final = np.empty(0, np.int64)


@dataclass(frozen=True, slots=True)
class Piece:
    """The part of one checkpoint tensor that one rank holds: ``where.numel`` contiguous
    elements of parameter ``param`` from flat ``offset``, which are the checkpoint
    tensor's elements ``where`` describes."""

    param: str
    offset: int
    where: GlobalIndex

    @property
    def numel(self) -> int:
        return self.where.numel

    def select(self, indices: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """For sorted global ``indices``: the positions of those this piece holds, and
        their local indices (into the piece, read flat). O(rows + selected) after a
        binary search per row."""
        w = self.where
        if w.contiguous:
            lo, hi = (int(i) for i in np.searchsorted(indices, (w.start, w.start + w.numel)))
            return np.arange(lo, hi, dtype=np.int64), indices[lo:hi] - w.start
        starts = w.start + np.arange(w.rows, dtype=np.int64) * w.stride
        first = np.searchsorted(indices, starts)
        counts = np.searchsorted(indices, starts + w.run) - first
        total = int(counts.sum())
        if total == 0:
            empty = np.empty(0, np.int64)
            return empty, empty
        before = np.cumsum(counts) - counts
        positions = np.repeat(first - before, counts) + np.arange(total, dtype=np.int64)
        shift = np.repeat(starts - np.arange(w.rows, dtype=np.int64) * w.run, counts)
        return positions.astype(np.int64, copy=False), indices[positions] - shift

    def take(self, full: Bits) -> Bits:
        """This piece's elements of the checkpoint tensor's bits ``full`` (a copy, flat)."""
        w = self.where
        flat = full.reshape(-1)
        if w.contiguous:
            return np.array(flat[w.start : w.start + w.numel], copy=True)
        rows = np.lib.stride_tricks.as_strided(
            flat[w.start :], shape=(w.rows, w.run), strides=(w.stride * flat.itemsize, flat.itemsize), writeable=False
        )
        return np.ascontiguousarray(rows).reshape(-1)

    def partial(self, full: Bits) -> int:
        """The partial fingerprint of the checkpoint tensor's bits ``full`` over this piece."""
        w = self.where
        flat = full.reshape(-1)
        if w.contiguous:
            return fingerprint_rows(flat[w.start : w.start + w.numel], w.start, w.numel)
        return w.fingerprint(self.take(full))

    def to_json(self) -> list[Any]:
        w = self.where
        return [self.param, self.offset, w.start, w.rows, w.run, w.stride]

    @classmethod
    def from_json(cls, value: object) -> Piece:
        if (
            not isinstance(value, list)
            or len(value) != 6
            or not isinstance(value[0], str)
            or not all(type(v) is int for v in value[1:])
        ):
            raise InvalidInput(f"a piece is [param, offset, start, rows, run, stride], got {value!r:.200}")
        return cls(value[0], value[1], GlobalIndex(value[2], value[3], value[4], value[5]))


def _narrow(
    local: tuple[int, ...], full: tuple[int, ...], dim: int, local_at: int, global_at: int, size: int, what: str
) -> tuple[int, GlobalIndex]:
    """``param.narrow(dim, local_at, size)`` holding ``checkpoint.narrow(dim, global_at,
    size)``: the piece's flat offset in the parameter and its global coordinates."""
    if len(local) != len(full) or any(a != b for k, (a, b) in enumerate(zip(local, full, strict=True)) if k != dim):
        raise IncompatibleLayout(f"{what}: parameter {list(local)} cannot hold a slice of {list(full)} on dim {dim}")
    if local_at < 0 or global_at < 0 or local_at + size > local[dim] or global_at + size > full[dim]:
        raise IncompatibleLayout(f"{what}: slice {global_at}+{size} of dim {dim} does not fit {list(full)}")
    inner = int(np.prod(local[dim + 1 :], dtype=np.int64))
    outer = int(np.prod(local[:dim], dtype=np.int64))
    if outer > 1 and local[dim] != size:
        raise IncompatibleLayout(f"{what}: the parameter's piece is not contiguous (dim {dim} of {list(local)})")
    offset = local_at * inner if outer <= 1 else 0
    if outer <= 1:
        return offset, GlobalIndex(global_at * inner, 1, size * inner, size * inner)
    return offset, GlobalIndex(global_at * inner, outer, size * inner, full[dim] * inner)


def _whole(spec: TensorSpec) -> GlobalIndex:
    return GlobalIndex(0, 1, max(spec.numel, 1), max(spec.numel, 1))


def _int_attr(obj: object, name: str, what: str) -> int:
    value = getattr(obj, name, None)
    if type(value) is not int:
        raise IncompatibleLayout(f"{what}: the layer has no integer {name!r} (not vLLM's layout)")
    return value


class RankLayout:
    """Where every checkpoint tensor one rank holds lives in its parameters.

    ``pieces`` maps checkpoint names to the :class:`Piece` that holds them on this rank;
    ``dropped`` names tensors the engine's loader drops (rotary tables, MTP layers past
    the last, see :func:`~bulletin.engines.torch_module.engine_drops`), ``absent`` the
    others this rank does not hold (another pipeline stage's, or nobody's: the
    :class:`ReplicaPlan` decides). ``tp_rank`` / ``tp_size`` are the rank's, as its
    layers report them; ``pp_rank`` the pipeline stage (0 without pipeline parallelism).
    Build one with :meth:`of_module`.
    """

    def __init__(
        self,
        pieces: Mapping[str, Piece],
        *,
        dropped: frozenset[str] = frozenset(),
        absent: frozenset[str] = frozenset(),
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
    ) -> None:
        self.pieces: dict[str, Piece] = dict(pieces)
        self.dropped = dropped
        self.absent = absent
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.pp_rank = pp_rank

    @property
    def key(self) -> str:
        """This rank's name in requests that carry one value per rank: ``"<pp>.<tp>"``."""
        return f"{self.pp_rank}.{self.tp_rank}"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RankLayout):
            return NotImplemented
        return self.to_json() == other.to_json()

    __hash__ = None  # type: ignore[assignment]

    # -- building ------------------------------------------------------------------------

    @classmethod
    def of_module(
        cls,
        model: torch.nn.Module,
        specs: Mapping[str, TensorSpec],
        *,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        pp_rank: int = 0,
        packed_modules_mapping: Mapping[str, Sequence[str]] | None = None,
        refused: dict[str, str] | None = None,
    ) -> RankLayout:
        """The layout of ``model`` (one rank's module) for checkpoint tensors ``specs``.

        ``packed_modules_mapping`` defaults to the model's own (vLLM models declare one:
        ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": [...]}``).
        ``tp_rank`` / ``tp_size`` default to what the model's parallel layers say (1 for
        a model without any); given, they must agree with them. Raises
        ``IncompatibleLayout`` for what cannot be mapped (see the module notes).
        ``refused``: given, the checkpoint tensors of MoE / MLA modules, of parameters
        the rules refuse (fused on disk at TP > 1) and of parameters with their own
        loader outside vLLM's layers are recorded there (name -> reason) and left out
        of the layout instead (:func:`bulletin.engines.vllm_sparse.bind_rank` probes them).
        """
        packed = {
            g: tuple(m)
            for g, m in (
                packed_modules_mapping
                if packed_modules_mapping is not None
                else getattr(model, "packed_modules_mapping", None) or {}
            ).items()
        }
        found: dict[str, Piece] = {}
        ranks: set[tuple[int, int]] = set()
        claimed: set[str] = set()  # parameters (by name) a parallel layer's rule placed
        for prefix, module in model.named_modules(remove_duplicate=False):
            names = [c.__name__ for c in type(module).__mro__]
            if any(_REFUSED.search(n) for n in names[:-1]):
                held = [n for n in specs if n.startswith(f"{prefix}.")]
                if held:
                    reason = (
                        f"{prefix} ({names[0]}): expert-parallel or derived (MLA) weights cannot be patched in place; "
                        f"{len(held)} checkpoint tensors such as {held[0]!r}"
                    )
                    if refused is None:
                        raise IncompatibleLayout(reason)
                    refused.update(dict.fromkeys(held, reason))
                continue
            rule = _RULES.get(names[0])
            if rule is None:
                base = next((n for n in names[1:] if n in _BASES), None)
                if base is not None and any(True for _ in module.parameters(recurse=False)):
                    raise IncompatibleLayout(
                        f"{prefix} ({names[0]}): a subclass of vLLM's {base} whose sharding is not known"
                    )
                continue
            _check_quant(module, prefix, names[0])
            r, size = _layer_rank(module, prefix)
            if size > 1:
                ranks.add((r, size))
            for local, param in module.named_parameters(recurse=False):
                pname = f"{prefix}.{local}" if prefix else local
                claimed.add(pname)
                try:
                    placed = _place(rule, module, prefix, local, pname, param, specs, packed, r, size)
                except IncompatibleLayout as exc:
                    held = [n for n in (pname, *(_members(prefix, local, packed) or ())) if n in specs]
                    if refused is None or not held:
                        raise
                    refused.update(dict.fromkeys(held, str(exc)))
                    continue
                for ckpt, piece in placed.items():
                    _add(found, ckpt, piece)
        if len(ranks) > 1:
            raise IncompatibleLayout(f"the model's parallel layers disagree on their rank: {sorted(ranks)}")
        if ranks:
            rank, size = next(iter(ranks))
            if (tp_size is not None and tp_size != size) or (tp_rank is not None and tp_rank != rank):
                raise IncompatibleLayout(f"the layers are rank {rank} of {size}, not {tp_rank} of {tp_size}")
        else:
            rank, size = tp_rank or 0, tp_size or 1
        params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        params.update(dict(model.named_buffers(remove_duplicate=False)))
        rest = {n: s for n, s in specs.items() if n not in found and n not in (refused or {})}
        others = {n: p for n, p in params.items() if n not in claimed}
        for ckpt, piece in _fallback(others, rest, packed, size, refused).items():
            _add(found, ckpt, piece)
        missing = [n for n in specs if n not in found and n not in (refused or {})]
        dropped = frozenset(n for n in missing if engine_drops(n, params))
        for name, piece in found.items():
            _check_dtype(params[piece.param], specs[name], piece.param)
        return cls(
            found,
            dropped=dropped,
            absent=frozenset(missing) - dropped,
            tp_rank=rank,
            tp_size=size,
            pp_rank=pp_rank,
        )

    # -- this rank's work ----------------------------------------------------------------

    def local_specs(self, specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        """The specs of this rank's pieces (flat), by checkpoint name."""
        return {n: TensorSpec(n, specs[n].dtype, (p.numel,)) for n, p in self.pieces.items()}

    def views(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Zero-copy flat views of the pieces in ``model``'s parameters, by checkpoint name."""
        params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        params.update(dict(model.named_buffers(remove_duplicate=False)))
        views: dict[str, torch.Tensor] = {}
        for name, piece in self.pieces.items():
            param = params.get(piece.param)
            if param is None or not param.is_contiguous():
                raise IncompatibleLayout(f"{name}: parameter {piece.param!r} is gone or not contiguous")
            flat = param.detach().reshape(-1)
            views[name] = flat[piece.offset : piece.offset + piece.numel]
        return views

    def target(self, model: torch.nn.Module) -> TorchTarget:
        """A :class:`TorchTarget` over this rank's pieces, in global coordinates: its
        fingerprints are this rank's partial fingerprints."""
        views = self.views(model)
        if not views:
            raise IncompatibleLayout("this rank holds no checkpoint tensor")
        return TorchTarget(views, coordinates={n: p.where for n, p in self.pieces.items()})

    def local_patch(self, patch: Patch, base: Mapping[str, int], target: Mapping[str, int]) -> Patch:
        """This rank's part of ``patch`` (checkpoint indices): a patch over every piece
        (the layout of :meth:`target`) with local indices, base fingerprints ``base`` and
        targets ``target`` (this rank's partials before and after; a piece that nothing
        changes must keep its base). ``patch`` must describe every tensor held here."""
        out: dict[str, TensorDelta] = {}
        for name, piece in self.pieces.items():
            td = patch.tensors.get(name)
            if td is None:
                raise IncompatibleLayout(f"{name}: held by this rank, not in the patch")
            if td.spec.numel < piece.where.stop:
                raise IncompatibleLayout(f"{name}: the patch's {list(td.spec.shape)} does not hold this rank's piece")
            positions, local = piece.select(td.indices) if td.changed else (_EMPTY, _EMPTY)
            spec = TensorSpec(name, td.spec.dtype, (piece.numel,))
            out[name] = TensorDelta(spec, local, td.delta[positions], _get(base, name), _get(target, name))
        return Patch(out)

    def partials(self, bits: Mapping[str, Bits]) -> dict[str, int]:
        """This rank's partial fingerprints of full checkpoint bits ``bits``."""
        return {n: p.partial(bits[n]) for n, p in self.pieces.items()}

    def local_bits(self, bits: Mapping[str, Bits]) -> dict[str, Bits]:
        """This rank's elements of full checkpoint bits ``bits`` (copies), by name."""
        return {n: p.take(bits[n]) for n, p in self.pieces.items()}

    # -- wire form -----------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "pp_rank": self.pp_rank,
            "pieces": {n: p.to_json() for n, p in sorted(self.pieces.items())},
            "dropped": sorted(self.dropped),
            "absent": sorted(self.absent),
        }

    @classmethod
    def from_json(cls, value: object) -> RankLayout:
        if not isinstance(value, dict) or not isinstance(value.get("pieces"), dict):
            raise InvalidInput(f"a rank layout is an object with pieces, got {value!r:.200}")
        ints = [value.get(k, d) for k, d in (("tp_rank", 0), ("tp_size", 1), ("pp_rank", 0))]
        names = [value.get(k, []) for k in ("dropped", "absent")]
        if not all(type(v) is int and v >= 0 for v in ints) or not all(
            isinstance(v, list) and all(isinstance(n, str) for n in v) for v in names
        ):
            raise InvalidInput("a rank layout's ranks are integers and its names lists of strings")
        pieces = {str(n): Piece.from_json(p) for n, p in value["pieces"].items()}
        return cls(
            pieces,
            dropped=frozenset(names[0]),
            absent=frozenset(names[1]),
            tp_rank=ints[0],
            tp_size=ints[1],
            pp_rank=ints[2],
        )


def _get(fps: Mapping[str, int], name: str) -> int:
    value = fps.get(name)
    if value is None:
        raise InvalidInput(f"{name}: no partial fingerprint given for this rank")
    return value


def _add(found: dict[str, Piece], name: str, piece: Piece) -> None:
    if name in found and found[name] != piece:
        raise IncompatibleLayout(f"{name}: held by two parameters ({found[name].param}, {piece.param})")
    found[name] = piece


# -- SGLang's layers -----------------------------------------------------------------------
# SGLang 0.5.23's layers (sglang/srt/layers/linear.py, vocab_parallel_embedding.py) are
# forks of vLLM's with the same class names, ``output_dim`` / ``input_dim``,
# ``output_sizes``, head counts and ``shard_indices``; what differs is read here:
# - a layer's rank is that of its ``tp_group`` (``get_group_rank_size`` in
#   distributed/utils.py: ``(group.rank_in_group, group.world_size)``, ``(0, 1)`` for
#   None, i.e. an unsharded layer), not ``tp_rank`` / ``tp_size`` attributes;
# - ``QKVParallelLinear`` shards K and V by its own ``kv_tp_group``: KV group
#   ``kv_tp_rank // num_kv_head_replicas`` (``weight_loader``), which may differ from the
#   query's group (``kv_parallel_group``);
# - ``use_presharded_weights`` layers take pre-sharded checkpoint tensors: refused.
# The vocabulary padding rule (``padding_size *= tp_size`` when the padded vocabulary does
# not divide by tp) is SGLang's own but only moves the padded rows: the checkpoint rows
# a rank holds are ``shard_indices.org_vocab_start_index`` .. ``end``, read as for vLLM.


def _group_rank(group: object, what: str) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return _int_attr(group, "rank_in_group", what), _int_attr(group, "world_size", what)


def _layer_rank(module: torch.nn.Module, prefix: str) -> tuple[int, int]:
    """(rank, size) of a parallel layer: vLLM's ``tp_rank`` / ``tp_size``, else SGLang's
    ``tp_group``."""
    if getattr(module, "use_presharded_weights", False):
        raise IncompatibleLayout(f"{prefix}: loads pre-sharded checkpoint tensors (use_presharded_weights)")
    if isinstance(getattr(module, "tp_rank", None), int) or not hasattr(module, "tp_group"):
        return _int_attr(module, "tp_rank", prefix), _int_attr(module, "tp_size", prefix)
    return _group_rank(module.tp_group, prefix)


def _kv_rank(module: torch.nn.Module, rank: int, pname: str) -> int:
    """The rank that places K and V: SGLang's ``kv_tp_group`` where the layer has one."""
    if not hasattr(module, "kv_tp_group"):
        return rank
    return _group_rank(module.kv_tp_group, pname)[0]


def _check_quant(module: torch.nn.Module, prefix: str, cls: str) -> None:
    method = getattr(module, "quant_method", None)
    if method is not None and type(method).__name__ not in _UNQUANTIZED:
        raise IncompatibleLayout(f"{prefix} ({cls}): quantized with {type(method).__name__}; only bits served as-is")


def _check_dtype(param: torch.Tensor, spec: TensorSpec, pname: str) -> None:
    if TORCH_DTYPE_NAMES.get(str(param.dtype)) != spec.dtype:
        raise IncompatibleLayout(f"{spec.name}: parameter {pname} holds {param.dtype}, the checkpoint {spec.dtype}")


def _check_param(param: torch.Tensor, pname: str) -> None:
    for attr in ("packed_dim", "packed_factor", "marlin_tile_size"):
        if getattr(param, attr, None) is not None:
            raise IncompatibleLayout(f"{pname}: a packed (quantized) parameter ({attr})")
    if getattr(param, "is_sharded_weight", False):
        raise IncompatibleLayout(f"{pname}: loaded from a pre-sharded checkpoint (is_sharded_weight)")
    if not param.is_contiguous():
        raise IncompatibleLayout(f"{pname}: not contiguous")


def _members(prefix: str, local: str, packed: Mapping[str, tuple[str, ...]]) -> tuple[str, ...] | None:
    """Checkpoint names that a fused parameter stacks (``packed_modules_mapping``)."""
    head, _, group = prefix.rpartition(".")
    members = packed.get(group)
    if members is None:
        return None
    return tuple(f"{head}.{m}.{local}" if head else f"{m}.{local}" for m in members)


def _place(
    rule: str,
    module: torch.nn.Module,
    prefix: str,
    local: str,
    pname: str,
    param: torch.Tensor,
    specs: Mapping[str, TensorSpec],
    packed: Mapping[str, tuple[str, ...]],
    rank: int,
    size: int,
) -> dict[str, Piece]:
    """The checkpoint tensors one parameter of a vLLM parallel layer holds, by its rule."""
    _check_param(param, pname)
    shape = tuple(int(d) for d in param.shape)
    out_dim: int | None = getattr(param, "output_dim", None)
    in_dim: int | None = getattr(param, "input_dim", None)
    if rule in ("merged", "qkv") or (rule == "replicated" and hasattr(module, "output_sizes")):
        members = _members(prefix, local, packed)
        if members is None or pname in specs:
            if pname in specs and size > 1:
                raise IncompatibleLayout(f"{pname}: fused on disk; its pieces would be several per rank")
            if pname in specs and shape == specs[pname].shape:
                return {pname: Piece(pname, 0, _whole(specs[pname]))}
            return {}
        present = [m for m in members if m in specs]
        if not present:
            return {}
        if len(present) != len(members):
            raise IncompatibleLayout(f"{pname}: the checkpoint has {present} of {list(members)}")
        if rule == "qkv":
            return _qkv(module, pname, members, shape, specs, out_dim, rank)
        return _stacked(module, pname, members, shape, specs, out_dim, rank, size, sharded=rule == "merged")
    if pname not in specs:
        return {}
    spec = specs[pname]
    if rule == "column" and out_dim is not None:
        start = rank * shape[out_dim]
        offset, where = _narrow(shape, spec.shape, out_dim, 0, start, shape[out_dim], pname)
        return {pname: Piece(pname, offset, where)}
    if rule == "row" and in_dim is not None:
        start = rank * shape[in_dim]
        offset, where = _narrow(shape, spec.shape, in_dim, 0, start, shape[in_dim], pname)
        return {pname: Piece(pname, offset, where)}
    if rule == "vocab" and out_dim is not None:
        added = getattr(module, "num_added_embeddings", 0)
        if added:
            raise IncompatibleLayout(f"{pname}: {added} added (LoRA) vocabulary rows are not in the checkpoint")
        indices = getattr(module, "shard_indices", None)
        lo = _int_attr(indices, "org_vocab_start_index", pname)
        hi = _int_attr(indices, "org_vocab_end_index", pname)
        if spec.shape[out_dim] != _int_attr(module, "org_vocab_size", pname):
            raise IncompatibleLayout(f"{pname}: the checkpoint's vocabulary is not the layer's org_vocab_size")
        if hi == lo:
            return {}  # a rank past the vocabulary holds only padding
        offset, where = _narrow(shape, spec.shape, out_dim, 0, lo, hi - lo, pname)
        return {pname: Piece(pname, offset, where)}
    if shape != spec.shape:
        raise IncompatibleLayout(f"{pname}: {list(shape)} replicated, the checkpoint has {list(spec.shape)}")
    return {pname: Piece(pname, 0, _whole(spec))}


def _qkv(
    module: torch.nn.Module,
    pname: str,
    members: tuple[str, ...],
    shape: tuple[int, ...],
    specs: Mapping[str, TensorSpec],
    out_dim: int | None,
    rank: int,
) -> dict[str, Piece]:
    """``QKVParallelLinear.weight_loader`` with a shard id (linear.py): per member, the
    rows of this rank's heads; ``k``/``v`` of rank ``r`` are KV head group
    ``r // num_kv_head_replicas``."""
    if len(members) != 3 or out_dim is None:
        raise IncompatibleLayout(f"{pname}: a QKV layer's parameter without output_dim or three members")
    heads = _int_attr(module, "num_heads", pname)
    kv = _int_attr(module, "num_kv_heads", pname)
    head = _int_attr(module, "head_size", pname)
    v_head = getattr(module, "v_head_size", head)
    replicas = _int_attr(module, "num_kv_head_replicas", pname)
    sizes = {"q": heads * head, "k": kv * head, "v": kv * v_head}
    offsets = {"q": 0, "k": heads * head, "v": (heads + kv) * head}
    if sum(sizes.values()) != shape[out_dim]:
        raise IncompatibleLayout(f"{pname}: heads {sizes} do not tile the parameter's {shape[out_dim]} rows")
    out: dict[str, Piece] = {}
    for shard, name in zip(_QKV, members, strict=True):
        group = rank if shard == "q" else _kv_rank(module, rank, pname) // replicas
        offset, where = _narrow(
            shape, specs[name].shape, out_dim, offsets[shard], group * sizes[shard], sizes[shard], name
        )
        out[name] = Piece(pname, offset, where)
    return out


def _stacked(
    module: torch.nn.Module,
    pname: str,
    members: tuple[str, ...],
    shape: tuple[int, ...],
    specs: Mapping[str, TensorSpec],
    out_dim: int | None,
    rank: int,
    size: int,
    *,
    sharded: bool,
) -> dict[str, Piece]:
    """``MergedColumnParallelLinear.weight_loader`` with an int shard id: member ``i``'s
    ``output_sizes[i] / tp`` rows from ``rank * that``, at ``sum(output_sizes[:i]) / tp``
    (``MergedReplicatedLinear``: tp = 1)."""
    sizes = getattr(module, "output_sizes", None)
    if out_dim is None:
        raise IncompatibleLayout(f"{pname}: a merged parameter without output_dim is copied whole per member")
    if not isinstance(sizes, list | tuple) or len(sizes) != len(members) or not all(type(s) is int for s in sizes):
        raise IncompatibleLayout(f"{pname}: output_sizes do not match the members {list(members)}")
    tp = size if sharded else 1
    if any(s % tp for s in sizes):
        raise IncompatibleLayout(f"{pname}: output_sizes {sizes} not divisible by {tp}")
    out: dict[str, Piece] = {}
    for i, name in enumerate(members):
        part = sizes[i] // tp
        at = sum(sizes[:i]) // tp
        offset, where = _narrow(shape, specs[name].shape, out_dim, at, (rank if sharded else 0) * part, part, name)
        out[name] = Piece(pname, offset, where)
    return out


def _fallback(
    params: Mapping[str, torch.Tensor],
    specs: Mapping[str, TensorSpec],
    packed: Mapping[str, tuple[str, ...]],
    tp_size: int,
    refused: dict[str, str] | None = None,
) -> dict[str, Piece]:
    """Tensors held by parameters outside vLLM's parallel layers (norms, plain modules):
    whole and replicated, as ``default_weight_loader`` copies them. Unsharded (tp = 1)
    engines also get :func:`~bulletin.engines.torch_module.packed_views`' placement
    (fused and padded parameters of modules without vLLM's metadata). A parameter with
    its own loader or sharding is refused, or recorded in ``refused``."""
    out: dict[str, Piece] = {}
    for name, spec in specs.items():
        param = params.get(name)
        if param is None:
            continue
        loader = getattr(param, "weight_loader", None)
        sharded = any(getattr(param, a, None) is not None for a in ("output_dim", "input_dim", "packed_dim"))
        if sharded or (loader is not None and getattr(loader, "__name__", "") != "default_weight_loader"):
            reason = f"{name}: a parameter with its own sharding or loader, of an unknown layer"
            if refused is None:
                raise IncompatibleLayout(reason)
            refused[name] = reason
            continue
        if tuple(param.shape) == spec.shape:
            out[name] = Piece(name, 0, _whole(spec))
    if tp_size > 1:
        return out
    rest = {n: s for n, s in specs.items() if n not in out and n not in (refused or {})}
    views = packed_views(params, rest, packed, drops=lambda _n, _p: True)  # unplaced: absent or dropped
    for name, view in views.items():
        for pname, param in params.items():
            if param.untyped_storage().data_ptr() == view.untyped_storage().data_ptr() and param.is_contiguous():
                offset = int(view.storage_offset()) - int(param.storage_offset())
                if offset >= 0 and offset + view.numel() <= param.numel():
                    out[name] = Piece(pname, offset, _whole(specs[name]))
                    break
    return out


class ReplicaPlan:
    """The ranks of one engine (tensor x pipeline parallel) and whose partial
    fingerprints make up each checkpoint tensor's.

    ``layouts`` are the ranks' :class:`RankLayout` s (vLLM's ``collective_rpc`` answers
    one per worker of an engine). Per tensor, ranks holding the same elements form a
    replica set; sets must be disjoint and together hold every element (pipeline
    stages included); a tensor no rank holds must be dropped by every rank (rotary
    tables, MTP heads), else ``IncompatibleLayout``. ``owners[name]`` lists one rank
    per set (the first): their partials sum to the tensor's fingerprint.
    """

    def __init__(self, layouts: Sequence[RankLayout], specs: Mapping[str, TensorSpec]) -> None:
        if not layouts:
            raise InvalidInput("a replica plan needs at least one rank")
        self.layouts = list(layouts)
        self.specs = dict(specs)
        keys: dict[str, RankLayout] = {}
        for layout in self.layouts:
            if keys.setdefault(layout.key, layout) != layout:
                raise IncompatibleLayout(f"two ranks named {layout.key} hold different pieces")
        self.sets: dict[str, list[tuple[int, ...]]] = {}
        missing: list[str] = []
        dropped: set[str] = set()
        for name, spec in specs.items():
            groups: dict[GlobalIndex, list[int]] = {}
            for i, layout in enumerate(self.layouts):
                piece = layout.pieces.get(name)
                if piece is not None:
                    groups.setdefault(piece.where, []).append(i)
            if not groups:
                if spec.numel and all(name in layout.dropped for layout in self.layouts):
                    dropped.add(name)
                elif spec.numel:
                    missing.append(name)
                continue
            _check_cover(name, spec, list(groups))
            self.sets[name] = [tuple(g) for g in groups.values()]
        if missing:
            raise IncompatibleLayout(
                f"{len(missing)} checkpoint tensors are held by no rank of the engine: {sorted(missing)[:5]}"
            )
        self.dropped = frozenset(dropped)
        self.owners: dict[str, tuple[int, ...]] = {n: tuple(s[0] for s in sets) for n, sets in self.sets.items()}

    def keys(self) -> list[str]:
        return [layout.key for layout in self.layouts]

    def expected(self, bits: Mapping[str, Bits]) -> list[dict[str, int]]:
        """Each rank's partial fingerprints of full checkpoint bits ``bits`` (each
        element hashed once: one piece per replica set)."""
        out: list[dict[str, int]] = [{} for _ in self.layouts]
        for name, sets in self.sets.items():
            for ranks in sets:
                value = self.layouts[ranks[0]].pieces[name].partial(bits[name])
                for i in ranks:
                    out[i][name] = value
        return out

    def advance(
        self, held: Sequence[Mapping[str, int]], patch: Patch, new_bits: Mapping[str, Bits], *, undo: bool = False
    ) -> list[dict[str, int]]:
        """Each rank's partials after ``patch``, from ``held`` (before it) and the full
        bits after it (``new_bits``, e.g. the node's folder): O(changed elements).
        ``undo``: the partials before it, from ``held`` after it."""
        out = [dict(h) for h in held]
        for name, td in patch.tensors.items():
            if not td.changed or name not in self.sets:
                continue
            flat = new_bits[name].reshape(-1)
            for ranks in self.sets[name]:
                positions, _ = self.layouts[ranks[0]].pieces[name].select(td.indices)
                if not positions.size:
                    continue
                idx = td.indices[positions]
                new = flat[idx]
                change = fingerprint_change(idx, new - td.delta[positions], new)
                change = -change if undo else change
                for i in ranks:
                    out[i][name] = (out[i][name] + change) & _MASK64
        return out

    def combine(self, partials: Sequence[Mapping[str, int]], *, names: Sequence[str] | None = None) -> dict[str, int]:
        """Each tensor's fingerprint from the ranks' ``partials`` (one mapping per rank):
        the owners' sum. Every member of a replica set must report what its owner does
        (``VerificationFailed`` naming the rank otherwise)."""
        if len(partials) != len(self.layouts):
            raise InvalidInput(f"{len(partials)} ranks' partials for {len(self.layouts)} ranks")
        out: dict[str, int] = {}
        for name in self.sets if names is None else names:
            total = 0
            for ranks in self.sets[name]:
                values = [partials[i].get(name) for i in ranks]
                first = values[0]
                if first is None or any(v != first for v in values):
                    bad = [self.layouts[i].key for i, v in zip(ranks, values, strict=True) if v != first or v is None]
                    raise VerificationFailed(
                        f"{name}: ranks {bad} hold other bits than rank {self.layouts[ranks[0]].key} for the same "
                        f"elements ({[None if v is None else format_fingerprint(v) for v in values]})"
                    )
                total += first
            out[name] = total & _MASK64
        return out

    def with_rank(self, expected: Sequence[Mapping[str, int]], key: str, found: Mapping[str, int]) -> dict[str, int]:
        """The fingerprints of tensors ``found`` names if rank ``key`` holds the partials
        ``found`` and every other rank what ``expected`` says: what the engine's copy on
        that rank amounts to (its replica set counted through it)."""
        out: dict[str, int] = {}
        for name, value in found.items():
            if name not in self.sets:
                continue
            total = 0
            for ranks in self.sets[name]:
                mine = [i for i in ranks if self.layouts[i].key == key]
                total += value if mine else expected[ranks[0]][name]
            out[name] = total & _MASK64
        return out


def _check_cover(name: str, spec: TensorSpec, pieces: Sequence[GlobalIndex]) -> None:
    """Distinct pieces of one tensor are disjoint and hold every element."""
    starts = np.concatenate([w.start + np.arange(w.rows, dtype=np.int64) * w.stride for w in pieces])
    ends = np.concatenate([np.full(w.rows, w.run, dtype=np.int64) for w in pieces]) + starts
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    if starts[0] != 0 or ends[-1] != spec.numel or bool(np.any(starts[1:] != ends[:-1])):
        overlap = bool(np.any(starts[1:] < ends[:-1]))
        raise IncompatibleLayout(
            f"{name}: the ranks' pieces {'overlap' if overlap else 'leave elements uncovered'} "
            f"({len(pieces)} distinct pieces of {spec.numel} elements)"
        )


def with_dropped(
    engine: dict[str, int], dropped: frozenset[str], folder: Callable[[], Mapping[str, int]]
) -> dict[str, int]:
    """An engine's full fingerprints: ``engine``'s, and for the tensors the engine drops
    (``dropped``: it never holds them), those of the node's folder (``folder()``, read
    only when some are dropped)."""
    if dropped:
        held = folder()
        engine.update({name: held[name] for name in dropped if name in held})
    return engine
