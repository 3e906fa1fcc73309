"""Hostile shards: every malformation gets a typed error, before any large allocation."""

from __future__ import annotations

import copy
import hashlib
import json
import random
import re
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zstandard

from bulletin.errors import (
    CorruptData,
    FormatError,
    InvalidInput,
    InvalidTensorName,
    UnsupportedDtype,
    UnsupportedFormatVersion,
)
from patcher.apply_shards import apply_shards
from patcher.decode import decode, decode_shard, read_shard_header
from patcher.encode import encode
from patcher.format import FIXED_HEADER_SIZE, STREAM_KINDS, DecodeLimits, canonical_json
from patcher.patch import Patch, TensorSpec
from patcher.streams import encode_deltas, encode_gaps
from tests.patcher.helpers import forge, sparse_delta, split_shard

#: What a hostile shard may raise; anything else is a bug.
REJECTIONS = (CorruptData, UnsupportedDtype, InvalidTensorName)


def rejected(shards: list[bytes], *, limits: DecodeLimits | None = None) -> BaseException:
    """Decode ``shards`` expecting a typed rejection; returns it."""
    try:
        if limits is None:
            decode(shards)
        else:
            decode(shards, limits=limits)
    except REJECTIONS as e:
        return e
    except Exception as e:  # pragma: no cover - the assertion below reports it
        pytest.fail(f"untyped failure {type(e).__name__}: {e}")
    pytest.fail("hostile input was accepted")


def _patch() -> Patch:
    a = TensorSpec("layer.0.weight", "BF16", (64, 64))
    b = TensorSpec("layer.0.bias", "F32", (64,))
    c = TensorSpec("norm.weight", "F16", (64,))
    rng = np.random.default_rng(0)
    ia = np.sort(rng.choice(4096, 300, replace=False)).tolist()
    return Patch(
        {
            a.name: sparse_delta(a, ia, rng.choice([1, 0xFFFF, 2, 0x8000], 300).tolist(), 1, 2),
            b.name: sparse_delta(b, [0, 5, 63], [1, 2, 0xFFFFFFFF], 3, 4),
            c.name: sparse_delta(c, [], [], 5, 5),
        }
    )


PATCH = _patch()
SHARD = encode(PATCH)[0]


def real_doc(shard: bytes) -> tuple[dict[str, Any], bytes]:
    """The decoded JSON header and the payload of a real shard."""
    fixed, stored, payload = split_shard(shard)
    j_len = struct.unpack_from("<I", fixed, 20)[0]
    raw = stored if len(stored) == j_len else zstandard.ZstdDecompressor().decompress(stored)
    return json.loads(raw), payload


DOC, PAYLOAD = real_doc(SHARD)


def reforge(edit: Callable[[dict[str, Any]], None], payload: bytes = PAYLOAD, **fixed: Any) -> bytes:
    doc = copy.deepcopy(DOC)
    edit(doc)
    return forge(doc, payload, **fixed)


def test_the_forger_makes_valid_shards() -> None:
    decode([reforge(lambda d: None)])


def test_truncation_at_every_length() -> None:
    header_end = FIXED_HEADER_SIZE + struct.unpack_from("<I", SHARD, 16)[0]
    for cut in range(len(SHARD)):
        e = rejected([SHARD[:cut]])
        assert isinstance(e, FormatError), (cut, e)
        if cut < header_end:
            with pytest.raises(FormatError):
                read_shard_header(SHARD[:cut])
        else:
            read_shard_header(SHARD[:cut])  # a ranged read of the header is enough


def test_trailing_bytes() -> None:
    for extra in (b"\x00", b"x" * 100):
        assert "trailing" in str(rejected([SHARD + extra]))


