"""Structure-aware mutations of patch shards, shared by the in-suite and standalone fuzzers.

Plain byte mutations die at the CRC checks, so most mutations here are made *behind*
them: on the decompressed JSON header text, on the parsed header document, or on the
payload, and the shard is then re-sealed with valid checksums. That way the fuzzer
reaches the JSON parser, the field validation, the stream decoders and the
cross-shard checks.
"""

from __future__ import annotations

import json
import random
import struct
import zlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import zstandard

from bulletin.errors import ContextUnavailable, CorruptData, InvalidTensorName, UnsupportedDtype, VerificationFailed
from patcher.apply_shards import apply_shards
from patcher.decode import decode, decode_shard, read_shard_header, shard_views
from patcher.format import DEFAULT_LIMITS, FIXED_HEADER_SIZE, HEADER_CRC_OFFSET, DecodeLimits
from tests.fuzz.seeds import fuzz_base

__all__ = ["REJECTIONS", "check_decoders", "mutate", "seal"]

#: Every way a decoder may refuse input. Anything else escaping is a bug.
REJECTIONS = (CorruptData, UnsupportedDtype, InvalidTensorName)

_TIGHT = DecodeLimits(max_header_bytes=1 << 14, max_entries=64, max_decoded_bytes=1 << 22, max_expansion=1 << 10)
_INTERESTING = [
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    15,
    16,
    255,
    256,
    65535,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    (1 << 63) - 1,
    1 << 64,
    -1,
]


def seal(data: bytes) -> bytes:
    """``data`` with both CRC fields recomputed (lengths taken as they stand)."""
    if len(data) < FIXED_HEADER_SIZE:
        return data
    h_len = struct.unpack_from("<I", data, 16)[0]
    header = data[FIXED_HEADER_SIZE : FIXED_HEADER_SIZE + h_len]
    payload = data[FIXED_HEADER_SIZE + h_len :]
    fixed = bytearray(data[:FIXED_HEADER_SIZE])
    struct.pack_into("<I", fixed, 32, zlib.crc32(payload))
    struct.pack_into("<I", fixed, 36, zlib.crc32(header, zlib.crc32(bytes(fixed[:HEADER_CRC_OFFSET]))))
    return bytes(fixed) + data[FIXED_HEADER_SIZE:]


def _parts(data: bytes) -> tuple[bytearray, bytes, bytes]:
    h_len = struct.unpack_from("<I", data, 16)[0]
    return (
        bytearray(data[:FIXED_HEADER_SIZE]),
        data[FIXED_HEADER_SIZE : FIXED_HEADER_SIZE + h_len],
        data[FIXED_HEADER_SIZE + h_len :],
    )


def _json_text(data: bytes) -> bytes | None:
    fixed, stored, _ = _parts(data)
    j_len = struct.unpack_from("<I", fixed, 20)[0]
    if len(stored) == j_len:
        return stored
    try:
        return zstandard.ZstdDecompressor().decompress(stored, max_output_size=1 << 20)
    except zstandard.ZstdError:
        return None  # an LZ4 header: handled as bytes only


def _with_header(data: bytes, text: bytes) -> bytes:
    """``data`` with its header replaced by ``text`` stored verbatim, re-sealed."""
    fixed, _, payload = _parts(data)
    struct.pack_into("<II", fixed, 16, len(text), len(text))
    struct.pack_into("<Q", fixed, 24, len(payload))
    return seal(bytes(fixed) + text + payload)


def _rand_int(rng: random.Random) -> Any:
    choice = rng.random()
    if choice < 0.6:
        return rng.choice(_INTERESTING)
    if choice < 0.8:
        return rng.randrange(-(1 << 70), 1 << 70)
    return rng.choice([None, True, "x", 1.5, [], {}, "0" * 16, [1, 2, 3], "\ud800", "\u00e9", "a/b", "BF16", "U8"])


def _mutate_doc(rng: random.Random, doc: Any) -> Any:
    """Change, drop or add one value somewhere in a JSON document."""
    path: list[Any] = []
    node = doc
    while isinstance(node, dict | list) and node and rng.random() < 0.8:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append(key)
        node = node[key]
    if not path:
        return _rand_int(rng) if rng.random() < 0.5 else doc
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    op = rng.random()
    if op < 0.55:
        parent[key] = _rand_int(rng)
    elif op < 0.7 and isinstance(parent[key], int) and not isinstance(parent[key], bool):
        parent[key] += rng.choice([-1, 1, -2, 2, 1 << 32])
    elif op < 0.8:
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    elif op < 0.9 and isinstance(parent, list):
        parent.insert(key, parent[key])
    elif isinstance(parent, dict):
        parent[rng.choice(["x", "count", "start", "tensor", "../x", ""])] = _rand_int(rng)
    return doc


def _bytes_op(rng: random.Random, buf: bytearray) -> None:
    if not buf:
        buf.extend(rng.randbytes(rng.randrange(1, 8)))
        return
    op = rng.random()
    i = rng.randrange(len(buf))
    if op < 0.35:
        buf[i] ^= 1 << rng.randrange(8)
    elif op < 0.55:
        buf[i] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)])
    elif op < 0.7:
        del buf[i : i + rng.randrange(1, 16)]
    elif op < 0.85:
        buf[i:i] = rng.randbytes(rng.randrange(1, 16))
    else:
        j = rng.randrange(len(buf))
        buf[i:i] = buf[j : j + rng.randrange(1, 32)]


