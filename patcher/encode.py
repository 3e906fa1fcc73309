"""Patch -> shards (docs/FORMAT.md, "Patch shards"). Pure: bytes out, no I/O.

Tensors are laid out in name order; each tensor's element range ``[0, numel)`` is cut
into entries of at most :data:`MAX_ENTRY_CHANGED` changes, and entries are packed into
shards of at most ``max_shard_bytes``. Within a shard, each kind of bytes (gap low
bytes, gap codes, delta codes, each byte plane of the escapes) forms one stream over all
its entries, so the entropy coder sees long homogeneous runs, with one table each
rather than one per tensor (about 0.1 byte per change less on a 100-tensor model).

Packing estimates each entry's compressed size from the ratio the last shard achieved,
compresses, and gives entries back (or cuts one) when a shard comes out too large. The
size check counts the header uncompressed with the shard index and count at 20 digits,
so the final shard, whose header can only be shorter, never exceeds the limit. Output is
deterministic: the same patch, codec, level and library versions give the same bytes.

:func:`encode_parts` is the same writer for one of several writers of a patch (the
ranks of a sharded trainer): it encodes the ranges of tensors it is given
(:class:`TensorPart`), and the caller numbers every writer's shards into one patch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from patcher.compression import CONTEXT_CODEC, DEFAULT_CODEC, Codec, PatchCodec, check_patch_codec, make_compressor
from patcher.context_encode import encode_context, entries_of
from patcher.diff import checked_bits_view
from patcher.errors import InvalidInput
from patcher.format import (
    FIXED_HEADER_SIZE,
    MAX_NUMEL,
    STREAM_KINDS,
    EntryInfo,
    TensorInfo,
    canonical_json,
    compute_patch_id,
    frame_shard,
    tensor_document,
)
from patcher.patch import Patch, TensorDelta
from patcher.streams import EntryBytes, SmallValues, encode_deltas, encode_gaps

__all__ = [
    "AUTO_RECHECK",
    "CONTEXT_HEADER_LEVEL",
    "DEFAULT_MAX_SHARD_BYTES",
    "MAX_ENTRY_CHANGED",
    "TensorPart",
    "encode",
    "encode_parts",
    "encode_smallest",
]

DEFAULT_MAX_SHARD_BYTES: Final = 64 << 20
#: Changed elements per entry at most: bounds the encoder's temporaries (~20 bytes per
#: element) and the granularity at which shards are filled.
MAX_ENTRY_CHANGED: Final = 1 << 20
#: Written in place of the shard index and count while checking a shard's size: 20
#: digits hold any value below 2**64, so the real header is never longer.
_WIDEST: Final = 10**19
#: An entry's JSON, its name aside, at its longest (all seven integers at 20 digits).
_ENTRY_JSON_BOUND: Final = len(canonical_json(EntryInfo("", *(7 * [_WIDEST])).document())) - 2 + 1
#: First guess of compressed / raw stream bytes; then learnt from each shard built.
_FIRST_RATIO: Final = 0.6
#: zstd level of a context-coded shard's header: its payload is already entropy coded,
#: so the header (mostly names and fingerprints) is a tenth of it, and on a small model
#: its compression is a large share of the encode. On a MiniLM one-step patch (103
#: tensors, 82K changes) level 9 gives 0.946 bytes per change against level 15's 0.942
#: and 3's 0.948, and takes 1 ms against 4 ms (15) of a 36 ms encode, diff included.
CONTEXT_HEADER_LEVEL: Final = 9
#: encode_smallest also encodes with zstd when the context codec takes more than this
#: many bytes per change: on real one-step and folded transitions it takes 0.75-0.94
#: and zstd 1.2-1.4, so one encode is enough; denser or odd patches get both.
AUTO_RECHECK: Final = 1.0

Compress = Callable[[bytes], bytes]


@dataclass(frozen=True, slots=True, eq=False)
class TensorPart:
    """The changes of one tensor inside its element range ``[start, stop)``: what one of
    several writers of a patch encodes of it (docs/FORMAT.md 3.4: the entries of a tensor,
    from every shard of the patch, tile ``[0, numel)``). ``info`` describes the whole
    tensor's change (its fingerprints and changed count over every part), as every shard
    that holds part of it says; ``indices`` (int64, strictly increasing, inside the
    range) and ``delta`` are this part's."""

    info: TensorInfo
    start: int
    stop: int
    indices: NDArray[np.int64]
    delta: NDArray[Any]

    def validate(self) -> None:
        """``InvalidInput`` unless the part is one a reader accepts as its tensor's
        entries of ``[start, stop)``. An unchanged tensor's only part is all of it."""
        info, name, numel = self.info, self.info.spec.name, self.info.spec.numel
        TensorDelta(info.spec, self.indices, self.delta, info.base_fingerprint, info.target_fingerprint).validate()
        if numel > MAX_NUMEL:
            raise InvalidInput(f"{name}: {numel} elements cannot be indexed by int64")
        if info.changed == 0 and info.base_fingerprint != info.target_fingerprint:
            raise InvalidInput(f"{name}: unchanged tensor with different base and target")
        count = int(self.indices.size)
        if count > info.changed:
            raise InvalidInput(f"{name}: a part holds {count} changes of {info.changed}")
        if count == 0:
            if info.changed or (self.start, self.stop) != (0, numel):
                raise InvalidInput(f"{name}: a part without changes must be the whole of an unchanged tensor")
        elif not (0 <= self.start <= int(self.indices[0]) and int(self.indices[-1]) < self.stop <= numel):
            raise InvalidInput(f"{name}: changes outside the part's range [{self.start}, {self.stop})")