def test_every_single_bit_flip_is_caught() -> None:
    rng = random.Random(0)
    positions = list(range(FIXED_HEADER_SIZE * 8)) + rng.sample(range(FIXED_HEADER_SIZE * 8, len(SHARD) * 8), 600)
    for bit in positions:
        data = bytearray(SHARD)
        data[bit // 8] ^= 1 << (bit % 8)
        rejected([bytes(data)])


def test_magic_version_type_and_codec() -> None:
    assert "magic" in str(rejected([b"PK\x03\x04" + SHARD[4:]]))
    assert isinstance(rejected([reforge(lambda d: None, major=2)]), UnsupportedFormatVersion)
    assert isinstance(rejected([reforge(lambda d: None, major=0)]), UnsupportedFormatVersion)
    assert isinstance(rejected([reforge(lambda d: None, codec_id=9)]), UnsupportedFormatVersion)
    assert "file type" in str(rejected([reforge(lambda d: None, file_type=2)]))
    # zstd streams announced as LZ4 do not decode.
    rejected([reforge(lambda d: None, codec_id=2)])


def test_minor_versions_may_add_keys_but_this_one_may_not() -> None:
    def add(d: dict[str, Any]) -> None:
        d["future"] = {"x": 1}
        d["tensors"]["layer.0.bias"]["future"] = 1
        d["entries"][0]["future"] = [1]

    assert "unknown keys" in str(rejected([reforge(add)]))
    newer = decode([reforge(add, minor=1)])
    assert newer.changed_elements == PATCH.changed_elements


@pytest.mark.parametrize(
    ("header", "why"),
    [
        (b"", "impossible"),
        (b"{", "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[" * 100000 + b"]" * 100000, "nested"),
        (b'{"a":1,"a":2}', "duplicate"),
        (b'{"entries":[],"patch":"0","shard":0.5,"shards":1,"tensors":{}}', "non-integer"),
        (b'{"entries":[],"patch":"0","shard":NaN,"shards":1,"tensors":{}}', "non-integer"),
        (b"1" * 5000, "JSON"),
        (b"[]", "object"),
        (b'{ "entries": [] }', "canonical"),
        (b'{"a":"\\ud800"}', "not UTF-8"),
        (b'{"\\udfff":1}', "not UTF-8"),
        (b'{"a":"\\u00e9"}', "canonical"),
    ],
)
def test_bad_json(header: bytes, why: str) -> None:
    assert why in str(rejected([forge(None, b"", header=header)]))


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        node: Any = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _first_entry_of(doc: dict[str, Any], tensor: str) -> int:
    return next(i for i, e in enumerate(doc["entries"]) if e["tensor"] == tensor)


W = "layer.0.weight"
E = _first_entry_of(DOC, W)
B = _first_entry_of(DOC, "layer.0.bias")
S = DOC["streams"]


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (_set(["shards"], 0), "shards must be"),
        (_set(["shards"], 1 << 40), "shards must be"),
        (_set(["shard"], 1), "shard must be"),
        (_set(["shard"], -1), "shard must be"),
        (_set(["shard"], True), "shard must be"),
        (_set(["shard"], "0"), "shard must be"),
        (_set(["patch"], "ABC"), "patch id"),
        (_set(["patch"], 7), "patch id"),
        (_set(["tensors"], []), "tensors must be"),
        (_set(["entries"], {}), "entries must be"),
        (_set(["tensors", W, "shape"], [64, 64, -1]), "shape must be"),
        (_set(["tensors", W, "shape"], [1 << 62, 4]), "too many elements"),
        (_set(["tensors", W, "shape"], [1] * 100), "at most 64"),
        (_set(["tensors", W, "shape"], "64x64"), "shape must be"),
        (_set(["tensors", W, "base"], "XYZ"), "base must be"),
        (_set(["tensors", W, "base"], 12), "base must be"),
        (_set(["tensors", W, "changed"], 299), "more changes than"),
        (_set(["tensors", W, "changed"], 1 << 70), "changed must be"),
        (_set(["tensors", "norm.weight", "target"], "0" * 16), "unchanged, yet"),
        (_set(["tensors", W, "dtype"], 5), "dtype must be"),
        (_set(["entries", E, "count"], 301), "more changes than"),
        (_set(["entries", E, "count"], 10**9), "count must be"),
        (_set(["entries", E, "start"], 1), "hole or overlap"),
        (_set(["entries", E, "stop"], 4097), "stop must be"),
        (_set(["entries", E, "stop"], 4000), "end at 4000"),
        (_set(["entries", E, "tensor"], "nope"), "does not describe"),
        (_set(["entries", E, "delta_escape_width"], 3), "delta_escape_width must be"),
        (_set(["entries", E, "delta_escape_width"], 0), "delta escapes of width 0"),
        (_set(["entries", E, "delta_escapes"], 0), "0 delta escapes"),
        (_set(["entries", E, "delta_escapes"], 301), "delta_escapes must be"),
        (_set(["entries", E, "gap_escapes"], 1), "1 gap escapes of width 0"),
        (
            _set(
                ["entries", E, "gap_escapes"],
                1,
            ),
            "gap escapes",
        ),
        (lambda d: d["entries"][B].update(gap_escapes=1, gap_escape_width=1), "gap escapes impossible"),
        (lambda d: d["entries"][E].update(gap_escapes=1, gap_escape_width=2), "gap escapes impossible"),
        (_set(["streams", "gap_low"], [S["gap_low"][0] + 1, S["gap_low"][1]]), "tile"),
        (_set(["streams", "gap_codes"], [S["gap_codes"][0], S["gap_codes"][1] + 1]), "tile"),
        (_set(["streams", "gap_low"], [0, 10**30]), "must be an integer"),
        (_set(["streams", "delta_codes"], [S["delta_codes"][0]]), "list of 2"),
        (_set(["streams", "delta_escapes"], []), "must list 2 streams"),
        (_set(["streams", "gap_escapes"], [[0, 0]]), "must list 0 streams"),
        (lambda d: d["streams"].pop("gap_codes"), "lacks ['gap_codes']"),
        (lambda d: d["streams"].update(extra=[0, 0]), "unknown keys"),
        (lambda d: d["entries"].pop(), "no entry"),
        (lambda d: d["tensors"].pop("layer.0.bias"), "does not describe"),
        (lambda d: d["tensors"][W].pop("dtype"), "lacks ['dtype']"),
        (lambda d: d["entries"][E].pop("stop"), "lacks ['stop']"),
        (lambda d: d.pop("patch"), "lacks ['patch']"),
    ],
)
def test_bad_fields(edit: Callable[[dict[str, Any]], None], why: str) -> None:
    assert why in str(rejected([reforge(edit)]))


