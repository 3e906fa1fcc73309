"""Hostile shards: every malformation gets a typed error, before any large allocation."""

from __future__ import annotations

import copy
import json
import random
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
from patcher.compression import make_compressor
from patcher.decode import decode, decode_shard, read_shard_header
from patcher.encode import encode
from patcher.format import FIXED_HEADER_SIZE, DecodeLimits
from patcher.patch import Patch, TensorSpec
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
G = DOC["entries"][E]["gaps"]
D = DOC["entries"][E]["deltas"]


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
        (_set(["entries", E, "gaps"], [G[0] + 1, G[1], G[2]]), "tile"),
        (_set(["entries", E, "gaps"], [G[0], G[1] - 1, G[2]]), "tile"),
        (_set(["entries", E, "gaps"], [G[0], G[1], 0]), "gap width 0"),
        (_set(["entries", E, "gaps"], [G[0], G[1], 9]), "gap width 9"),
        (_set(["entries", E, "gaps"], [G[0], G[1], 3]), "gap width 3"),
        (_set(["entries", E, "gaps"], [G[0], 10**30, G[2]]), "gaps must be"),
        (_set(["entries", E, "deltas"], [D[0], D[1], D[2] + 1, D[3]]), "declares"),
        (_set(["entries", E, "deltas"], [D[0], D[1], D[2], 3]), "bad escapes"),
        (_set(["entries", E, "deltas"], [D[0], D[1], 0, D[3]]), "bad escapes"),
        (_set(["entries", E, "deltas"], [D[0], D[1], D[2]]), "list of 4"),
        (lambda d: d["entries"].pop(), "no entry"),
        (lambda d: d["tensors"].pop("layer.0.bias"), "does not describe"),
        (lambda d: d["tensors"][W].pop("dtype"), "lacks ['dtype']"),
        (lambda d: d["entries"][E].pop("stop"), "lacks ['stop']"),
        (lambda d: d.pop("patch"), "lacks ['patch']"),
    ],
)
def test_bad_fields(edit: Callable[[dict[str, Any]], None], why: str) -> None:
    assert why in str(rejected([reforge(edit)]))


def relaid(entries: list[dict[str, Any]]) -> bytes:
    """A shard of DOC's tensors with these entries, streams copied and offsets redone."""
    doc = copy.deepcopy(DOC)
    entries = [copy.deepcopy(e) for e in entries]  # one copy per entry, even a repeated one
    payload = b""
    for e in entries:
        g, d = e["gaps"], e["deltas"]
        streams = PAYLOAD[g[0] : g[0] + g[1]], PAYLOAD[d[0] : d[0] + d[1]]
        e["gaps"] = [len(payload), g[1], g[2]]
        e["deltas"] = [len(payload) + g[1], d[1], d[2], d[3]]
        payload += streams[0] + streams[1]
    doc["entries"] = entries
    return forge(doc, payload)


def test_entry_order_duplicates_and_overlaps() -> None:
    entries = copy.deepcopy(DOC["entries"])
    decode([relaid(copy.deepcopy(entries))])  # the relayer itself is faithful
    assert "out of order" in str(rejected([relaid(entries[::-1])]))
    assert "out of order" in str(rejected([relaid([entries[0], *entries])]))
    # layer.0.weight cut in two ranges that overlap: [0, 3000) and [2000, 4096).
    w = entries[E]
    first = {**w, "stop": 3000}
    second = {**w, "start": 2000}
    assert "overlap" in str(rejected([relaid([*entries[:E], first, second, *entries[E + 1 :]])]))


def test_unknown_dtype_and_bad_names() -> None:
    assert isinstance(rejected([reforge(_set(["tensors", W, "dtype"], "F12"))]), UnsupportedDtype)
    for name in ("../etc/passwd", "a/b", "a\\b", "..", "__init__", "bad\x00name", ""):

        def rename(doc: dict[str, Any], name: str = name) -> None:
            doc["tensors"][name] = doc["tensors"].pop(W)
            for e in doc["entries"]:
                if e["tensor"] == W:
                    e["tensor"] = name
            doc["entries"].sort(key=lambda e: (e["tensor"], e["start"]))

        e = rejected([reforge(rename)])
        assert isinstance(e, InvalidTensorName | FormatError), (name, e)


# -- streams whose bytes lie ---------------------------------------------------------------


def one_entry_shard(
    gaps: bytes,
    deltas: bytes,
    *,
    count: int,
    gap_width: int = 1,
    escapes: int = 0,
    escape_width: int = 0,
    numel: int = 100,
    dtype: str = "U8",
    compress: bool = True,
) -> bytes:
    """A one-tensor shard holding exactly these (raw) gap and delta streams."""
    pack = make_compressor("zstd", 3) if compress else (lambda b: b)
    g, d = pack(gaps), pack(deltas)
    doc = {
        "entries": [
            {
                "count": count,
                "deltas": [len(g), len(d), escapes, escape_width],
                "gaps": [0, len(g), gap_width],
                "start": 0,
                "stop": numel,
                "tensor": "t",
            }
        ],
        "patch": "0" * 64,
        "shard": 0,
        "shards": 1,
        "tensors": {
            "t": {"base": "0" * 15 + "1", "changed": count, "dtype": dtype, "shape": [numel], "target": "0" * 16}
        },
    }
    return forge(doc, g + d)


