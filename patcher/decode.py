"""Shards -> Patch (docs/FORMAT.md, "Patch shards"). Pure: bytes in, no I/O.

Reading is defensive in a fixed order: fixed header (magic, version, lengths), header
CRC, then the JSON, parsed under a size cap, checked to be canonical and validated
field by field; only then are streams decompressed, each to a size declared up front
and capped. Across shards, everything that can be checked from headers alone (same
patch, shard i of n, exact coverage of every tensor, the patch id) is checked before
any payload is decompressed. Every failure is a ``CorruptData`` (usually its subclass
``FormatError``), ``UnsupportedFormatVersion``, ``UnsupportedDtype`` or
``InvalidTensorName``; nothing else escapes.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from patcher.compression import Decompressor, PatchCodec
from patcher.context import MAX_CLASSES, ClassWindow, check_window
from patcher.context_decode import check_base, coded_payload, decode_changes, resolve
from patcher.errors import (
    CorruptData,
    FormatError,
    InvalidInput,
    UnsupportedFormatVersion,
)
from patcher.fingerprint import parse_fingerprint
from patcher.format import (
    CODEC_NAMES,
    CONTEXT_STREAMS,
    DEFAULT_LIMITS,
    FILE_TYPE_PATCH_SHARD,
    FIXED_HEADER,
    FIXED_HEADER_SIZE,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    HEADER_CRC_OFFSET,
    MAGIC,
    MAX_CHANGES_PER_BYTE,
    MAX_NUMEL,
    MIN_CODED_BYTES,
    STREAM_KINDS,
    ContextEntry,
    DecodeLimits,
    EntryInfo,
    EntryRange,
    ShardHeader,
    Stream,
    TensorInfo,
    canonical_json,
    compute_patch_id,
    entry_parts,
    header_codec,
    stream_sizes,
)
from patcher.patch import Patch, TensorDelta, TensorSpec, check_layout
from patcher.streams import byte_width, decode_deltas, decode_gaps

__all__ = [
    "DecodedEntry",
    "DecodedShard",
    "EntryStreams",
    "check_shard_set",
    "decode",
    "decode_shard",
    "decode_views",
    "entry_streams",
    "read_shard_header",
    "shard_views",
]

_HEX: Final = frozenset("0123456789abcdef")
_TOP_KEYS: Final = frozenset({"entries", "patch", "shard", "shards", "streams", "tensors"})
_STREAM_KEYS: Final = frozenset(STREAM_KINDS)
_TENSOR_KEYS: Final = frozenset({"base", "changed", "dtype", "shape", "target"})
_ENTRY_KEYS: Final = frozenset(
    {"count", "delta_escape_width", "delta_escapes", "gap_escape_width", "gap_escapes", "start", "stop", "tensor"}
)
_CONTEXT_ENTRY_KEYS: Final = frozenset({"classes", "count", "lo", "start", "stop", "tensor"})
_CONTEXT_STREAM_KEYS: Final = frozenset(CONTEXT_STREAMS)
_U64_LIMIT: Final = 1 << 64


@dataclass(frozen=True, slots=True)
class DecodedEntry:
    """One entry of a shard with its decoded arrays (absolute flat indices)."""

    info: EntryRange
    indices: NDArray[np.int64]
    delta: NDArray[np.unsignedinteger]


@dataclass(frozen=True, slots=True)
class DecodedShard:
    """A whole shard, decoded on its own."""

    header: ShardHeader
    entries: tuple[DecodedEntry, ...]


# -- JSON ------------------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise FormatError("header JSON has a duplicate key")
    return out


def _no_floats(text: str) -> object:
    raise FormatError(f"header JSON has a non-integer number {text[:32]!r}")


def _parse_json(raw: memoryview) -> object:
    """The header document, which must be valid UTF-8 JSON in canonical form."""
    try:
        text = bytes(raw).decode("utf-8")
        doc = json.loads(text, object_pairs_hook=_no_duplicates, parse_float=_no_floats, parse_constant=_no_floats)
        # Re-serialising also refuses lone surrogates ("\ud800" escapes): not UTF-8.
        canonical = canonical_json(doc) == raw
    except UnicodeError as e:
        raise FormatError(f"header is not UTF-8: {e}") from None
    except RecursionError:
        raise FormatError("header JSON is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and ints past the digit limit
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"header is not valid JSON: {e}") from None
    if not canonical:
        raise FormatError("header JSON is not in canonical form")
    return doc


def _object(value: object, keys: frozenset[str], newer: bool, what: str) -> dict[str, object]:
    if not isinstance(value, dict):
        raise FormatError(f"{what} must be a JSON object")
    missing = keys - value.keys()
    if missing:
        raise FormatError(f"{what} lacks {sorted(missing)}")
    # A newer minor version may add keys this reader does not know; its own may not.
    if not newer and value.keys() - keys:
        raise FormatError(f"{what} has unknown keys {sorted(value.keys() - keys)[:5]}")
    return value


def _int(value: object, what: str, lo: int = 0, hi: int = _U64_LIMIT - 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise FormatError(f"{what} must be an integer in [{lo}, {hi}], got {value!r}"[:200])
    return value


def _ints(value: object, n: int, what: str) -> list[int]:
    if not isinstance(value, list) or len(value) != n:
        raise FormatError(f"{what} must be a list of {n} integers")
    return [_int(v, what) for v in value]


def _fingerprint(value: object, what: str) -> int:
    if isinstance(value, str):
        try:
            return parse_fingerprint(value)
        except ValueError:
            pass
    raise FormatError(f"{what} must be 16 lowercase hex digits")


# -- header ----------------------------------------------------------------------------


def _tensor_info(name: str, value: object, newer: bool, limits: DecodeLimits) -> TensorInfo:
    doc = _object(value, _TENSOR_KEYS, newer, f"tensor {name!r}")
    shape_doc = doc["shape"]
    if not isinstance(shape_doc, list) or len(shape_doc) > limits.max_ndim:
        raise FormatError(f"{name}: shape must be a list of at most {limits.max_ndim} integers")
    shape = tuple(_int(d, f"{name}: shape", 0, MAX_NUMEL) for d in shape_doc)
    numel = 1
    for d in shape:
        numel *= d
        if numel > MAX_NUMEL:
            raise FormatError(f"{name}: shape {list(shape)} has too many elements for int64")
    dtype = doc["dtype"]
    if not isinstance(dtype, str):
        raise FormatError(f"{name}: dtype must be a string")
    spec = TensorSpec(name, dtype, shape)  # checks the name (InvalidTensorName) and dtype (UnsupportedDtype)
    base = _fingerprint(doc["base"], f"{name}: base")
    target = _fingerprint(doc["target"], f"{name}: target")
    changed = _int(doc["changed"], f"{name}: changed", 0, numel)
    if changed == 0 and base != target:
        raise FormatError(f"{name}: unchanged, yet base and target fingerprints differ")
    return TensorInfo(spec, base, target, changed)


def _entry_range(doc: dict[str, object], tensors: dict[str, TensorInfo]) -> tuple[str, int, int, int]:
    """The (tensor, start, stop, count) of an entry object, every codec's, checked."""
    name = doc["tensor"]
    if not isinstance(name, str) or name not in tensors:
        raise FormatError(f"entry names a tensor the shard does not describe: {name!r}"[:200])
    info = tensors[name]
    numel = info.spec.numel
    start = _int(doc["start"], f"{name}: start", 0, numel)
    stop = _int(doc["stop"], f"{name}: stop", start, numel)
    if stop == start and numel != 0:
        raise FormatError(f"{name}: empty element range [{start}, {stop})")
    count = _int(doc["count"], f"{name}: count", 0, stop - start)
    if count == 0 and (info.changed != 0 or start != 0 or stop != numel):
        raise FormatError(f"{name}: an empty entry must cover a whole unchanged tensor")
    return name, start, stop, count


