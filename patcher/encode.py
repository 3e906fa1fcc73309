"""Patch -> shards (docs/FORMAT.md, "Patch shards"). Pure: bytes out, no I/O.

Tensors are laid out in name order; each tensor's element range ``[0, numel)`` is cut
into entries, and entries are packed greedily into shards of at most
``max_shard_bytes``. A shard's JSON size is bounded from above while packing (offsets
counted as ``max_shard_bytes``, the shard index and count at 20 digits, the header
uncompressed), so a finished shard never exceeds the limit. Output is
deterministic: the same patch, codec, level and library versions give the same bytes.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from bulletin.errors import InvalidInput
from patcher.compression import make_compressor
from patcher.format import (
    CODEC_IDS,
    FILE_TYPE_PATCH_SHARD,
    FIXED_HEADER,
    FIXED_HEADER_SIZE,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    HEADER_CRC_OFFSET,
    MAGIC,
    MAX_NUMEL,
    EntryInfo,
    StreamRef,
    TensorInfo,
    canonical_json,
    compute_patch_id,
    tensor_document,
)
from patcher.patch import Patch, TensorDelta
from patcher.streams import pack_deltas, pack_gaps

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "MAX_ENTRY_CHANGED", "encode"]

DEFAULT_MAX_SHARD_BYTES: Final = 64 << 20
#: Changed elements per entry at most: bounds the encoder's temporaries (~20 bytes per
#: element) and gives readers (and the GPU) independent units of work.
MAX_ENTRY_CHANGED: Final = 1 << 20
#: Counted in place of the shard index and count while bounding a header's size: 20
#: digits hold any value below 2**64.
_WIDEST: Final = 10**19


@dataclass(slots=True)
class _Piece:
    """An entry with its compressed streams, before it has a place in a payload."""

    tensor: str
    start: int
    stop: int
    count: int
    gaps: bytes
    gap_width: int
    deltas: bytes
    escapes: int
    escape_width: int

    def json_bound(self, max_offset: int) -> int:
        """Bytes of this entry's JSON (and a comma) once its streams start before ``max_offset``."""
        doc = {
            "count": self.count,
            "deltas": [max_offset, len(self.deltas), self.escapes, self.escape_width],
            "gaps": [max_offset, len(self.gaps), self.gap_width],
            "start": self.start,
            "stop": self.stop,
            "tensor": self.tensor,
        }
        return len(canonical_json(doc)) + 1

    @property
    def stream_bytes(self) -> int:
        return len(self.gaps) + len(self.deltas)


@dataclass(slots=True)
class _Shard:
    pieces: list[_Piece] = field(default_factory=list)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    bound: int = 0  # upper bound of the shard's size so far


def _empty_header_bound() -> int:
    w = _WIDEST
    doc = {"entries": [], "patch": "0" * 64, "shard": w, "shards": w, "tensors": {}}
    return FIXED_HEADER_SIZE + len(canonical_json(doc))


def _tensor_json_bound(info: TensorInfo) -> int:
    return len(canonical_json({info.spec.name: tensor_document(info)})) - 2 + 1


class _Packer:
    def __init__(self, max_shard_bytes: int) -> None:
        self.max = max_shard_bytes
        self.done: list[_Shard] = []
        self.current = _Shard(bound=_empty_header_bound())

    def room(self, info: TensorInfo, piece: _Piece) -> int:
        """Stream bytes that ``piece`` may take in the current shard."""
        extra = piece.json_bound(self.max)
        if info.spec.name not in self.current.tensors:
            extra += _tensor_json_bound(info)
        return self.max - self.current.bound - extra

    def add(self, info: TensorInfo, piece: _Piece) -> None:
        shard = self.current
        shard.bound += piece.json_bound(self.max) + piece.stream_bytes
        if info.spec.name not in shard.tensors:
            shard.bound += _tensor_json_bound(info)
            shard.tensors[info.spec.name] = info
        shard.pieces.append(piece)

    def is_empty(self) -> bool:
        return not self.current.pieces

    def close(self) -> None:
        self.done.append(self.current)
        self.current = _Shard(bound=_empty_header_bound())

    def finish(self, patch_id: str, codec: str, compress: Callable[[bytes], bytes]) -> list[bytes]:
        if self.current.pieces or not self.done:
            self.done.append(self.current)
        n = len(self.done)
        return [_serialise(s, i, n, patch_id, codec, compress) for i, s in enumerate(self.done)]


