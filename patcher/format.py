"""Constants and the typed header model of patch shards (docs/FORMAT.md, "Patch shards").

A shard is a 40-byte fixed header, a canonical JSON header and a payload of streams
(gap planes, delta codes, escape planes), each shared by all the shard's entries. This
module holds what both sides of the codec share: the byte layout of the fixed header,
the codec ids, the reader limits, the dataclasses a parsed header becomes, and the
canonical JSON that makes encoding deterministic. Parsing lives in
:mod:`patcher.decode`, writing in :mod:`patcher.encode`.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Final

from patcher.compression import Codec, PatchCodec
from patcher.context import ClassWindow
from patcher.errors import InvalidInput
from patcher.fingerprint import format_fingerprint
from patcher.patch import TensorSpec

__all__ = [
    "CODEC_IDS",
    "CODEC_NAMES",
    "CONTEXT_STREAMS",
    "DEFAULT_LIMITS",
    "FILE_TYPE_PATCH_SHARD",
    "FIXED_HEADER",
    "FIXED_HEADER_SIZE",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "MAGIC",
    "MAX_CHANGES_PER_BYTE",
    "MAX_NUMEL",
    "MIN_CODED_BYTES",
    "STREAM_KINDS",
    "ContextEntry",
    "DecodeLimits",
    "EntryInfo",
    "EntryRange",
    "ShardHeader",
    "Stream",
    "TensorInfo",
    "canonical_json",
    "codes_size",
    "compute_patch_id",
    "entry_parts",
    "frame_shard",
    "header_codec",
    "stream_sizes",
    "tensor_document",
]

#: PNG-style signature: a high byte, a name, then CR LF, ^Z and LF so that any transfer
#: that rewrites line endings or strips the eighth bit is caught on the first read.
MAGIC: Final = b"\x89BLT\r\n\x1a\n"
FORMAT_MAJOR: Final = 1
FORMAT_MINOR: Final = 0
FILE_TYPE_PATCH_SHARD: Final = 1

#: magic, major, minor, file type, codec id, stored header length, JSON header length,
#: payload length, payload CRC-32, header CRC-32; little-endian, no padding.
FIXED_HEADER: Final = struct.Struct("<8sHHHHIIQII")
FIXED_HEADER_SIZE: Final = FIXED_HEADER.size
#: The header CRC covers the fixed header up to (not including) its own field.
HEADER_CRC_OFFSET: Final = FIXED_HEADER_SIZE - 4

#: The id each codec (patcher.compression.PATCH_CODECS) is recorded as in the fixed header.
CODEC_IDS: Final[Mapping[PatchCodec, int]] = {"zstd": 1, "lz4": 2, "context": 3}
CODEC_NAMES: Final[Mapping[int, PatchCodec]] = {v: k for k, v in CODEC_IDS.items()}


def header_codec(codec: PatchCodec) -> Codec:
    """The compressor of a shard's header (and of codecs 1 and 2, its streams): the
    context codec's header is a zstd frame, as codec 1's is."""
    return "zstd" if codec == "context" else codec


#: Indices are int64, so no tensor may have 2**63 elements or more.
MAX_NUMEL: Final = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Caps a reader enforces before it allocates anything a shard asks for.

    The defaults admit any patch this codec writes for models far larger than today's
    (a one-shard offline patch of a 70B model included) and refuse the rest early.
    """

    #: Largest JSON header accepted, in bytes.
    max_header_bytes: int = 16 << 20
    #: Most shards one patch may have.
    max_shards: int = 1 << 16
    #: Most tensors one patch may describe.
    max_tensors: int = 1 << 20
    #: Most entries one shard may hold.
    max_entries: int = 1 << 20
    #: Most dimensions a tensor shape may have.
    max_ndim: int = 64
    #: Most decompressed bytes a stream may declare per compressed byte (zstd's own
    #: ceiling is about 32768; LZ4's about 255).
    max_expansion: int = 1 << 16
    #: Most bytes one shard may make a reader hold: decompressed streams plus the
    #: decoded index and delta arrays.
    max_decoded_bytes: int = 16 << 30

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInput(f"DecodeLimits.{f.name} must be a positive int, got {value!r}")


DEFAULT_LIMITS: Final = DecodeLimits()


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """What every shard that holds part of a tensor says about the whole tensor."""

    spec: TensorSpec
    base_fingerprint: int
    target_fingerprint: int
    #: Changed elements of the tensor over the whole patch (all shards together).
    changed: int