# -- shards assembled by hand: well-formed bytes that say the wrong thing ------------------


def assemble(
    entries: list[tuple[str, int, int, list[int], list[int]]],
    tensors: dict[str, tuple[str, int, int]],
    *,
    raw: dict[str, list[bytes]] | None = None,
    counts: dict[int, dict[str, int]] | None = None,
) -> bytes:
    """A shard of ``entries`` (tensor, start, stop, indices, deltas), streams stored verbatim.

    ``tensors``: name -> (dtype, numel, changed). ``raw`` replaces whole streams by kind;
    ``counts`` overrides entry fields by entry position. Nothing is validated on the way.
    """
    parts: dict[str, list[list[bytes]]] = {kind: [] for kind in STREAM_KINDS}
    docs = []
    for k, (name, start, stop, indices, deltas) in enumerate(entries):
        dtype = tensors[name][0]
        idx = np.array(indices, dtype=np.int64)
        gaps = encode_gaps(idx, start) if indices else None
        dl = encode_deltas(np.array(deltas, dtype=np.uint64).astype(TensorSpec("x", dtype, ()).bits_dtype))
        doc = {
            "count": len(indices),
            "delta_escape_width": len(dl.small.escapes) if indices else 0,
            "delta_escapes": dl.small.escape_count if indices else 0,
            "gap_escape_width": len(gaps.small.escapes) if gaps else 0,
            "gap_escapes": gaps.small.escape_count if gaps else 0,
            "start": start,
            "stop": stop,
            "tensor": name,
        }
        doc.update((counts or {}).get(k, {}))
        docs.append(doc)
        if gaps is not None:
            parts["gap_low"].append([gaps.low])
            parts["gap_codes"].append([gaps.small.codes])
            parts["gap_escapes"].append(gaps.small.escapes)
            parts["delta_codes"].append([dl.small.codes])
            parts["delta_escapes"].append(dl.small.escapes)
    payload = b""
    refs: dict[str, Any] = {}
    for kind in STREAM_KINDS:
        many = kind.endswith("escapes")
        width = max((len(p) for p in parts[kind]), default=0) if many else 1
        streams = (raw or {}).get(kind) or [b"".join(p[j] for p in parts[kind] if len(p) > j) for j in range(width)]
        refs[kind] = []
        for data in streams:
            refs[kind].append([len(payload), len(data)])
            payload += data
        if not many:
            refs[kind] = refs[kind][0]
    doc_tensors = {
        name: {"base": "0" * 15 + "1", "changed": changed, "dtype": dtype, "shape": [numel], "target": "0" * 16}
        for name, (dtype, numel, changed) in tensors.items()
    }
    patch_id = hashlib.sha256(canonical_json(doc_tensors)).hexdigest()  # a consistent set of one
    top = {"entries": docs, "patch": patch_id, "shard": 0, "shards": 1, "streams": refs, "tensors": doc_tensors}
    return forge(top, payload)