def _entry(value: object, tensors: dict[str, TensorInfo], newer: bool) -> EntryInfo:
    doc = _object(value, _ENTRY_KEYS, newer, "entry")
    name, start, stop, count = _entry_range(doc, tensors)
    info = tensors[name]
    escapes = []
    for kind, most in (("gap", 8), ("delta", info.spec.width)):
        n = _int(doc[f"{kind}_escapes"], f"{name}: {kind}_escapes", 0, count)
        width = _int(doc[f"{kind}_escape_width"], f"{name}: {kind}_escape_width", 0, most)
        if (n == 0) != (width == 0):
            raise FormatError(f"{name}: {n} {kind} escapes of width {width}")
        escapes += [n, width]
    # A gap's high part is at most (stop - start) >> 8: escapes hold it minus 3.
    most = (stop - start) >> 8
    if escapes[0] and (most < 3 or escapes[1] > byte_width(most - 3)):
        raise FormatError(f"{name}: gap escapes impossible for the range [{start}, {stop})")
    return EntryInfo(name, start, stop, count, *escapes)


def _context_entry(value: object, tensors: dict[str, TensorInfo], newer: bool) -> ContextEntry:
    doc = _object(value, _CONTEXT_ENTRY_KEYS, newer, "entry")
    name, start, stop, count = _entry_range(doc, tensors)
    lo = _int(doc["lo"], f"{name}: lo", 0, MAX_NUMEL)
    classes = _int(doc["classes"], f"{name}: classes", 1, MAX_CLASSES)
    try:
        check_window(tensors[name].spec.dtype, ClassWindow(lo, classes))
    except InvalidInput as e:
        raise FormatError(f"{name}: {e}") from None
    if count == 0 and (lo, classes) != (0, 1):
        raise FormatError(f"{name}: an empty entry has class window lo 0, 1 class")
    return ContextEntry(name, start, stop, count, lo, classes)


