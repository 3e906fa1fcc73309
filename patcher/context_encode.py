"""Patch -> shards of the context codec (docs/FORMAT.md 3.15). Pure: bytes out, no I/O.

Entries are cut as codec 1 cuts them (tensors in name order, at most
``MAX_ENTRY_CHANGED`` changes each); each gets a class window chosen from its base
(patcher.context.choose_window) and its changes' classes and ranks, computed here or,
for a tensor diffed by patcher.context_diff, taken from its delta. A shard's entries
are range-coded in one stream with one model, so a shard is filled by coding entries
until the next would overflow it (the coder reports how many fit), then coding
exactly those; an entry that does not fit an empty shard is cut in two.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import NDArray

from patcher import native
from patcher.context import ClassWindow, choose_window, class_ranks
from patcher.context_diff import RankedDelta
from patcher.context_model import encode_entry, entry_meta, new_encoder
from patcher.errors import InvalidInput
from patcher.format import (
    FIXED_HEADER_SIZE,
    ContextEntry,
    TensorInfo,
    canonical_json,
    frame_shard,
    tensor_document,
)
from patcher.patch import TensorDelta

__all__ = ["CodedEntry", "code_entries", "encode_context", "entries_of"]

#: Written in place of every number while sizing a header: 20 digits hold any u64.
_WIDEST: Final = 10**19

Compress = Callable[[bytes], bytes]


@dataclass(frozen=True, slots=True)
class CodedEntry:
    """An entry and what the coder codes for it, in index order (the coder codes the
    changes class-major: :meth:`class_major`)."""

    info: TensorInfo
    entry: ContextEntry
    #: The base bits of the whole tensor (flat), the entry's changed indices and their
    #: deltas, classes and ranks.
    base: NDArray[np.unsignedinteger]
    indices: NDArray[np.int64]
    delta: NDArray[np.unsignedinteger]
    classes: NDArray[np.uint8]
    ranks: NDArray[np.int64]

    def class_major(self) -> tuple[NDArray[np.uint8], NDArray[np.int64], NDArray[np.unsignedinteger]]:
        """Classes, ranks and deltas in the order they are coded: by class, stably."""
        order = np.argsort(self.classes, kind="stable")
        return self.classes[order], self.ranks[order], self.delta[order]

    @property
    def window(self) -> ClassWindow:
        return self.entry.window


def _coded(
    info: TensorInfo,
    base: NDArray[np.unsignedinteger],
    start: int,
    stop: int,
    idx: NDArray[np.int64],
    delta: NDArray[np.unsignedinteger],
) -> CodedEntry:
    dtype = info.spec.dtype
    window = choose_window(base, dtype, start, stop, idx)
    classes, ranks = class_ranks(base, dtype, window, start, idx)
    return _entry(info, base, start, stop, idx, delta, window, classes, ranks)


def _entry(
    info: TensorInfo,
    base: NDArray[np.unsignedinteger],
    start: int,
    stop: int,
    idx: NDArray[np.int64],
    delta: NDArray[np.unsignedinteger],
    window: ClassWindow,
    classes: NDArray[np.uint8],
    ranks: NDArray[np.int64],
) -> CodedEntry:
    entry = ContextEntry(info.spec.name, start, stop, int(idx.size), window.lo, window.classes)
    return CodedEntry(info, entry, base, idx, delta, classes, ranks)


def entries_of(info: TensorInfo, base: NDArray[np.unsignedinteger], td: TensorDelta, most: int) -> list[CodedEntry]:
    """A tensor's entries: ``[0, numel)`` cut after every ``most`` changes (the cut falls on
    the first change of the next entry), or one empty entry for an unchanged tensor. A
    :class:`RankedDelta` of one entry gives its window, classes and ranks as they are."""
    numel = info.spec.numel
    indices, delta = td.indices, td.delta
    if indices.size == 0:
        empty = ContextEntry(info.spec.name, 0, numel, 0, 0, 1)
        none = np.empty(0, dtype=np.int64)
        return [CodedEntry(info, empty, base, none, delta, np.empty(0, dtype=np.uint8), none)]
    if isinstance(td, RankedDelta) and indices.size <= most:
        return [_entry(info, base, 0, numel, indices, delta, td.window, td.classes, td.ranks)]
    out, pos, start = [], 0, 0
    while pos < indices.size:
        end = min(indices.size, pos + most)
        stop = numel if end == indices.size else int(indices[end])
        out.append(_coded(info, base, start, stop, indices[pos:end], delta[pos:end]))
        pos, start = end, stop
    return out


def _cut(ce: CodedEntry, keep: int) -> tuple[CodedEntry, CodedEntry]:
    """``ce`` as two entries: its first ``keep`` changes, and the rest."""
    e = ce.entry
    mid = int(ce.indices[keep])
    head = _coded(ce.info, ce.base, e.start, mid, ce.indices[:keep], ce.delta[:keep])
    tail = _coded(ce.info, ce.base, mid, e.stop, ce.indices[keep:], ce.delta[keep:])
    return head, tail


def code_entries(entries: Sequence[CodedEntry], budget: int, costs: Sequence[int]) -> tuple[int, bytes | None]:
    """Range-code ``entries`` as one shard's stream, while it fits: after each entry the
    stream's size bound plus the running sum of ``costs`` must stay within ``budget``.
    Returns ``(len(entries), stream)`` if all fit, else how many did and None."""
    if not any(ce.entry.count for ce in entries):  # nothing changed: an empty stream
        spent = 0
        for i, cost in enumerate(costs):
            spent += cost
            if spent > budget:
                return i, None
        return len(entries), b""
    if native.active():
        return native_code_entries(entries, budget, costs)
    enc = new_encoder()
    spent = 0
    for i, ce in enumerate(entries):
        encode_entry(enc, ce.info.spec.dtype, ce.window, *ce.class_major())
        spent += costs[i]
        if enc.size_bound() + spent > budget:
            return i, None
    return len(entries), enc.finish()


def native_code_entries(entries: Sequence[CodedEntry], budget: int, costs: Sequence[int]) -> tuple[int, bytes | None]:
    """:func:`code_entries` on the compiled coder."""
    meta = entry_meta([ce.entry for ce in entries], [ce.info.spec.dtype for ce in entries], costs)
    classes = np.concatenate([ce.classes for ce in entries])
    ranks = np.concatenate([ce.ranks for ce in entries])
    deltas = b"".join(ce.delta.tobytes() for ce in entries)
    return native.speedups.ctx_encode(meta, classes, ranks, deltas, budget)


def _widest_entry(name: str) -> int:
    return len(canonical_json(ContextEntry(name, *(5 * [_WIDEST])).document())) + 1


def _tensor_cost(info: TensorInfo) -> int:
    return len(canonical_json({info.spec.name: tensor_document(info)})) - 2 + 1


def _document(entries: Sequence[CodedEntry], patch_id: str, index: int, count: int, length: int) -> dict[str, object]:
    return {
        "entries": [ce.entry.document() for ce in entries],
        "patch": patch_id,
        "shard": index,
        "shards": count,
        "streams": {"coded": [0, length]},
        "tensors": {ce.info.spec.name: tensor_document(ce.info) for ce in entries},
    }


def _too_small(ce: CodedEntry, max_shard_bytes: int) -> InvalidInput:
    return InvalidInput(f"max_shard_bytes={max_shard_bytes} cannot hold one element of {ce.entry.tensor}")


def encode_context(
    entries: Sequence[CodedEntry],
    patch_id: str,
    max_shard_bytes: int,
    compress_header: Compress,
) -> list[bytes]:
    """The shards of a patch whose entries (every tensor's, in name order) are ``entries``."""
    base_bytes = FIXED_HEADER_SIZE + len(canonical_json(_document([], "0" * 64, _WIDEST, _WIDEST, _WIDEST)))
    budget = max_shard_bytes - base_bytes
    pending = deque(entries)
    shards: list[tuple[list[CodedEntry], bytes]] = []
    while pending:
        take = list(pending)
        costs = [
            _widest_entry(ce.entry.tensor) + (_tensor_cost(ce.info) if i == 0 or take[i - 1].info is not ce.info else 0)
            for i, ce in enumerate(take)
        ]
        fit, stream = code_entries(take, budget, costs)
        if stream is None:
            if fit == 0:
                first = take[0]
                if first.entry.count <= 1:
                    raise _too_small(first, max_shard_bytes)
                pending.popleft()
                head, tail = _cut(first, first.entry.count // 2)
                pending.appendleft(tail)
                pending.appendleft(head)
                continue
            take, costs = take[:fit], costs[:fit]
            again, stream = code_entries(take, budget, costs)
            if stream is None or again != fit:  # pragma: no cover - coding a prefix is deterministic
                raise InvalidInput("the context coder did not reproduce a shard it sized")
        for _ in take:
            pending.popleft()
        shards.append((take, stream))
    if not shards:  # a patch of no tensors is still one shard
        shards.append(([], b""))
    count = len(shards)
    return [
        frame_shard(
            canonical_json(_document(take, patch_id, i, count, len(stream))), stream, "context", compress_header
        )
        for i, (take, stream) in enumerate(shards)
    ]
