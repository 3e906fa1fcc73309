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
from typing import Final

import numpy as np
from numpy.typing import NDArray

from bulletin.blocks import Block, contiguous_start
from bulletin.errors import IncompatibleLayout
from patcher.encode import TensorPart
from patcher.format import TensorInfo
from patcher.patch import TensorDelta, TensorSpec

__all__ = ["Layout", "RankLayout", "plan_layout", "run_parts", "tally", "totals"]

Run = tuple[int, int, int]  # (owner, first flat index, stop)
_MASK64: Final = (1 << 64) - 1


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
    #: (name, owner) -> the run's place among all runs (tensor by tensor, in order).
    run_slots: dict[tuple[str, int], int]

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


def tally(layout: Layout, rank: int, said: Mapping[str, tuple[int, int]]) -> NDArray[np.int64]:
    """``rank``'s share of the one vector every rank adds up (an all-reduce, O(tensors +
    runs / 64) whatever the world size): for each tensor of the layout (by name) the low
    and high 32 bits of its blocks' parts of the fingerprint change and their changed
    count, from ``said`` (name -> (part, changed) of each block the rank owns); then a bit
    per run of :attr:`Layout.runs` (in :attr:`Layout.run_slots` order) set where the run's
    owner found a change. Each bit has one owner, so the sum of the words is their OR."""
    names = sorted(layout.specs)
    where = {name: i for i, name in enumerate(names)}
    runs = len(layout.run_slots)
    vector = np.zeros(3 * len(names) + -(-runs // 64), dtype=np.int64)
    flags = np.zeros(-(-runs // 64) * 64, dtype=np.bool_)
    for name, (part, changed) in said.items():
        i = 3 * where[name]
        vector[i], vector[i + 1], vector[i + 2] = part & 0xFFFFFFFF, part >> 32, changed
        slot = layout.run_slots.get((name, rank))
        if slot is not None and changed:
            flags[slot] = True
    vector[3 * len(names) :] = np.packbits(flags, bitorder="little").view(np.int64)
    return vector


def totals(layout: Layout, summed: NDArray[np.int64]) -> tuple[dict[str, tuple[int, int]], NDArray[np.bool_]]:
    """Every tensor's (fingerprint change, changed count) and every run's flag, from the
    sum of every rank's :func:`tally`."""
    names = sorted(layout.specs)
    sums = summed[: 3 * len(names)].reshape(-1, 3).tolist()
    changes = {name: ((lo + (hi << 32)) & _MASK64, n) for name, (lo, hi, n) in zip(names, sums, strict=True)}
    flags = np.unpackbits(summed[3 * len(names) :].view(np.uint8), bitorder="little").view(np.bool_)
    return changes, flags[: len(layout.run_slots)]


def run_parts(
    layout: Layout,
    rank: int,
    infos: Mapping[str, TensorInfo],
    busy: NDArray[np.bool_],
    changes: Mapping[str, TensorDelta],
) -> list[TensorPart]:
    """What ``rank`` encodes of the tensors split by runs (``infos``: every tensor's whole
    change; ``busy``: every run's flag, :func:`totals`; ``changes``: this rank's, in
    global indices): the change of each run it owns where it found one, its entries
    stretched over the runs without a change after it (the first changed run's from 0,
    the last's to ``numel``), so that a tensor's entries from every rank tile ``[0,
    numel)`` as a patch's must (docs/FORMAT.md 3.4); and one empty entry for each
    unchanged tensor it writes."""
    parts: list[TensorPart] = []
    for name, runs in layout.runs.items():
        info = infos[name]
        if info.changed == 0:
            if layout.writers[name] == rank:
                nothing = np.empty(0, np.int64)
                parts.append(TensorPart(info, 0, info.spec.numel, nothing, nothing.astype(info.spec.bits_dtype)))
            continue
        slot = layout.run_slots.get((name, rank))
        if slot is None or not busy[slot]:
            continue
        first = layout.run_slots[(name, runs[0][0])]
        after = np.flatnonzero(busy[slot + 1 : first + len(runs)])
        stop = runs[slot - first + 1 + int(after[0])][1] if after.size else info.spec.numel
        start = runs[slot - first][1] if busy[first:slot].any() else 0
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
    every_run = ((name, owner) for name, tensor in runs.items() for owner, _, _ in tensor)
    slots = {key: slot for slot, key in enumerate(every_run)}
    return Layout(specs, owners, writers, aliases, runs, slots)