T = {"t": ("U8", 100, 3)}


def test_the_assembler_makes_valid_patches() -> None:
    patch = decode([assemble([("t", 0, 100, [3, 50, 99], [1, 255, 7])], T)])
    assert patch.tensors["t"].indices.tolist() == [3, 50, 99]
    assert patch.tensors["t"].delta.tolist() == [1, 255, 7]


def test_entry_order_duplicates_and_overlaps() -> None:
    two = {"t": ("U8", 100, 4)}
    a, b = ("t", 0, 50, [3, 10], [1, 1]), ("t", 50, 100, [60, 70], [1, 1])
    decode_shard(assemble([a, b], two))
    assert "out of order" in str(rejected([assemble([b, a], two)]))
    assert "out of order" in str(rejected([assemble([a, a, b], {"t": ("U8", 100, 6)})]))
    overlapping = ("t", 40, 100, [60, 70], [1, 1])
    assert "overlap" in str(rejected([assemble([a, overlapping], two)]))


@pytest.mark.parametrize(
    ("entry", "options", "why"),
    [
        (("t", 0, 100, [3, 3, 50], [1, 1, 1]), {}, "gap of 0"),  # a duplicate index
        (("t", 0, 100, [50, 40, 99], [1, 1, 1]), {}, "gap escapes impossible"),  # unsorted: a "negative" gap
        (("t", 0, 100, [3, 50, 99], [1, 1, 1]), {"counts": {0: {"stop": 99}}}, "end"),
        (("t", 0, 100, [3, 50, 99], [1, 1, 1]), {"raw": {"gap_low": [bytes([4, 47, 200])]}}, "larger than"),
        (("t", 0, 100, [3, 50, 99], [1, 1, 1]), {"raw": {"gap_low": [bytes([4, 47, 50])]}}, "past the entry's end"),
        (("t", 0, 100, [3, 50, 99], [1, 1, 1]), {"raw": {"delta_codes": [bytes([0b11000101])]}}, "padding"),
        (("t", 0, 100, [3, 50, 99], [1, 1, 1]), {"raw": {"delta_codes": [bytes([0b110101])]}}, "escapes, 0 declared"),
        (("t", 0, 100, [3, 50, 99], [1, 1, 1]), {"raw": {"gap_codes": [bytes([0b010000])]}}, "larger than"),
        (("t", 0, 100, [3, 50, 99], [1, 1, 5]), {"raw": {"delta_escapes": [bytes([0xFC])]}}, "past 254"),
    ],
)
def test_streams_that_lie(entry: tuple[str, int, int, list[int], list[int]], options: dict[str, Any], why: str) -> None:
    shard = assemble([entry], T, **options)
    e = rejected([shard])
    assert why in str(e), e
    # Applied straight from the shard, the same refusal, and the holder is untouched
    # (the compiled path finds some of these mid-entry and undoes what it applied).
    held = {"t": np.arange(100, dtype=np.uint8)}
    with pytest.raises(type(e), match=re.escape(str(e))):
        apply_shards([shard], held, {"t": 1})
    assert held["t"].tolist() == list(range(100))