def _streams(
    doc: dict[str, object], entries: list[EntryInfo], payload_length: int, limits: DecodeLimits
) -> dict[str, tuple[Stream, ...]]:
    """The payload's streams, checked to tile it and to promise no decompression bomb."""
    refs = _object(doc["streams"], _STREAM_KEYS, False, "streams")
    sizes = stream_sizes(entries)
    out: dict[str, tuple[Stream, ...]] = {}
    offset = 0
    for kind in STREAM_KINDS:
        listed = refs[kind] if kind.endswith("escapes") else [refs[kind]]
        if not isinstance(listed, list) or len(listed) != len(sizes[kind]):
            raise FormatError(f"streams.{kind} must list {len(sizes[kind])} streams, one per escape byte")
        streams = []
        for value, size in zip(listed, sizes[kind], strict=True):
            start, length = _ints(value, 2, f"streams.{kind}")
            if start != offset:
                raise FormatError(f"streams do not tile the payload: {kind} starts at {start}, expected {offset}")
            if length > size or (length == 0) != (size == 0):
                raise FormatError(f"a {length}-byte {kind} stream cannot hold {size} decoded bytes")
            # Decompression bombs: a stream may not promise more than max_expansion per byte.
            if size > length * limits.max_expansion:
                raise FormatError(f"the {kind} stream declares {size} bytes from {length}")
            streams.append(Stream(start, length, size))
            offset += length
        out[kind] = tuple(streams)
    if offset != payload_length:
        raise FormatError(f"streams cover {offset} bytes of a {payload_length}-byte payload")
    return out


def _context_streams(
    doc: dict[str, object], entries: list[ContextEntry], payload_length: int
) -> dict[str, tuple[Stream, ...]]:
    """A context-coded shard's one stream: the whole payload, empty iff nothing changed."""
    refs = _object(doc["streams"], _CONTEXT_STREAM_KEYS, False, "streams")
    offset, length = _ints(refs["coded"], 2, "streams.coded")
    if offset != 0 or length != payload_length:
        raise FormatError(f"the coded stream [{offset}, +{length}) is not the {payload_length}-byte payload")
    changes = sum(e.count for e in entries)
    # A change costs at least three coded decisions of at least 0.0013 bits each (the
    # most skewed probability the model reaches): fewer bytes cannot hold them.
    if (changes > 0) != (length > 0) or 0 < length < MIN_CODED_BYTES or changes > length * MAX_CHANGES_PER_BYTE:
        raise FormatError(f"a {length}-byte coded stream cannot hold {changes} changes")
    return {"coded": (Stream(0, length, length),)}