@dataclass(frozen=True, slots=True)
class Stream:
    """A stream of the payload: where it lies, and its size once decoded."""

    offset: int
    #: Bytes in the payload: ``size`` when stored verbatim, fewer when compressed.
    length: int
    #: Bytes once decoded, fixed by the entries (:func:`stream_sizes`).
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    def document(self) -> list[int]:
        return [self.offset, self.length]


def codes_size(count: int) -> int:
    """Bytes of the packed 2-bit delta codes of ``count`` elements."""
    return (count + 3) // 4


@dataclass(frozen=True, slots=True)
class EntryRange:
    """One element range ``[start, stop)`` of a tensor and its number of changes: what
    every codec's entries have in common (coverage is checked on these)."""

    tensor: str
    start: int
    stop: int
    #: Changed elements in ``[start, stop)``.
    count: int

    @property
    def decoded_bytes(self) -> int:
        """Bytes this entry adds to the shard's decoded streams."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class ContextEntry(EntryRange):
    """An entry of a context-coded shard (codec 3): its class window (patcher.context)."""

    #: The exponent of class 0 and the number of classes (FORMAT.md 3.15.2).
    lo: int
    classes: int

    @property
    def window(self) -> ClassWindow:
        return ClassWindow(self.lo, self.classes)

    @property
    def decoded_bytes(self) -> int:
        # One coded stream for every entry: shares of it go by changes (for display).
        return self.count

    def document(self) -> dict[str, object]:
        """The entry's JSON object."""
        return {
            "classes": self.classes,
            "count": self.count,
            "lo": self.lo,
            "start": self.start,
            "stop": self.stop,
            "tensor": self.tensor,
        }


@dataclass(frozen=True, slots=True)
class EntryInfo(EntryRange):
    """An entry of codecs 1 and 2: how many changes, how many escapes."""

    #: Gaps whose high part ``g >> 8`` does not fit a 2-bit code, and their byte width.
    gap_escapes: int
    gap_escape_width: int
    #: Deltas whose ``zigzag - 1`` does not fit a 2-bit code, and their byte width.
    delta_escapes: int
    delta_escape_width: int

    @property
    def decoded_bytes(self) -> int:
        """Bytes this entry adds to the shard's decoded streams."""
        return (
            self.count
            + 2 * codes_size(self.count)
            + self.gap_escapes * self.gap_escape_width
            + self.delta_escapes * self.delta_escape_width
        )

    def document(self) -> dict[str, object]:
        """The entry's JSON object."""
        return {
            "count": self.count,
            "delta_escape_width": self.delta_escape_width,
            "delta_escapes": self.delta_escapes,
            "gap_escape_width": self.gap_escape_width,
            "gap_escapes": self.gap_escapes,
            "start": self.start,
            "stop": self.stop,
            "tensor": self.tensor,
        }


#: The streams of a shard, in payload order; ``*_escapes`` hold one stream per byte.
STREAM_KINDS: Final = ("gap_low", "gap_codes", "gap_escapes", "delta_codes", "delta_escapes")
#: The one stream of a context-coded shard: the range coder's bytes for all its entries.
CONTEXT_STREAMS: Final = ("coded",)
#: A coded stream is empty (no changes) or holds at least the coder's 5 flushed bytes.
MIN_CODED_BYTES: Final = 5
#: Most changes one byte of a coded stream can hold (FORMAT.md 3.15.1): a bound on what a
#: few bytes may make a reader allocate.
MAX_CHANGES_PER_BYTE: Final = 4096


def entry_parts(entry: EntryInfo) -> dict[str, list[int]]:
    """Decoded bytes ``entry`` puts in stream ``j`` of each kind, for the streams it reaches.

    Escape stream ``j`` holds byte ``j`` of the escapes of every entry whose escape
    width exceeds ``j``; the other kinds are one stream each.
    """
    codes = codes_size(entry.count)
    return {
        "gap_low": [entry.count],
        "gap_codes": [codes],
        "gap_escapes": [entry.gap_escapes] * entry.gap_escape_width,
        "delta_codes": [codes],
        "delta_escapes": [entry.delta_escapes] * entry.delta_escape_width,
    }