def test_one_entry_shard_builder_is_valid_up_to_the_patch_id() -> None:
    # Everything but the (deliberately wrong) patch id checks out shard by shard.
    decode_shard(one_entry_shard(bytes([1, 2, 3]), bytes([0b010001]), count=3))


@pytest.mark.parametrize(
    ("gaps", "deltas", "kwargs", "why"),
    [
        (bytes([1, 0, 3]), bytes([0b010001]), {}, "gap of 0"),  # a duplicate index
        (bytes([50, 50, 1]), bytes([0b010001]), {}, "past the entry's end"),
        (bytes([1, 2, 200]), bytes([0b010001]), {}, "larger than the entry's range"),
        (bytes([1, 2, 3, 0, 0, 0]), bytes([0b010001]), {"gap_width": 2, "numel": 1000}, "smallest"),
        (bytes([1, 2, 3]), bytes([0b11010001]), {}, "padding"),
        (bytes([1, 2, 3]), bytes([0b110001]), {}, "escapes"),
        (bytes([1, 2, 3]), bytes([0b110001, 0xFC]), {"escapes": 1, "escape_width": 1}, "outside the element"),
        (bytes([1, 2, 3]), bytes([0b110001, 0x05, 0x00]), {"escapes": 1, "escape_width": 2}, "width"),
    ],
)
def test_streams_that_lie(gaps: bytes, deltas: bytes, kwargs: dict[str, Any], why: str) -> None:
    for compress in (True, False):
        with pytest.raises(FormatError, match=why):
            decode_shard(one_entry_shard(gaps, deltas, count=3, compress=compress, **kwargs))


def test_a_zero_delta_cannot_be_expressed() -> None:
    # Escape value 2**8 - 4 would make zig-zag 256, which wraps to a zero delta on U8.
    shard = one_entry_shard(bytes([1]), bytes([0b11, 0xFC]), count=1, escapes=1, escape_width=1)
    with pytest.raises(FormatError, match="outside the element"):
        decode_shard(shard)


def test_zstd_frames_that_lie() -> None:
    frame = zstandard.ZstdCompressor(level=3).compress(bytes([1, 2, 3, 4]))
    no_size = zstandard.ZstdCompressor(level=3, write_content_size=False).compress(bytes([1, 2, 3]) * 10)
    deltas = make_compressor("zstd", 3)(bytes([0b010001]))
    for gaps in (frame, no_size, frame[:-1], b"\x28\xb5\x2f\xfd" + b"\x00" * 8, b"junk" * 4):
        doc_shard = one_entry_shard(b"", b"", count=3)  # layout only; streams replaced below
        _, stored, _ = split_shard(doc_shard)
        doc = json.loads(stored)
        doc["entries"][0]["gaps"] = [0, len(gaps), 1]
        doc["entries"][0]["deltas"] = [len(gaps), len(deltas), 0, 0]
        with pytest.raises(CorruptData):
            decode_shard(forge(doc, gaps + deltas))


def test_a_stream_longer_than_its_content_is_refused() -> None:
    with pytest.raises(FormatError, match="neither stored nor compressed"):
        decode_shard(one_entry_shard(bytes([1, 2, 3, 4]), bytes([0b010001]), count=3, compress=False))


# -- decompression bombs and allocation caps ------------------------------------------------


def test_bombs_are_refused_before_allocation() -> None:
    huge = 1 << 40
    tiny = make_compressor("zstd", 3)(bytes([1]))
    doc = {
        "entries": [
            {
                "count": 1 << 36,
                "deltas": [len(tiny), len(tiny), 0, 0],
                "gaps": [0, len(tiny), 1],
                "start": 0,
                "stop": huge,
                "tensor": "t",
            }
        ],
        "patch": "0" * 64,
        "shard": 0,
        "shards": 1,
        "tensors": {"t": {"base": "0" * 16, "changed": 1 << 36, "dtype": "U8", "shape": [huge], "target": "1" * 16}},
    }
    shard = forge(doc, tiny + tiny)
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="declares"):
            decode([shard])
        loose = DecodeLimits(max_expansion=1 << 62)
        with pytest.raises(FormatError, match="more than"):
            decode([shard], limits=loose)
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
    assert "disagree" in str(rejected(rebuild(lambda ds: ds[0]["tensors"][W].update(target="e" * 16))))
    assert "patch id" in str(rejected(rebuild(moved_patch)))
    rejected(rebuild(dropped_tensor))