def test_escape_widths_must_be_the_smallest() -> None:
    wide = {"t": ("U16", 1 << 20, 2)}
    # Two gaps with high parts 4 (escaped as 1) written two bytes wide.
    entry = ("t", 0, 1 << 20, [1023, 2047], [1, 1])
    decode_shard(assemble([entry], wide))
    bad = assemble(
        [entry],
        wide,
        raw={"gap_escapes": [bytes([1, 1]), bytes([0, 0])]},
        counts={0: {"gap_escape_width": 2}},
    )
    assert "not the smallest" in str(rejected([bad]))
    deltas = ("t", 0, 1 << 20, [5, 6], [100, 1])  # zig-zag 200: escaped as 196, one byte
    decode_shard(assemble([deltas], wide))
    bad = assemble(
        [deltas],
        wide,
        raw={"delta_escapes": [bytes([196]), bytes([0])]},
        counts={0: {"delta_escape_width": 2}},
    )
    assert "not the smallest" in str(rejected([bad]))


def test_a_zero_delta_cannot_be_expressed() -> None:
    # An escaped zig-zag of 256 would wrap to a zero delta on U8: refused as out of range.
    shard = assemble([("t", 0, 100, [7], [5])], {"t": ("U8", 100, 1)}, raw={"delta_escapes": [bytes([0xFC])]})
    assert "past 254" in str(rejected([shard]))


def test_zstd_frames_that_lie() -> None:
    entry = ("t", 0, 100, [3, 50, 99], [1, 1, 1])
    for stream in (
        zstandard.ZstdCompressor(level=3).compress(bytes([4, 47, 49, 0])),  # declares 4 bytes, not 3
        zstandard.ZstdCompressor(level=3, write_content_size=False).compress(bytes([4, 47, 49])),
        b"\x28\xb5\x2f",  # a truncated frame
    ):
        e = rejected([assemble([entry], T, raw={"gap_low": [stream]})])
        assert isinstance(e, CorruptData), e
    frame = zstandard.ZstdCompressor(level=3).compress(bytes([1, 2]) * 40)
    shard = assemble([("t", 0, 100, list(range(0, 80)), [1] * 80)], {"t": ("U8", 100, 80)})
    # A valid frame followed by junk, all within the stream's length.
    e = rejected(
        [
            assemble(
                [("t", 0, 100, list(range(0, 80)), [1] * 80)],
                {"t": ("U8", 100, 80)},
                raw={"gap_low": [frame[:-1] + b"\x00\x00"]},
            )
        ]
    )
    assert isinstance(e, CorruptData), e
    del shard


def test_a_stream_longer_than_its_content_is_refused() -> None:
    shard = assemble([("t", 0, 100, [3, 50, 99], [1, 1, 1])], T, raw={"gap_low": [bytes([4, 47, 49, 0])]})
    assert "cannot hold" in str(rejected([shard]))


# -- decompression bombs and allocation caps ------------------------------------------------


def test_bombs_are_refused_before_allocation() -> None:
    # A million changes claimed from 10-byte streams: refused from the header alone.
    junk = [b"\x28\xb5\x2f\xfd" + bytes(6)]
    shard = assemble(
        [("t", 0, 1 << 40, [1], [1])],
        {"t": ("U8", 1 << 40, 1 << 20)},
        raw={"gap_low": junk, "gap_codes": junk, "delta_codes": junk},
        counts={0: {"count": 1 << 20}},
    )
    tracemalloc.start()
    try:
        assert "declares" in str(rejected([shard]))
        loose = DecodeLimits(max_expansion=1 << 62, max_decoded_bytes=1 << 22)
        assert "more than" in str(rejected([shard], limits=loose))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_a_real_bomb_within_the_format_is_held_by_the_limits() -> None:
    # All-ones gaps of a dense tensor compress ~30000x: legal, so only limits stop it.
    n = 1 << 22
    spec = TensorSpec("dense", "U8", (n,))
    from patcher.patch import TensorDelta

    td = TensorDelta(spec, np.arange(n, dtype=np.int64), np.ones(n, np.uint8), 1, 2)
    shard = encode(Patch({"dense": td}))[0]
    assert len(shard) < n // 100
    assert decode([shard]).changed_elements == n
    tracemalloc.start()
    try:
        e = rejected([shard], limits=DecodeLimits(max_decoded_bytes=1 << 20))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "more than" in str(e)
    assert peak < 1 << 20
    assert "cap" in str(rejected([shard], limits=DecodeLimits(max_header_bytes=100)))