def _header(
    doc_value: object, newer: bool, payload_length: int, limits: DecodeLimits, codec: PatchCodec
) -> tuple[str, int, int, dict[str, TensorInfo], tuple[EntryRange, ...], dict[str, tuple[Stream, ...]]]:
    doc = _object(doc_value, _TOP_KEYS, newer, "header")
    patch_id = doc["patch"]
    if not isinstance(patch_id, str) or len(patch_id) != 64 or not set(patch_id) <= _HEX:
        raise FormatError("patch id must be 64 lowercase hex digits")
    count = _int(doc["shards"], "shards", 1, limits.max_shards)
    index = _int(doc["shard"], "shard", 0, count - 1)
    tensors_doc = doc["tensors"]
    if not isinstance(tensors_doc, dict) or len(tensors_doc) > limits.max_tensors:
        raise FormatError(f"tensors must be an object of at most {limits.max_tensors}")
    tensors = {name: _tensor_info(name, v, newer, limits) for name, v in tensors_doc.items()}
    entries_doc = doc["entries"]
    if not isinstance(entries_doc, list) or len(entries_doc) > limits.max_entries:
        raise FormatError(f"entries must be a list of at most {limits.max_entries}")
    entries: list[EntryRange] = []
    decoded = 0
    per_tensor: dict[str, int] = {}
    for value in entries_doc:
        e: EntryRange = _context_entry(value, tensors, newer) if codec == "context" else _entry(value, tensors, newer)
        if entries and (e.tensor, e.start) <= (entries[-1].tensor, entries[-1].start):
            raise FormatError(f"{e.tensor}: entries out of order")
        if entries and e.tensor == entries[-1].tensor and e.start < entries[-1].stop:
            raise FormatError(f"{e.tensor}: entries overlap at {e.start}")
        per_tensor[e.tensor] = per_tensor.get(e.tensor, 0) + e.count
        if per_tensor[e.tensor] > tensors[e.tensor].changed:
            raise FormatError(f"{e.tensor}: entries hold more changes than the tensor has")
        # Decoded streams plus the arrays they become (int64 indices, deltas).
        decoded += e.decoded_bytes + e.count * (8 + tensors[e.tensor].spec.width)
        if decoded > limits.max_decoded_bytes:
            raise FormatError(f"shard would decode to more than {limits.max_decoded_bytes} bytes")
        entries.append(e)
    if per_tensor.keys() != tensors.keys():
        raise FormatError("a tensor is described but has no entry in the shard")
    if codec == "context":
        streams = _context_streams(doc, [e for e in entries if isinstance(e, ContextEntry)], payload_length)
    else:
        streams = _streams(doc, [e for e in entries if isinstance(e, EntryInfo)], payload_length, limits)
    return patch_id, index, count, tensors, tuple(entries), streams