@dataclass(slots=True)
class _Piece:
    """An entry and its uncompressed contributions to the shard's streams."""

    part: TensorPart
    #: First change of the entry (index into ``part.indices``).
    pos: int
    entry: EntryInfo
    gaps: EntryBytes
    deltas: EntryBytes

    @property
    def raw_bytes(self) -> int:
        return self.entry.decoded_bytes

    @property
    def json_bytes(self) -> int:
        # Every field but the name is an integer below 2**64: 20 digits at most.
        return len(canonical_json(self.entry.tensor)) + _ENTRY_JSON_BOUND


def _piece(part: TensorPart, pos: int, take: int, start: int) -> _Piece:
    """The entry holding changes ``pos .. pos + take - 1`` of ``part``, from element ``start``."""
    name = part.info.spec.name
    if take == 0:  # an unchanged tensor: one empty entry
        nothing = EntryBytes(b"", SmallValues(b"", []))
        return _Piece(part, 0, EntryInfo(name, part.start, part.stop, 0, 0, 0, 0, 0), nothing, nothing)
    end = pos + take
    stop = part.stop if end == part.indices.size else int(part.indices[end])
    gaps = encode_gaps(part.indices[pos:end], start)
    deltas = encode_deltas(part.delta[pos:end])
    g, d = gaps.small, deltas.small
    entry = EntryInfo(name, start, stop, take, g.escape_count, len(g.escapes), d.escape_count, len(d.escapes))
    return _Piece(part, pos, entry, gaps, deltas)


def _pieces(part: TensorPart) -> list[_Piece]:
    changed = int(part.indices.size)
    if changed == 0:
        return [_piece(part, 0, 0, part.start)]
    out, pos, start = [], 0, part.start
    while pos < changed:
        piece = _piece(part, pos, min(changed - pos, MAX_ENTRY_CHANGED), start)
        out.append(piece)
        pos, start = pos + piece.entry.count, piece.entry.stop
    return out


def _cut(piece: _Piece, keep: int) -> tuple[_Piece, _Piece]:
    """``piece`` as two entries: its first ``keep`` changes, and the rest."""
    e = piece.entry
    head = _piece(piece.part, piece.pos, keep, e.start)
    tail = _piece(piece.part, piece.pos + keep, e.count - keep, head.entry.stop)
    return head, tail


@dataclass(slots=True)
class _Shard:
    """Entries and their compressed streams, sized with a worst-case header."""

    pieces: list[_Piece]
    #: Kind -> compressed streams, in payload order within the kind.
    streams: dict[str, list[bytes]]
    bound: int

    @property
    def payload(self) -> list[bytes]:
        return [data for kind in STREAM_KINDS for data in self.streams[kind]]

    @property
    def payload_bytes(self) -> int:
        return sum(map(len, self.payload))


def _document(shard: _Shard, patch_id: str, index: int, count: int) -> dict[str, object]:
    refs: dict[str, list[list[int]]] = {}
    offset = 0
    for kind in STREAM_KINDS:
        refs[kind] = []
        for data in shard.streams[kind]:
            refs[kind].append([offset, len(data)])
            offset += len(data)
    tensors = {p.part.info.spec.name: p.part.info for p in shard.pieces}
    return {
        "entries": [p.entry.document() for p in shard.pieces],
        "patch": patch_id,
        "shard": index,
        "shards": count,
        # One stream each, or one per escape byte.
        "streams": {k: v if k.endswith("escapes") else v[0] for k, v in refs.items()},
        "tensors": {name: tensor_document(info) for name, info in tensors.items()},
    }


def _planes(parts: list[list[bytes]], compress: Compress) -> list[bytes]:
    """An escape kind's streams: stream j joins plane j of every entry that has one."""
    planes = max(map(len, parts), default=0)
    return [compress(b"".join(part[j] for part in parts if len(part) > j)) for j in range(planes)]