def mutate(rng: random.Random, seeds: Sequence[bytes]) -> list[bytes]:
    """One mutated set of shards from a random seed shard (or a pair of them)."""
    data = rng.choice(seeds)
    kind = rng.random()
    if kind < 0.15:  # raw bytes, checksums left broken
        buf = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            _bytes_op(rng, buf)
        return [bytes(buf)]
    if kind < 0.3:  # raw bytes, re-sealed: reaches everything behind the CRCs
        buf = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            _bytes_op(rng, buf)
        return [seal(bytes(buf))]
    if kind < 0.45:  # fixed header fields
        buf = bytearray(data)
        offset, fmt = rng.choice([(8, "<H"), (10, "<H"), (12, "<H"), (14, "<H"), (16, "<I"), (20, "<I"), (24, "<Q")])
        value = rng.choice([v for v in _INTERESTING if 0 <= v < 1 << (8 * struct.calcsize(fmt))])
        struct.pack_into(fmt, buf, offset, value)
        return [seal(bytes(buf))]
    text = _json_text(data)
    if text is None or kind < 0.55:  # the payload
        fixed, stored, payload = _parts(data)
        buf = bytearray(payload)
        for _ in range(rng.randrange(1, 4)):
            _bytes_op(rng, buf)
        struct.pack_into("<Q", fixed, 24, len(buf))
        return [seal(bytes(fixed) + stored + bytes(buf))]
    if kind < 0.7:  # the JSON text
        buf = bytearray(text)
        for _ in range(rng.randrange(1, 4)):
            _bytes_op(rng, buf)
        return [_with_header(data, bytes(buf))]
    if kind < 0.9:  # the JSON document
        doc = json.loads(text)
        for _ in range(rng.randrange(1, 3)):
            doc = _mutate_doc(rng, doc)
        # Canonical JSON, or its ASCII-escaped twin; lone surrogates become invalid UTF-8.
        dumped = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=rng.random() < 0.2)
        return [_with_header(data, dumped.encode("utf-8", "surrogatepass"))]
    # Sets of shards: duplicates, strangers, a shard missing.
    other = rng.choice(seeds)
    return rng.choice([[data, data], [data, other], [other, data]])


def _holder(shards: list[bytes]) -> tuple[dict[str, Any] | None, dict[str, int]]:
    """The bits a holder of the layout the headers describe has (:func:`fuzz_base`), or
    None when that is too large to hold here, and the base fingerprints it claims."""
    try:
        infos = shard_views(shards, DEFAULT_LIMITS)[2]
    except REJECTIONS:
        return None, {}
    claims = {n: info.base_fingerprint for n, info in infos.items()}
    if sum(info.spec.nbytes for info in infos.values()) > 1 << 24:
        return None, claims
    return {n: fuzz_base(info.spec) for n, info in infos.items()}, claims


def check_decoders(shards: list[bytes], on_bug: Callable[[str, BaseException], None]) -> None:
    """Run every decoder on ``shards``; report anything but a typed rejection.

    Context-coded shards decode against the holder's bits (:func:`fuzz_base`, claimed to
    be the base, which the seeds coded against them are); without them, or in a single
    shard whose tensors it does not describe, ``ContextUnavailable`` is a refusal too.
    """
    base, claims = _holder(shards)
    runs: list[tuple[str, Callable[[], object]]] = [
        ("decode", lambda: decode(shards, base=base, base_fingerprints=claims)),
        ("decode/tight", lambda: decode(shards, limits=_TIGHT, base=base, base_fingerprints=claims)),
    ]
    for i, data in enumerate(shards):
        runs.append((f"read_shard_header[{i}]", partial(read_shard_header, data)))
        runs.append((f"decode_shard[{i}]", partial(decode_shard, data, base=base, base_fingerprints=claims)))
    for name, run in runs:
        try:
            result = run()
        except (*REJECTIONS, ContextUnavailable):
            continue
        except Exception as e:  # the fuzzer's whole point: nothing else may escape
            on_bug(name, e)
            continue
        if name.startswith("decode") and hasattr(result, "tensors"):
            for td in result.tensors.values():  # an accepted patch is a valid patch
                try:
                    td.validate()
                except Exception as e:
                    on_bug(f"{name}: accepted an invalid patch", e)
    _check_apply_shards(shards, on_bug)


def _check_apply_shards(shards: list[bytes], on_bug: Callable[[str, BaseException], None]) -> None:
    """``apply_shards`` refuses what ``decode`` refuses, and never leaves a change behind.

    The holder has the layout the headers describe and claims their base fingerprints
    over bits that are not the base: a valid patch is applied in full and then fails its
    target check, an invalid one is refused, perhaps mid-entry. Either way every change
    must be undone.
    """
    base, claims = _holder(shards)
    if base is None and claims:
        return  # too large to hold here
    try:
        decode(shards, base=base, base_fingerprints=claims)
        valid = True
    except REJECTIONS:
        valid = False
    except Exception:  # reported by check_decoders
        return
    # Not the base, but of the same classes (the lowest bit differs): a context-coded
    # patch decodes to the same changes, and misses its targets like any other.
    held = {n: np.bitwise_xor(bits, bits.dtype.type(1), out=np.empty_like(bits)) for n, bits in (base or {}).items()}
    before = {n: bits.copy() for n, bits in held.items()}
    try:
        apply_shards(shards, held, claims)
    except REJECTIONS:
        pass
    except VerificationFailed as e:
        if not valid:
            on_bug("apply_shards: shards decode refuses got as far as the target check", e)
    except Exception as e:
        on_bug("apply_shards", e)
        return
    else:
        if not valid:
            on_bug("apply_shards accepted shards decode refuses", AssertionError("accepted"))
        elif any(info.changed for info in shard_views(shards, DEFAULT_LIMITS)[2].values()):
            on_bug("apply_shards: bits that are not the base passed", AssertionError("accepted"))
        return
    if any(bool((held[n] != before[n]).any()) for n in held):
        on_bug("apply_shards left changes behind", AssertionError("not undone"))