def _serialise(
    shard: _Shard, index: int, count: int, patch_id: str, codec: str, compress: Callable[[bytes], bytes]
) -> bytes:
    entries: list[dict[str, object]] = []
    streams: list[bytes] = []
    offset = 0
    for p in shard.pieces:
        gaps = StreamRef(offset, len(p.gaps))
        deltas = StreamRef(gaps.end, len(p.deltas))
        offset = deltas.end
        entry = EntryInfo(p.tensor, p.start, p.stop, p.count, gaps, p.gap_width, deltas, p.escapes, p.escape_width)
        entries.append(entry.document())
        streams += (p.gaps, p.deltas)
    doc = {
        "entries": entries,
        "patch": patch_id,
        "shard": index,
        "shards": count,
        "tensors": {name: tensor_document(info) for name, info in shard.tensors.items()},
    }
    header_json = canonical_json(doc)
    # Names and keys repeat, so the JSON shrinks ~5x: for small models it is most of a shard.
    header = compress(header_json)
    payload = b"".join(streams)
    fixed = FIXED_HEADER.pack(
        MAGIC,
        FORMAT_MAJOR,
        FORMAT_MINOR,
        FILE_TYPE_PATCH_SHARD,
        CODEC_IDS[codec],
        len(header),
        len(header_json),
        len(payload),
        zlib.crc32(payload),
        0,
    )
    header_crc = zlib.crc32(header, zlib.crc32(fixed[:HEADER_CRC_OFFSET]))
    return b"".join([fixed[:HEADER_CRC_OFFSET], header_crc.to_bytes(4, "little"), header, payload])


def _infos(patch: Patch) -> dict[str, TensorInfo]:
    infos: dict[str, TensorInfo] = {}
    for name in sorted(patch.tensors):
        td = patch.tensors[name]
        if not isinstance(td, TensorDelta):
            raise InvalidInput(f"patch[{name!r}] is not a TensorDelta")
        td.validate()
        if td.spec.numel > MAX_NUMEL:
            raise InvalidInput(f"{name}: {td.spec.numel} elements cannot be indexed by int64")
        if td.changed == 0 and td.base_fingerprint != td.target_fingerprint:
            raise InvalidInput(f"{name}: unchanged tensor with different base and target")
        infos[name] = TensorInfo(td.spec, td.base_fingerprint, td.target_fingerprint, td.changed)
    return infos


def _piece(td: TensorDelta, pos: int, take: int, start: int, compress: Callable[[bytes], bytes]) -> _Piece:
    end = pos + take
    stop = td.spec.numel if end == td.changed else int(td.indices[end])
    gaps, gap_width = pack_gaps(td.indices[pos:end], start)
    deltas, escapes, escape_width = pack_deltas(td.delta[pos:end])
    return _Piece(
        td.spec.name,
        start,
        stop,
        take,
        compress(gaps),
        gap_width,
        compress(deltas),
        escapes,
        escape_width,
    )


def _too_small(name: str, max_shard_bytes: int) -> InvalidInput:
    return InvalidInput(f"max_shard_bytes={max_shard_bytes} cannot hold one element of {name}")


def _pack_tensor(packer: _Packer, info: TensorInfo, td: TensorDelta, compress: Callable[[bytes], bytes]) -> None:
    name = info.spec.name
    if td.changed == 0:
        empty = _Piece(name, 0, info.spec.numel, 0, b"", 0, b"", 0, 0)
        if packer.room(info, empty) < 0:
            packer.close()  # (an empty shard may take it; else nothing can)
            if packer.room(info, empty) < 0:
                raise _too_small(name, packer.max)
        packer.add(info, empty)
        return
    pos, start = 0, 0
    while pos < td.changed:
        take = min(td.changed - pos, MAX_ENTRY_CHANGED)
        while True:
            piece = _piece(td, pos, take, start, compress)
            room = packer.room(info, piece)
            if piece.stream_bytes <= room:
                break
            if take == 1 or room <= 0:
                # Nothing of this tensor fits in what is left: start a fresh shard.
                if packer.is_empty():
                    raise _too_small(name, packer.max)
                packer.close()
                take = min(td.changed - pos, MAX_ENTRY_CHANGED)
                continue
            # Compressed size is about proportional to the element count; aim under.
            take = max(1, min(take - 1, int(take * room / piece.stream_bytes * 0.9)))
        packer.add(info, piece)
        pos += take
        start = piece.stop


def encode(
    patch: Patch,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    codec: str = "zstd",
    level: int | None = None,
) -> list[bytes]:
    """The shards of ``patch``: self-describing byte strings of at most ``max_shard_bytes``.

    Every tensor of the patch is described (unchanged ones by one empty entry); a large
    tensor may be cut across shards by element range. ``codec`` is ``"zstd"`` (default)
    or ``"lz4"`` (faster to decode, larger); ``level`` overrides the codec's default
    level. An offline patch file is one shard: pass a ``max_shard_bytes`` that fits all.
    Raises ``InvalidInput`` for an invalid patch, codec, level or a limit too small to
    hold a single element.
    """
    compress = make_compressor(codec, level)
    if (
        not isinstance(max_shard_bytes, int)
        or isinstance(max_shard_bytes, bool)
        or max_shard_bytes <= FIXED_HEADER_SIZE
    ):
        raise InvalidInput(f"max_shard_bytes must be an int > {FIXED_HEADER_SIZE}")
    if not isinstance(patch, Patch):
        raise InvalidInput(f"expected a Patch, got {type(patch)}")
    infos = _infos(patch)
    packer = _Packer(max_shard_bytes)
    for name, info in infos.items():
        _pack_tensor(packer, info, patch.tensors[name], compress)
    return packer.finish(compute_patch_id(infos), codec, compress)