def _view(data: bytes | bytearray | memoryview) -> memoryview:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidInput(f"expected bytes, got {type(data)}")
    view = memoryview(data)
    if not view.contiguous:
        raise InvalidInput("shard bytes must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def read_shard_header(data: bytes | bytearray | memoryview, *, limits: DecodeLimits = DEFAULT_LIMITS) -> ShardHeader:
    """Parse and validate a shard's headers without touching its payload.

    ``data`` needs only the first ``40 + stored header length`` bytes (a ranged read will do).
    """
    view = _view(data)
    if len(view) < FIXED_HEADER_SIZE:
        raise FormatError(f"truncated: {len(view)} bytes, a shard header needs {FIXED_HEADER_SIZE}")
    magic, major, minor, file_type, codec_id, h_len, j_len, p_len, p_crc, h_crc = FIXED_HEADER.unpack_from(view)
    if magic != MAGIC:
        raise FormatError("not a Bulletin patch shard (bad magic bytes)")
    if major != FORMAT_MAJOR:
        raise UnsupportedFormatVersion(f"shard format {major}.{minor}; this reader knows {FORMAT_MAJOR}.x")
    if file_type != FILE_TYPE_PATCH_SHARD:
        raise FormatError(f"file type {file_type} is not a patch shard")
    if codec_id not in CODEC_NAMES:
        raise UnsupportedFormatVersion(f"codec id {codec_id} is unknown to this reader")
    if j_len > limits.max_header_bytes:
        raise FormatError(f"header of {j_len} bytes exceeds the {limits.max_header_bytes} cap")
    if not 0 < h_len <= j_len or j_len > h_len * limits.max_expansion:
        raise FormatError(f"stored header length {h_len} impossible for a {j_len}-byte header")
    if len(view) < FIXED_HEADER_SIZE + h_len:
        raise FormatError(f"truncated: the header needs {FIXED_HEADER_SIZE + h_len} bytes")
    stored = view[FIXED_HEADER_SIZE : FIXED_HEADER_SIZE + h_len]
    if zlib.crc32(stored, zlib.crc32(view[:HEADER_CRC_OFFSET])) != h_crc:
        raise CorruptData("header checksum mismatch")
    codec = CODEC_NAMES[codec_id]
    raw = memoryview(Decompressor(header_codec(codec))(stored, j_len, "header"))
    doc = _parse_json(raw)
    newer = minor > FORMAT_MINOR
    patch_id, index, count, tensors, entries, streams = _header(doc, newer, p_len, limits, codec)
    return ShardHeader(
        major, minor, codec, h_len, j_len, p_len, h_crc, p_crc,
        patch_id, index, count, tensors, entries, streams,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class EntryStreams:
    """One entry's slices of its shard's decompressed streams (patcher.streams decodes them)."""

    info: EntryInfo
    spec: TensorSpec
    low: memoryview
    gap_codes: memoryview
    gap_escapes: list[memoryview]
    delta_codes: memoryview
    delta_escapes: list[memoryview]

    @property
    def what(self) -> str:
        """How errors name the entry."""
        return f"{self.info.tensor}[{self.info.start}:{self.info.stop}]"


def entry_streams(view: memoryview, header: ShardHeader) -> list[EntryStreams]:
    """Every entry's stream slices of a shard whose ``header`` was read from ``view``.

    Checks the shard's size and payload checksum, then decompresses every stream (each to
    its declared size); raises ``FormatError`` / ``CorruptData``.
    """
    if header.codec == "context":
        raise InvalidInput("a context-coded shard has no gap and delta streams (patcher.context_decode)")
    payload = coded_payload(view, header)
    decompress = Decompressor(header.codec)
    data = {
        kind: [
            memoryview(decompress(payload[st.offset : st.end], st.size, f"{kind} stream {j}"))
            for j, st in enumerate(streams)
        ]
        for kind, streams in header.streams.items()
    }
    # Each entry's bytes sit at running positions in every stream it contributes to.
    pos = {kind: [0] * len(streams) for kind, streams in data.items()}

    def take(kind: str, parts: list[int]) -> list[memoryview]:
        out = []
        for j, n in enumerate(parts):
            out.append(data[kind][j][pos[kind][j] : pos[kind][j] + n])
            pos[kind][j] += n
        return out

    out: list[EntryStreams] = []
    for e in header.entries:
        if not isinstance(e, EntryInfo):  # pragma: no cover - codecs 1 and 2 parse to EntryInfo
            raise InvalidInput(f"a {header.codec} shard has no gap and delta streams")
        parts = entry_parts(e)
        low, gap_codes, gap_escapes, delta_codes, delta_escapes = (take(kind, parts[kind]) for kind in STREAM_KINDS)
        spec = header.tensors[e.tensor].spec
        out.append(EntryStreams(e, spec, low[0], gap_codes[0], gap_escapes, delta_codes[0], delta_escapes))
    return out


def _decode_payload(view: memoryview, header: ShardHeader) -> tuple[DecodedEntry, ...]:
    streams = entry_streams(view, header)
    # One allocation each for all the entries' indices and deltas: fewer, larger
    # allocations fault in fewer pages than one per entry.
    index_arena = np.empty(sum(e.count for e in header.entries), dtype=np.int64)
    delta_at = [0]
    for es in streams:
        delta_at.append(delta_at[-1] + -(-es.info.count * es.spec.width // 8) * 8)
    delta_arena = np.empty(delta_at[-1], dtype=np.uint8)
    decoded: list[DecodedEntry] = []
    first = 0
    for es, at in zip(streams, delta_at, strict=False):
        e, spec = es.info, es.spec
        if e.count == 0:
            decoded.append(DecodedEntry(e, np.empty(0, dtype=np.int64), np.empty(0, dtype=spec.bits_dtype)))
            continue
        indices = index_arena[first : first + e.count]
        delta = delta_arena[at : at + e.count * spec.width].view(spec.bits_dtype)
        first += e.count
        decode_gaps(es.low, es.gap_codes, es.gap_escapes, e.count, e.gap_escapes, e.start, e.stop, es.what, out=indices)
        decode_deltas(es.delta_codes, es.delta_escapes, e.count, e.delta_escapes, spec.bits_dtype, es.what, out=delta)
        decoded.append(DecodedEntry(e, indices, delta))
    return tuple(decoded)


def decode_shard(
    data: bytes | bytearray | memoryview,
    *,
    limits: DecodeLimits = DEFAULT_LIMITS,
    base: Mapping[str, NDArray[Any]] | None = None,
    base_fingerprints: Mapping[str, int] | None = None,
) -> DecodedShard:
    """Decode one shard on its own (it need not be the whole patch); a context-coded one
    against ``base`` (see :func:`decode`)."""
    view = _view(data)
    header = read_shard_header(view, limits=limits)
    if header.codec != "context":
        return DecodedShard(header, _decode_payload(view, header))
    entries = [e for e in header.entries if isinstance(e, ContextEntry)]
    bits = check_base(header.tensors, entries, base, base_fingerprints)
    decoded = []
    for changes in decode_changes(view, header):
        found = resolve(changes, header.tensors[changes.entry.tensor].spec.dtype, bits.get(changes.entry.tensor))
        order = np.argsort(found, kind="stable")
        decoded.append(DecodedEntry(changes.entry, found[order], changes.delta[order]))
    return DecodedShard(header, tuple(decoded))


def check_shard_set(headers: Sequence[ShardHeader]) -> dict[str, TensorInfo]:
    """Everything checkable from headers: one patch, shard i of n, exact coverage."""
    first = headers[0]
    if any(h.patch_id != first.patch_id for h in headers):
        raise FormatError("shards belong to different patches")
    if any(h.shard_count != len(headers) for h in headers):
        raise FormatError(f"{len(headers)} shards given, their headers say {first.shard_count}")
    if sorted(h.shard_index for h in headers) != list(range(len(headers))):
        raise FormatError("shard indices are not 0..n-1 exactly once each")
    tensors: dict[str, TensorInfo] = {}
    ranges: dict[str, list[EntryRange]] = {}
    for h in headers:
        for name, info in h.tensors.items():
            if tensors.setdefault(name, info) != info:
                raise FormatError(f"{name}: shards disagree about the tensor")
        for e in h.entries:
            ranges.setdefault(e.tensor, []).append(e)
    if compute_patch_id(tensors) != first.patch_id:
        raise FormatError("patch id does not match the tensors described (missing or altered)")
    for name, info in tensors.items():
        covered, changed = 0, 0
        for e in sorted(ranges[name], key=lambda e: e.start):
            if e.start != covered:
                raise FormatError(f"{name}: elements [{covered}, {e.start}) hole or overlap")
            covered, changed = e.stop, changed + e.count
        if covered != info.spec.numel:
            raise FormatError(f"{name}: entries end at {covered} of {info.spec.numel}")
        if changed != info.changed:
            raise FormatError(f"{name}: entries hold {changed} changes, tensor says {info.changed}")
    return tensors


def shard_views(
    shards: Sequence[bytes | bytearray | memoryview], limits: DecodeLimits
) -> tuple[list[memoryview], list[ShardHeader], dict[str, TensorInfo]]:
    """Views of ``shards``, their headers, and the tensors of the one complete patch they
    form (:func:`check_shard_set`); reads no payload."""
    if isinstance(shards, bytes | bytearray | memoryview) or not isinstance(shards, Sequence):
        raise InvalidInput("decode takes a sequence of shards (a list of bytes)")
    if not shards:
        raise InvalidInput("decode needs at least one shard")
    if len(shards) > limits.max_shards:
        raise FormatError(f"{len(shards)} shards exceed the cap of {limits.max_shards}")
    views = [_view(s) for s in shards]
    headers = [read_shard_header(v, limits=limits) for v in views]
    return views, headers, check_shard_set(headers)


def decode(
    shards: Sequence[bytes | bytearray | memoryview],
    *,
    limits: DecodeLimits = DEFAULT_LIMITS,
    specs: Mapping[str, TensorSpec] | None = None,
    base: Mapping[str, NDArray[Any]] | None = None,
    base_fingerprints: Mapping[str, int] | None = None,
) -> Patch:
    """The patch that ``shards`` (every shard of it, in any order) encode.

    Checks that the shards form one complete patch before decompressing anything.
    ``specs``, if given, is the layout the patch must have (the holder's: names, dtypes,
    shapes; ``IncompatibleTensors`` otherwise), checked from the headers too, so that
    nothing is decompressed or allocated for tensors the holder does not have.

    Context-coded shards (codec ``"context"``) decode against ``base``, every tensor's
    bits before the patch (only read), proven first to be the patch's base: by
    ``base_fingerprints``, the caller's verified record of those bits, or else by
    fingerprinting them (``WrongBase`` when they differ, ``ContextUnavailable``
    without a base). Other codecs ignore ``base``.
    """
    views, headers, tensors = shard_views(shards, limits)
    if specs is not None:
        check_layout({name: info.spec for name, info in tensors.items()}, specs)
    return decode_views(views, headers, tensors, base=base, base_fingerprints=base_fingerprints)


def decode_views(
    views: Sequence[memoryview],
    headers: Sequence[ShardHeader],
    tensors: Mapping[str, TensorInfo],
    *,
    base: Mapping[str, NDArray[Any]] | None = None,
    base_fingerprints: Mapping[str, int] | None = None,
    pending: Patch | None = None,
) -> Patch:
    """The payloads of shards that :func:`shard_views` read the headers of, as a patch.

    Allocates what the headers declare, once: every tensor's ``changed`` indices and
    deltas (validated against its spec: at most ``numel``, equal to its entries' counts),
    in two arrays for the whole patch that each entry decodes into in place, and the
    decompressed streams of one shard at a time. A caller that checked the headers
    against its own layout (``tensors`` against its specs) has thereby bounded it all.

    ``base`` and ``base_fingerprints`` are :func:`decode`'s; ``pending`` is a patch to
    read ``base`` through, as if applied (the fold of the transitions before this one,
    when a node decodes several before it applies once): its base fingerprints must be
    the record of ``base``, its targets this patch's bases.
    """
    context = [e for h in headers for e in h.entries if isinstance(e, ContextEntry)]
    steps = pending.tensors if pending is not None else None
    bits = check_base(tensors, context, base, base_fingerprints, steps) if context else {}
    # Each tensor's changes sit contiguously, in name order; each entry's at the place
    # its predecessors (by start, across shards) leave. Deltas start on 8-byte bounds.
    names = sorted(tensors)
    index_at: dict[str, int] = {}
    delta_at: dict[str, int] = {}
    indices_total = deltas_total = 0
    for name in names:
        info = tensors[name]
        index_at[name], delta_at[name] = indices_total, deltas_total
        indices_total += info.changed
        deltas_total += -(-info.changed * info.spec.width // 8) * 8
    before: dict[tuple[str, int], int] = {}
    by_tensor: dict[str, list[EntryRange]] = {}
    for header in headers:
        for e in header.entries:
            by_tensor.setdefault(e.tensor, []).append(e)
    for name, entries in by_tensor.items():
        done = 0
        for e in sorted(entries, key=lambda e: e.start):
            before[name, e.start] = done
            done += e.count
    index_arena = np.empty(indices_total, dtype=np.int64)
    delta_arena = np.empty(deltas_total, dtype=np.uint8)

    def place(e: EntryRange, spec: TensorSpec) -> tuple[NDArray[np.int64], NDArray[np.unsignedinteger]]:
        first = before[e.tensor, e.start]
        indices = index_arena[index_at[e.tensor] + first : index_at[e.tensor] + first + e.count]
        at = delta_at[e.tensor] + first * spec.width
        return indices, delta_arena[at : at + e.count * spec.width].view(spec.bits_dtype)

    for view, header in zip(views, headers, strict=True):
        if header.codec == "context":
            for changes in decode_changes(view, header):
                e = changes.entry
                if e.count == 0:
                    continue
                spec = tensors[e.tensor].spec
                indices, delta = place(e, spec)
                step = steps.get(e.tensor) if steps is not None else None
                found = resolve(changes, spec.dtype, bits.get(e.tensor), step)
                order = np.argsort(found, kind="stable")
                np.take(found, order, out=indices)
                np.take(changes.delta, order, out=delta)
            continue
        for es in entry_streams(view, header):
            e, spec = es.info, es.spec
            if e.count == 0:
                continue
            indices, delta = place(e, spec)
            decode_gaps(
                es.low, es.gap_codes, es.gap_escapes, e.count, e.gap_escapes, e.start, e.stop, es.what, out=indices
            )
            decode_deltas(
                es.delta_codes, es.delta_escapes, e.count, e.delta_escapes, spec.bits_dtype, es.what, out=delta
            )
    out: dict[str, TensorDelta] = {}
    for name in names:
        info = tensors[name]
        n, width = info.changed, info.spec.width
        indices = index_arena[index_at[name] : index_at[name] + n]
        delta = delta_arena[delta_at[name] : delta_at[name] + n * width].view(info.spec.bits_dtype)
        out[name] = TensorDelta(info.spec, indices, delta, info.base_fingerprint, info.target_fingerprint)
    return Patch(out)