def test_fixed_header_lengths() -> None:
    assert "cap" in str(rejected([reforge(lambda d: None, json_length=1 << 31)]))
    assert "impossible" in str(rejected([reforge(lambda d: None, json_length=10)]))
    assert "streams cover" in str(rejected([reforge(lambda d: None, payload_length=len(PAYLOAD) + 1)]))
    rejected([reforge(lambda d: None, payload_length=1 << 63)])


def test_count_caps() -> None:
    assert "at most" in str(rejected([SHARD], limits=DecodeLimits(max_entries=2)))
    assert "at most" in str(rejected([SHARD], limits=DecodeLimits(max_tensors=2)))
    assert "at most" in str(rejected([SHARD], limits=DecodeLimits(max_ndim=1)))
    with pytest.raises(InvalidInput):
        DecodeLimits(max_shards=0)


# -- sets of shards --------------------------------------------------------------------------


SHARDS = encode(PATCH, max_shard_bytes=900)


def test_the_set_must_be_one_whole_patch() -> None:
    assert len(SHARDS) >= 3
    assert "say" in str(rejected(SHARDS[:-1]))
    assert "exactly once" in str(rejected([SHARDS[0], *SHARDS[:-1]]))
    other = encode(
        Patch({**PATCH.tensors, "norm.weight": sparse_delta(PATCH.tensors["norm.weight"].spec, [], [], 6, 6)}),
        max_shard_bytes=900,
    )
    assert "different patches" in str(rejected([*SHARDS[:-1], other[-1]]))
    with pytest.raises(InvalidInput):
        decode([])
    with pytest.raises(InvalidInput):
        decode(SHARD)  # type: ignore[arg-type]
    assert "exceed" in str(rejected(SHARDS, limits=DecodeLimits(max_shards=2)))


def test_coverage_holes_overlaps_and_altered_tensors() -> None:
    docs = [real_doc(s) for s in SHARDS]

    def rebuild(edit: Callable[[list[dict[str, Any]]], None]) -> list[bytes]:
        ds = copy.deepcopy([d for d, _ in docs])
        edit(ds)
        return [forge(d, p) for d, (_, p) in zip(ds, docs, strict=True)]

    def first_split(ds: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
        # The entry that ends a shard in the middle of layer.0.weight.
        for d in ds:
            for e in d["entries"]:
                if e["tensor"] == W and e["stop"] != 4096:
                    return d, e
        raise AssertionError("no split entry")

    def hole(ds: list[dict[str, Any]]) -> None:
        _, e = first_split(ds)
        e["stop"] -= 1

    def moved_patch(ds: list[dict[str, Any]]) -> None:
        for d in ds:
            if W in d["tensors"]:
                d["tensors"][W]["target"] = "f" * 16

    def dropped_tensor(ds: list[dict[str, Any]]) -> None:
        for d in ds:
            d["tensors"].pop("norm.weight", None)
            d["entries"] = [e for e in d["entries"] if e["tensor"] != "norm.weight"]

    rejected(rebuild(hole))

    def disagree(ds: list[dict[str, Any]]) -> None:
        next(d for d in ds if W in d["tensors"])["tensors"][W]["target"] = "e" * 16

    assert "disagree" in str(rejected(rebuild(disagree)))
    assert "patch id" in str(rejected(rebuild(moved_patch)))
    rejected(rebuild(dropped_tensor))
