"""Which rank holds which block of which tensor (:func:`plan_layout`).

A rank's piece of a tensor is a block (:mod:`bulletin.blocks`). Blocks of one tensor
from all ranks, duplicates removed (a replicated tensor, or a sub-mesh's replicas),
MUST tile it exactly; :func:`plan_layout` checks that from every rank's description
(O(manifest) gathered), picks one **owner** per distinct block (the rank that diffs it
and keeps its base) and one **writer** per tensor (the rank that encodes the tensor's
patch entries from every owner's changes, sent to it as global indices and deltas).
Everything here is pure: no collective, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bulletin.blocks import Block
from bulletin.errors import IncompatibleLayout
from patcher.patch import TensorSpec

__all__ = ["Layout", "RankLayout", "plan_layout"]


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
    return Layout(specs, owners, writers, aliases)
