"""A rank's blocks of a patch, from only the shards that change them (:func:`apply_to_blocks`).

A patch shard's streams are compressed whole (FORMAT.md 3.5), so a reader takes a shard
or leaves it. Its header (two small ranges: the fixed header, then the stored header)
names every entry, a tensor's element range and its count of changes; a shard none of
whose entries with changes falls on a block held is never downloaded (a pipeline
stage's blocks are a few tensors of the model, and so of its shards). The others are
downloaded whole (SHA-256 verified) and their changes inside the blocks applied. No
digest covers a header read by ranges: one that lies makes the blocks miss changes,
which the sum of every rank's parts against the manifest's fingerprints finds (the
sharded publisher's check after :meth:`~bulletin.base.PublishedBase.open`).
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numpy.typing import NDArray

from bulletin.blocks import Block, block_span, local_indices
from bulletin.errors import FormatError
from bulletin.run import Run
from patcher.decode import decode_shard, read_shard_header
from patcher.format import FIXED_HEADER, FIXED_HEADER_SIZE
from patcher.patch import TensorSpec
from schemas.manifest import ObjectRef, PatchRef

__all__ = ["apply_to_blocks"]


def _changes_blocks(run: Run, obj: ObjectRef, spans: Mapping[str, tuple[int, int]]) -> bool:
    """Whether shard ``obj`` holds a change inside one of ``spans`` (by tensor), from its
    header alone."""
    key = run.key(obj.key)
    head = run.store.get_range(key, 0, FIXED_HEADER_SIZE)
    if len(head) < FIXED_HEADER_SIZE:
        raise FormatError(f"{obj.key}: too short for a patch shard")
    stored = FIXED_HEADER.unpack_from(head)[5]
    if FIXED_HEADER_SIZE + stored > obj.size:
        raise FormatError(f"{obj.key}: a header of {stored} bytes does not fit a shard of {obj.size}")
    header = read_shard_header(head + run.store.get_range(key, FIXED_HEADER_SIZE, FIXED_HEADER_SIZE + stored))
    return any(
        entry.count and entry.tensor in spans and spans[entry.tensor][0] < entry.stop
        and entry.start < spans[entry.tensor][1]
        for entry in header.entries
    )  # fmt: skip


def apply_to_blocks(
    run: Run,
    ref: PatchRef,
    specs: Mapping[str, TensorSpec],
    blocks: Mapping[str, Block],
    writable: Mapping[str, NDArray[np.unsignedinteger]],
    *,
    workers: int,
) -> int:
    """Add patch ``ref``'s changes (of a version of tensors ``specs``) inside ``blocks``
    to their bits ``writable`` (each block's, C order); returns the shards downloaded.
    Headers are read ``workers`` at a time; a shard that holds a tensor otherwise than
    ``specs`` is ``FormatError``."""
    spans = {name: block_span(block) for name, block in blocks.items() if block.numel}
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="bulletin-patch-blocks") as pool:
        needed = list(pool.map(lambda obj: _changes_blocks(run, obj, spans), ref.shards))
    wanted = [obj for obj, keep in zip(ref.shards, needed, strict=True) if keep]
    for obj, data in zip(wanted, run.download(wanted), strict=True):
        shard = decode_shard(data)
        del data
        for name, info in shard.header.tensors.items():
            if name in specs and info.spec != specs[name]:
                raise FormatError(f"{obj.key}: holds tensor {name!r} otherwise than its manifest")
        for entry in shard.entries:
            block = blocks.get(entry.info.tensor)
            if block is None or not entry.indices.size:
                continue
            inside, local = local_indices(block, entry.indices)
            flat = writable[entry.info.tensor].reshape(-1)
            flat[local] += entry.delta[inside]
    return len(wanted)
