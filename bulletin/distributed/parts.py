"""Which rank holds which block of which tensor (:func:`plan_layout`).

A rank's piece of a tensor is a block (:mod:`bulletin.blocks`). Blocks of one tensor
from all ranks, duplicates removed (a replicated tensor, or a sub-mesh's replicas),
MUST tile it exactly; :func:`plan_layout` checks that from every rank's description
(O(manifest) gathered), picks one **owner** per distinct block (the rank that diffs it
and keeps its base) and one **writer** per tensor (the rank that encodes the tensor's
patch entries from every owner's changes, sent to it as global indices and deltas).
A tensor whose every block is one run of its flat elements (whole tensors, FSDP2's
``Shard(0)``, Megatron's column splits) needs no writer for its changes: each owner
encodes the entries of its own run (:attr:`Layout.runs`), and the writer only describes
it when nothing changed. Everything here is pure: no collective, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from bulletin.blocks import Block, contiguous_start
from bulletin.errors import IncompatibleLayout
from patcher.encode import TensorPart
from patcher.format import TensorInfo
from patcher.patch import TensorDelta, TensorSpec

__all__ = ["Layout", "RankLayout", "entry_ranges", "plan_layout", "run_parts"]


@dataclass(frozen=True, slots=True)
class RankLayout:
    """What one rank holds: served spec (global shape) and block of every tensor."""

    rank: int
    specs: dict[str, TensorSpec]
    blocks: dict[str, Block]
    aliases: dict[str, str]

    @classmethod
    def whole(cls, rank: int, specs: dict[str, TensorSpec], aliases: dict[str, str]) -> RankLayout:
        """A rank holding every tensor of ``specs`` whole (one process's)."""
        return cls(rank, specs, {name: Block.whole(spec.shape) for name, spec in specs.items()}, aliases)


@dataclass(frozen=True, slots=True)
class Layout:
    """The job's layout: the version's tensors, the owner of every distinct block, and
    each tensor's writer."""

    specs: dict[str, TensorSpec]
    owners: dict[str, list[tuple[int, Block]]]  # name -> (owner rank, block), by offsets
    writers: dict[str, int]
    aliases: dict[str, str]
    #: name -> (owner, first flat index, stop) of each block, in order, for the tensors whose
    #: every block is one run of the tensor's elements: their owners encode their own runs.
    runs: dict[str, tuple[Run, ...]]

    def owned(self, rank: int) -> dict[str, Block]:
        """The blocks ``rank`` owns (diffs, keeps, sends to the tensor's writer)."""
        return {name: block for name, parts in self.owners.items() for owner, block in parts if owner == rank}

    def written(self, rank: int) -> list[str]:
        return sorted(name for name, writer in self.writers.items() if writer == rank)

    def single_owner(self) -> int | None:
        """The rank that owns every tensor whole (a one-rank job's), if one does: it then
        writes the whole keyframe from its own files."""
        ranks = {owner for parts in self.owners.values() for owner, _ in parts}
        if len(ranks) != 1 or any(len(parts) != 1 for parts in self.owners.values()):
            return None
        return ranks.pop()


Run = tuple[int, int, int]  # (owner, first flat index, stop)


def entry_ranges(runs: Sequence[Run], counts: Mapping[int, int], numel: int) -> list[Run]:
    """Where each owner's entries of a tensor lie: ``(owner, start, stop)`` for each run
    of ``runs`` (:attr:`Layout.runs`) whose owner found changes in it (``counts``: owner ->
    changed elements), stretched over the runs without a change after it (the first from
    0, the last to ``numel``), so that the ranges tile ``[0, numel)`` as a patch's entries
    must (docs/FORMAT.md 3.4). Empty when nothing changed: the tensor's writer then
    describes it by one empty entry."""
    busy = [(owner, first) for owner, first, _ in runs if counts.get(owner, 0)]
    stops = [first for _, first in busy[1:]] + [numel] if busy else []
    return [(owner, first if i else 0, stop) for i, ((owner, first), stop) in enumerate(zip(busy, stops, strict=True))]


def run_parts(
    layout: Layout,
    rank: int,
    infos: Mapping[str, TensorInfo],
    counts: Mapping[str, Mapping[int, int]],
    changes: Mapping[str, TensorDelta],
) -> list[TensorPart]:
    """What ``rank`` encodes of the tensors split by runs: its change of each, over its
    :func:`entry_ranges` (``infos``: every tensor's whole change; ``counts``: each
    tensor's changed elements by owner; ``changes``: this rank's, in global indices),
    and one empty entry of each unchanged tensor it writes."""
    parts: list[TensorPart] = []
    for name, runs in layout.runs.items():
        info = infos[name]
        ranges = entry_ranges(runs, counts.get(name, {}), info.spec.numel)
        if not ranges and layout.writers[name] == rank:
            nothing = np.empty(0, np.int64)
            parts.append(TensorPart(info, 0, info.spec.numel, nothing, nothing.astype(info.spec.bits_dtype)))
        for owner, start, stop in ranges:
            if owner == rank:
                parts.append(TensorPart(info, start, stop, changes[name].indices, changes[name].delta))
    return parts


def plan_layout(ranks: Sequence[RankLayout]) -> Layout:
    """The job's layout from every rank's (in rank order); ``IncompatibleLayout`` when
    ranks disagree on a tensor's dtype or shape, or its blocks overlap or leave a gap."""
    specs: dict[str, TensorSpec] = {}
    holders: dict[str, dict[Block, list[int]]] = {}
    aliases: dict[str, str] = {}
    for held in ranks:
        for name, spec in held.specs.items():
            known = specs.setdefault(name, spec)
            if known != spec:
                raise IncompatibleLayout(
                    f"{name}: rank {held.rank} holds it as {spec.dtype} {list(spec.shape)}, "
                    f"another rank as {known.dtype} {list(known.shape)}"
                )
            holders.setdefault(name, {}).setdefault(held.blocks[name], []).append(held.rank)
        for dropped, served in held.aliases.items():
            if aliases.setdefault(dropped, served) != served:
                raise IncompatibleLayout(f"{dropped}: ranks tie it to different tensors")
    for dropped, served in aliases.items():
        if dropped in specs:
            raise IncompatibleLayout(f"{dropped}: tied to {served} on one rank, served on another")
    owners: dict[str, list[tuple[int, Block]]] = {}
    load = [0] * max(1, len(ranks))
    writers: dict[str, int] = {}
    runs: dict[str, tuple[Run, ...]] = {}
    for index, name in enumerate(sorted(specs)):
        blocks = sorted(holders[name].items(), key=lambda item: item[0].offsets)
        for i, (a, _) in enumerate(blocks):
            for b, _ in blocks[i + 1 :]:
                if a.overlaps(b):
                    raise IncompatibleLayout(
                        f"{name}: blocks at {list(a.offsets)} and {list(b.offsets)} overlap on different ranks"
                    )
        covered = sum(block.numel for block, _ in blocks)
        if covered != specs[name].numel:
            raise IncompatibleLayout(f"{name}: its blocks hold {covered} of {specs[name].numel} elements")
        # A block several ranks hold (replicas) is owned by one of them, spread by name.
        owners[name] = [(ranks_of[index % len(ranks_of)], block) for block, ranks_of in blocks]
        # The writer: the least loaded owner (by elements written), so encoding spreads.
        candidates = sorted({rank for rank, _ in owners[name]})
        writer = min(candidates, key=lambda r: (load[r], r))
        load[writer] += specs[name].numel
        writers[name] = writer
        found = [(contiguous_start(block), rank, block.numel) for rank, block in owners[name]]
        ranged = [(start, rank, n) for start, rank, n in found if start is not None]
        if len(ranged) == len(found):
            runs[name] = tuple((rank, start, start + n) for start, rank, n in sorted(ranged))
    return Layout(specs, owners, writers, aliases, runs)