def stream_sizes(entries: Sequence[EntryInfo]) -> dict[str, list[int]]:
    """Decoded size of every stream of a shard holding ``entries``, by kind."""
    sizes: dict[str, list[int]] = {kind: [] if kind.endswith("escapes") else [0] for kind in STREAM_KINDS}
    for e in entries:
        for kind, parts in entry_parts(e).items():
            total = sizes[kind]
            total.extend([0] * (len(parts) - len(total)))
            for j, n in enumerate(parts):
                total[j] += n
    return sizes


@dataclass(frozen=True, slots=True)
class ShardHeader:
    """A parsed and validated shard header; cheap to get (no payload is read)."""

    major: int
    minor: int
    codec: PatchCodec
    #: Bytes of the header as stored (compressed unless equal to ``json_length``).
    header_length: int
    #: Bytes of the canonical JSON header once decompressed.
    json_length: int
    payload_length: int
    header_crc32: int
    payload_crc32: int
    #: Identity of the whole patch (:func:`compute_patch_id`), equal in all its shards.
    patch_id: str
    shard_index: int
    shard_count: int
    #: Every tensor with at least one entry in this shard, by name.
    tensors: Mapping[str, TensorInfo]
    #: By tensor name, then by start: the order of their data in every stream.
    #: ``EntryInfo`` for codecs 1 and 2, ``ContextEntry`` for the context codec.
    entries: tuple[EntryRange, ...]
    #: Kind (:data:`STREAM_KINDS`, or :data:`CONTEXT_STREAMS`) -> its streams (one, or
    #: one per escape byte).
    streams: Mapping[str, tuple[Stream, ...]]

    @property
    def payload_offset(self) -> int:
        return FIXED_HEADER_SIZE + self.header_length

    @property
    def size(self) -> int:
        """Exact byte size of the shard."""
        return self.payload_offset + self.payload_length

    @property
    def changed(self) -> int:
        """Changed elements carried by this shard."""
        return sum(e.count for e in self.entries)

    def stored_bytes_by_tensor(self) -> dict[str, int]:
        """The payload's bytes shared out among tensors, for display.

        Streams mix all entries, so a tensor's share of each stream is taken in
        proportion to the decoded bytes it put there; the shares add up to the payload.
        """
        out = dict.fromkeys(self.tensors, 0)
        parts = [entry_parts(e) if isinstance(e, EntryInfo) else {"coded": [e.count]} for e in self.entries]
        for kind in self.streams:
            for j, stream in enumerate(self.streams[kind]):
                if stream.size == 0:
                    continue
                given, largest, largest_part = 0, "", -1
                for e, p in zip(self.entries, parts, strict=True):
                    part = p[kind][j] if j < len(p[kind]) else 0
                    share = stream.length * part // stream.size
                    out[e.tensor] += share
                    given += share
                    if part > largest_part:
                        largest, largest_part = e.tensor, part
                out[largest] += stream.length - given  # the rounding, to the largest part
        return out


def canonical_json(document: object) -> bytes:
    """The one serialisation writers emit and readers insist on.

    Sorted keys (by code point), no whitespace, non-ASCII as raw UTF-8, integers only.
    """
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )


def tensor_document(info: TensorInfo) -> dict[str, object]:
    """A tensor's JSON object in a shard header."""
    return {
        "base": format_fingerprint(info.base_fingerprint),
        "changed": info.changed,
        "dtype": info.spec.dtype,
        "shape": list(info.spec.shape),
        "target": format_fingerprint(info.target_fingerprint),
    }


def compute_patch_id(tensors: Mapping[str, TensorInfo]) -> str:
    """SHA-256 (hex) of the canonical JSON object of every tensor of the patch.

    It names the transition (layout, fingerprints before and after, change counts), not
    an encoding of it: the same patch sharded or compressed differently has the same id.
    """
    doc = {name: tensor_document(info) for name, info in tensors.items()}
    return hashlib.sha256(canonical_json(doc)).hexdigest()


def frame_shard(
    header_json: bytes, payload: bytes, codec: PatchCodec, compress_header: Callable[[bytes], bytes]
) -> bytes:
    """A whole shard: the fixed header (3.2), the header stored as ``compress_header``
    makes it (verbatim when that is not shorter), the payload."""
    # Names, keys and shapes repeat: the JSON shrinks ~5x, which matters for small models.
    header = compress_header(header_json)
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