def _build(pieces: list[_Piece], compress: Compress) -> _Shard:
    # Each stream joins its part of every entry, in order (FORMAT.md 3.5), read from the
    # entries themselves: no per-entry objects are made for it.
    streams = {
        "gap_low": [compress(b"".join(p.gaps.low for p in pieces))],
        "gap_codes": [compress(b"".join(p.gaps.small.codes for p in pieces))],
        "gap_escapes": _planes([p.gaps.small.escapes for p in pieces], compress),
        "delta_codes": [compress(b"".join(p.deltas.small.codes for p in pieces))],
        "delta_escapes": _planes([p.deltas.small.escapes for p in pieces], compress),
    }
    shard = _Shard(pieces, streams, 0)
    shard.bound = FIXED_HEADER_SIZE + len(canonical_json(_document(shard, "0" * 64, _WIDEST, _WIDEST)))
    shard.bound += shard.payload_bytes
    return shard


def _serialise(shard: _Shard, patch_id: str, index: int, count: int, codec: Codec, compress: Compress) -> bytes:
    header_json = canonical_json(_document(shard, patch_id, index, count))
    return frame_shard(header_json, b"".join(shard.payload), codec, compress)


def _too_small(piece: _Piece, max_shard_bytes: int) -> InvalidInput:
    return InvalidInput(f"max_shard_bytes={max_shard_bytes} cannot hold one element of {piece.entry.tensor}")


def _pack(pieces: Sequence[_Piece], max_shard_bytes: int, compress: Compress) -> list[_Shard]:
    """Greedy, estimate-guided packing; every shard returned is within the limit."""
    pending = deque(pieces)
    shards: list[_Shard] = []
    ratio = _FIRST_RATIO
    base = _build([], compress).bound  # a shard's size with no entries

    described: dict[str, int] = {}  # JSON bytes of each tensor's description

    def estimate(piece: _Piece, names: set[str]) -> int:
        name = piece.part.info.spec.name
        if name not in described:
            described[name] = len(canonical_json({name: tensor_document(piece.part.info)}))
        return int(piece.raw_bytes * ratio) + piece.json_bytes + (0 if name in names else described[name])

    while pending:
        take = [pending.popleft()]
        names = {take[0].part.info.spec.name}
        used = base + estimate(take[0], set())
        while pending and used + (more := estimate(pending[0], names)) <= max_shard_bytes:
            used += more
            names.add(pending[0].part.info.spec.name)
            take.append(pending.popleft())
        while True:
            shard = _build(take, compress)
            if shard.bound <= max_shard_bytes:
                break
            over = shard.bound - max_shard_bytes
            if len(take) > 1:
                # Give back entries from the end until their estimate covers the excess.
                given = 0
                while len(take) > 1 and given < over:
                    given += estimate(take[-1], set())
                    pending.appendleft(take.pop())
                continue
            piece = take[0]
            if piece.entry.count <= 1:
                raise _too_small(piece, max_shard_bytes)
            # Compressed size is about proportional to the changes; aim under.
            keep = max(1, min(piece.entry.count - 1, int(piece.entry.count * max_shard_bytes / shard.bound * 0.9)))
            head, tail = _cut(piece, keep)
            pending.appendleft(tail)
            take = [head]
        raw = sum(p.raw_bytes for p in take)
        if raw:
            ratio = min(1.0, max(0.05, shard.payload_bytes / raw * 1.05))
        shards.append(shard)
    return shards or [_build([], compress)]


def _infos(patch: Patch) -> dict[str, TensorInfo]:
    infos: dict[str, TensorInfo] = {}
    for name in sorted(patch.tensors):
        td = patch.tensors[name]
        if not isinstance(td, TensorDelta):
            raise InvalidInput(f"patch[{name!r}] is not a TensorDelta")
        info = TensorInfo(td.spec, td.base_fingerprint, td.target_fingerprint, td.changed)
        TensorPart(info, 0, td.spec.numel, td.indices, td.delta).validate()  # all of it
        infos[name] = info
    return infos


