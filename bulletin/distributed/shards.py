"""One patch from many writers: each rank's shards renumbered into the patch's.

Each writer rank encodes the tensors it writes (:func:`patcher.encode.encode`, whole
tensors, every entry of each) into shards that name a patch of those tensors alone.
Once every writer's tensor objects are known (O(manifest), gathered), every rank
computes the whole patch's id (docs/FORMAT.md 3.9) and the shards' places; each writer
then rewrites only its shards' headers (``patch``, ``shard``, ``shards``), payload
untouched. The encoder sizes a header with 20-digit shard numbers, so the rewritten
header is never longer and a shard stays within ``max_shard_bytes``.
"""

from __future__ import annotations

import json
import zlib

from bulletin.errors import InternalError
from patcher.compression import Decompressor, PatchCodec, make_compressor
from patcher.format import (
    CODEC_NAMES,
    FIXED_HEADER,
    FIXED_HEADER_SIZE,
    canonical_json,
    frame_shard,
    header_codec,
)

__all__ = ["renumber"]


def renumber(shard: bytes, patch_id: str, index: int, count: int) -> bytes:
    """``shard`` (as :func:`patcher.encode.encode` wrote it) as shard ``index`` of
    ``count`` of the patch ``patch_id``: the same entries and payload."""
    fields = FIXED_HEADER.unpack_from(shard)
    codec_id, h_len, j_len, p_len = fields[4], fields[5], fields[6], fields[7]
    codec: PatchCodec = CODEC_NAMES[codec_id]
    if codec == "context":  # pragma: no cover - the sharded path writes zstd or lz4
        raise InternalError("context-coded shards are not renumbered")
    stored = memoryview(shard)[FIXED_HEADER_SIZE : FIXED_HEADER_SIZE + h_len]
    doc = json.loads(bytes(Decompressor(header_codec(codec))(stored, j_len, "header")))
    doc["patch"], doc["shard"], doc["shards"] = patch_id, index, count
    payload = bytes(memoryview(shard)[FIXED_HEADER_SIZE + h_len :])
    if len(payload) != p_len or zlib.crc32(payload) != fields[8]:  # pragma: no cover - our own encoder's bytes
        raise InternalError("a shard to renumber is damaged")
    return frame_shard(canonical_json(doc), payload, codec, make_compressor(header_codec(codec), None))