def encode(
    patch: Patch,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    codec: str = DEFAULT_CODEC,
    level: int | None = None,
    base: Mapping[str, NDArray[Any]] | None = None,
) -> list[bytes]:
    """The shards of ``patch``: self-describing byte strings of at most ``max_shard_bytes``.

    Every tensor of the patch is described (unchanged ones by one empty entry); a large
    tensor may be cut across shards by element range. ``codec`` is ``"zstd"`` (default),
    ``"lz4"`` (faster to decode, larger) or ``"context"`` (docs/FORMAT.md 3.15: smaller,
    coded against the base, which then needs ``base``: every tensor's bits before the
    patch, the arrays it was diffed from; a decoder needs them too). ``level`` overrides
    the compressor's default level (for ``"context"``, that of the zstd header). An
    offline patch file is one shard: pass a ``max_shard_bytes`` that fits all.
    Raises ``InvalidInput`` for an invalid patch, codec, level, base or a limit too
    small to hold a single element.
    """
    name = check_patch_codec(codec)
    if name == CONTEXT_CODEC:
        compress = make_compressor("zstd", CONTEXT_HEADER_LEVEL if level is None else level)
    else:
        compress = make_compressor(name, level)
    _check_max_shard_bytes(max_shard_bytes)
    if not isinstance(patch, Patch):
        raise InvalidInput(f"expected a Patch, got {type(patch)}")
    infos = _infos(patch)
    patch_id = compute_patch_id(infos)
    if name == CONTEXT_CODEC:
        if base is None or not isinstance(base, Mapping):
            raise InvalidInput("the context codec codes against the base: pass base= (each tensor's bits before)")
        entries = [
            ce
            for tensor, info in infos.items()
            for ce in entries_of(
                info,
                checked_bits_view(base.get(tensor), info.spec, "base").reshape(-1),
                patch.tensors[tensor],
                MAX_ENTRY_CHANGED,
            )
        ]
        return encode_context(entries, patch_id, max_shard_bytes, compress)
    parts = [
        TensorPart(info, 0, info.spec.numel, patch.tensors[n].indices, patch.tensors[n].delta)
        for n, info in infos.items()
    ]
    return _shards(parts, patch_id, max_shard_bytes, name, compress)


def _shards(
    parts: Sequence[TensorPart], patch_id: str, max_shard_bytes: int, codec: Codec, compress: Compress
) -> list[bytes]:
    pieces = [piece for part in parts for piece in _pieces(part)]
    shards = _pack(pieces, max_shard_bytes, compress)
    return [_serialise(shard, patch_id, i, len(shards), codec, compress) for i, shard in enumerate(shards)]


def _check_max_shard_bytes(max_shard_bytes: object) -> None:
    if (
        not isinstance(max_shard_bytes, int)
        or isinstance(max_shard_bytes, bool)
        or max_shard_bytes <= FIXED_HEADER_SIZE
    ):
        raise InvalidInput(f"max_shard_bytes must be an int > {FIXED_HEADER_SIZE}")


def encode_parts(
    parts: Sequence[TensorPart],
    patch_id: str,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    codec: str = DEFAULT_CODEC,
    level: int | None = None,
) -> list[bytes]:
    """One writer's shards of a patch that several write: the entries of ``parts``, sorted
    by (tensor, start) with no two of a tensor overlapping, each tensor described as its
    ``info`` says (the whole tensor's change), under ``patch_id`` (:func:`compute_patch_id`
    of every tensor of the whole patch). The shards are numbered ``0 .. n-1`` of ``n``:
    their places among every writer's shards are the caller's to set (it rewrites the
    header: ``patch``, ``shard``, ``shards``), as is that the parts of all writers tile
    every tensor (FORMAT.md 3.4). ``codec`` is ``"zstd"`` or ``"lz4"``: the context codec
    codes whole tensors against their base. Raises ``InvalidInput`` for parts a reader
    would refuse, a context codec, or a limit too small to hold one element.
    """
    name = check_patch_codec(codec)
    if name == CONTEXT_CODEC:
        raise InvalidInput("the context codec codes whole tensors: encode_parts takes zstd or lz4")
    _check_max_shard_bytes(max_shard_bytes)
    previous: TensorPart | None = None
    for part in parts:
        if not isinstance(part, TensorPart):
            raise InvalidInput(f"expected TensorPart objects, got {type(part)}")
        part.validate()
        if previous is not None and (previous.info.spec.name, previous.stop) > (part.info.spec.name, part.start):
            raise InvalidInput(f"{part.info.spec.name}: parts must be sorted by (tensor, start) and not overlap")
        previous = part
    return _shards(parts, patch_id, max_shard_bytes, name, make_compressor(name, level))


def encode_smallest(
    patch: Patch,
    *,
    base: Mapping[str, NDArray[Any]],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> tuple[PatchCodec, list[bytes]]:
    """The smaller of the context codec's and zstd's shards of ``patch``, and its codec
    (context on a tie), encoding with zstd only when the context codec takes more than
    :data:`AUTO_RECHECK` bytes per change."""
    shards = encode(patch, max_shard_bytes=max_shard_bytes, codec=CONTEXT_CODEC, base=base)
    size = sum(map(len, shards))
    if size <= AUTO_RECHECK * max(1, patch.changed_elements):
        return CONTEXT_CODEC, shards
    other = encode(patch, max_shard_bytes=max_shard_bytes, codec="zstd")
    return ("zstd", other) if sum(map(len, other)) < size else (CONTEXT_CODEC, shards)
