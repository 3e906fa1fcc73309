"""The context codec (docs/FORMAT.md 3.15): round trips, both paths, apply, fold, size.

Every test runs on the compiled path and on NumPy alone (tests/patcher/conftest.py);
``test_compiled_and_numpy_write_the_same_bytes`` compares the two within one test.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from numpy.typing import NDArray

from bulletin.errors import ContextUnavailable, FormatError, InvalidInput, VerificationFailed, WrongBase
from patcher import native
from patcher.apply import apply
from patcher.apply_shards import apply_shards
from patcher.decode import decode, decode_shard, read_shard_header
from patcher.diff import diff
from patcher.encode import encode, encode_smallest
from patcher.fingerprint import fingerprint
from patcher.fold import fold
from patcher.format import ContextEntry
from patcher.patch import Patch, TensorSpec
from tests.patcher.helpers import assert_patches_equal, fingerprints, model_cases

Bits = dict[str, NDArray[Any]]


def bf16(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 0.02) -> NDArray[np.uint16]:
    """BF16 bits of N(0, scale) weights (truncated from F32)."""
    w = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
    return (w.view(np.uint32) >> 16).astype(np.uint16)


def adam_step(rng: np.random.Generator, old: NDArray[np.uint16], share: float) -> NDArray[np.uint16]:
    """``old`` with about ``share`` of its elements moved by +-1 ULP, small ones more often
    (as a step of about the learning rate crosses a small ULP more often)."""
    exponent = ((old >> 7) & 0xFF).astype(np.float64)
    p = np.minimum(0.5, share * 2.0 ** (exponent.mean() - exponent))
    flat = old.reshape(-1).copy()
    where = np.flatnonzero(rng.random(flat.size) < p.reshape(-1))
    flat[where] += rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), size=where.size)
    return flat.reshape(old.shape)


def model(seed: int = 0, share: float = 0.004) -> tuple[dict[str, TensorSpec], Bits, Bits]:
    rng = np.random.default_rng(seed)
    shapes = {"layers.0.mlp.weight": (256, 384), "layers.0.mlp.bias": (384,), "embed.weight": (500, 64)}
    old = {n: bf16(rng, s) for n, s in shapes.items()}
    old["norm.weight"] = np.full(64, 0x3F80, dtype=np.uint16)  # 1.0 everywhere: one exponent
    old["step"] = np.array([7], dtype=np.uint64)
    new = {n: adam_step(rng, a, share) for n, a in old.items() if a.dtype == np.uint16}
    new["norm.weight"][:3] += np.uint16(1)
    new["step"] = np.array([8], dtype=np.uint64)
    specs = {n: TensorSpec(n, "U64" if a.dtype == np.uint64 else "BF16", a.shape) for n, a in old.items()}
    return specs, old, new


def the_patch(specs: dict[str, TensorSpec], old: Bits, new: Bits) -> Patch:
    return diff(specs, old, new, base_fingerprints=fingerprints(old))


def test_round_trip_is_exact_and_smaller_than_zstd() -> None:
    specs, old, new = model()
    patch = the_patch(specs, old, new)
    shards = encode(patch, codec="context", base=old)
    assert len(shards) == 1 and read_shard_header(shards[0]).codec == "context"
    assert_patches_equal(decode(shards, base=old), patch)
    zstd = encode(patch)
    assert sum(map(len, shards)) < 0.85 * sum(map(len, zstd))


def test_decode_proves_the_base_before_using_it() -> None:
    specs, old, new = model()
    patch = the_patch(specs, old, new)
    shards = encode(patch, codec="context", base=old)
    with pytest.raises(ContextUnavailable, match="needs the base"):
        decode(shards)
    # Other bits of the same layout: their fingerprint is not the shard's base.
    with pytest.raises(WrongBase, match="not the patch's base"):
        decode(shards, base=new)
    # A holder's record that is not the base is refused the same way.
    with pytest.raises(WrongBase):
        decode(shards, base=old, base_fingerprints=fingerprints(new))
    assert_patches_equal(decode(shards, base=old, base_fingerprints=fingerprints(old)), patch)


def test_apply_shards_decodes_against_the_tensors_it_changes() -> None:
    specs, old, new = model()
    patch = the_patch(specs, old, new)
    shards = encode(patch, codec="context", base=old)
    held = {n: a.copy() for n, a in old.items()}
    result = apply_shards(shards, held, fingerprints(old), threads=1)
    assert result == fingerprints(new)
    for name in specs:
        np.testing.assert_array_equal(held[name], new[name])


def test_apply_to_bits_other_than_the_record_changes_nothing() -> None:
    # The holder's record says "base", its bits are not: the decode runs against the
    # wrong classes, the result misses its targets, and every change is undone.
    specs, old, new = model()
    shards = encode(the_patch(specs, old, new), codec="context", base=old)
    held = {n: a.copy() for n, a in old.items()}
    held["layers.0.mlp.weight"].reshape(-1)[::7] ^= np.uint16(0x0080)  # other exponents
    before = {n: a.copy() for n, a in held.items()}
    with pytest.raises((VerificationFailed, FormatError)):
        apply_shards(shards, held, fingerprints(old), threads=1)
    for name in specs:
        np.testing.assert_array_equal(held[name], before[name])


def test_a_wrong_record_is_refused_before_anything_changes() -> None:
    specs, old, new = model()
    shards = encode(the_patch(specs, old, new), codec="context", base=old)
    held = {n: a.copy() for n, a in old.items()}
    with pytest.raises(WrongBase):
        apply_shards(shards, held, fingerprints(new), threads=1)
    for name in specs:
        np.testing.assert_array_equal(held[name], old[name])


def test_small_shards_cut_entries_and_each_shard_decodes_alone() -> None:
    specs, old, new = model(share=0.02)
    patch = the_patch(specs, old, new)
    shards = encode(patch, codec="context", base=old, max_shard_bytes=700)
    assert len(shards) > 3
    assert all(len(s) <= 700 for s in shards)
    entries = [e for s in shards for e in read_shard_header(s).entries]
    assert all(isinstance(e, ContextEntry) for e in entries)
    assert sum(e.tensor == "layers.0.mlp.weight" for e in entries) > 1  # one tensor, cut by range
    assert_patches_equal(decode(shards[::-1], base=old), patch)
    held = {n: a.copy() for n, a in old.items()}
    apply_shards(shards, held, fingerprints(old), threads=2)
    for name in specs:
        np.testing.assert_array_equal(held[name], new[name])
    one = decode_shard(shards[1], base=old)
    assert sum(d.info.count for d in one.entries) == read_shard_header(shards[1]).changed


def test_a_limit_too_small_for_one_change_is_refused() -> None:
    specs, old, new = model()
    with pytest.raises(InvalidInput, match="cannot hold one element"):
        encode(the_patch(specs, old, new), codec="context", base=old, max_shard_bytes=300)


def test_unchanged_patch_has_an_empty_stream() -> None:
    specs, old, _ = model()
    patch = the_patch(specs, old, old)
    shards = encode(patch, codec="context", base=old)
    assert read_shard_header(shards[0]).payload_length == 0
    assert_patches_equal(decode(shards, base=old), patch)
    assert_patches_equal(decode(shards), patch)  # nothing to decode: no base needed


def test_encode_needs_the_base() -> None:
    specs, old, new = model()
    patch = the_patch(specs, old, new)
    with pytest.raises(InvalidInput, match="base="):
        encode(patch, codec="context")
    wrong_shape = dict(old, **{"embed.weight": old["embed.weight"].reshape(-1)})
    with pytest.raises(InvalidInput):
        encode(patch, codec="context", base=wrong_shape)


def test_a_folded_patch_reencodes_against_its_own_base() -> None:
    rng = np.random.default_rng(5)
    versions = [{"w": bf16(rng, (300, 200))}]
    for _ in range(5):
        versions.append({"w": adam_step(rng, versions[-1]["w"], 0.004)})
    specs = {"w": TensorSpec("w", "BF16", (300, 200))}
    steps = [the_patch(specs, a, b) for a, b in itertools.pairwise(versions)]
    folded = fold(steps)
    shards = encode(folded, codec="context", base=versions[0])
    assert_patches_equal(decode(shards, base=versions[0]), folded)
    held = {"w": versions[0]["w"].copy()}
    apply_shards(shards, held, fingerprints(versions[0]))
    np.testing.assert_array_equal(held["w"], versions[-1]["w"])


def test_decoding_through_pending_changes_matches_decoding_against_their_result() -> None:
    # A node k versions behind decodes transition k against its bits plus the fold of the
    # transitions before it (not applied yet): the same patch as against the real bits.
    from patcher.decode import decode_views, shard_views
    from patcher.format import DEFAULT_LIMITS

    rng = np.random.default_rng(9)
    v0 = {"w": bf16(rng, (200, 100))}
    v1 = {"w": adam_step(rng, v0["w"], 0.01)}
    v2 = {"w": adam_step(rng, v1["w"], 0.01)}
    specs = {"w": TensorSpec("w", "BF16", (200, 100))}
    p1, p2 = the_patch(specs, v0, v1), the_patch(specs, v1, v2)
    shards = encode(p2, codec="context", base=v1)
    views, headers, infos = shard_views(shards, DEFAULT_LIMITS)
    through = decode_views(views, headers, infos, base=v0, base_fingerprints=fingerprints(v0), pending=p1)
    assert_patches_equal(through, p2)
    with pytest.raises(WrongBase):  # pending must start at the record of the bits
        decode_views(views, headers, infos, base=v1, base_fingerprints=fingerprints(v1), pending=p1)


@pytest.mark.compiled_vs_numpy
def test_compiled_and_numpy_write_the_same_bytes() -> None:
    if not native.active():
        pytest.skip("the compiled path is not built")
    for seed, share, limit in ((0, 0.004, 1 << 30), (1, 0.05, 900), (2, 0.3, 1 << 30)):
        specs, old, new = model(seed, share)
        patch = the_patch(specs, old, new)
        compiled = encode(patch, codec="context", base=old, max_shard_bytes=limit)
        with native.disabled():
            numpy = encode(patch, codec="context", base=old, max_shard_bytes=limit)
            assert_patches_equal(decode(compiled, base=old), patch)
        assert compiled == numpy
        assert_patches_equal(decode(numpy, base=old), patch)


@pytest.mark.compiled_vs_numpy
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_cases())
def test_compiled_and_numpy_write_the_same_bytes_for_any_model(case: tuple[dict[str, TensorSpec], Bits, Bits]) -> None:
    """The compiled coder gathers each entry's changes class-major before coding them;
    any mix of classes (empty ones, a lone change, all in the last class) codes as the
    NumPy definition does, with small shards so that entries stop at the budget too."""
    if not native.active():
        pytest.skip("the compiled path is not built")
    specs, old, new = case
    patch = the_patch(specs, old, new)
    compiled = encode(patch, codec="context", base=old, max_shard_bytes=600)
    with native.disabled():
        assert encode(patch, codec="context", base=old, max_shard_bytes=600) == compiled


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_cases())
def test_any_model_round_trips(case: tuple[dict[str, TensorSpec], Bits, Bits]) -> None:
    specs, old, new = case
    patch = the_patch(specs, old, new)
    shards = encode(patch, codec="context", base=old, max_shard_bytes=1 << 20)
    assert_patches_equal(decode(shards, base=old), patch)
    held = {n: a.copy() for n, a in old.items()}
    apply_shards(shards, held, fingerprints(old))
    for name in specs:
        np.testing.assert_array_equal(held[name], new[name])


def test_encode_smallest_picks_the_context_codec_for_sparse_float_steps() -> None:
    specs, old, new = model()
    patch = the_patch(specs, old, new)
    codec, shards = encode_smallest(patch, base=old)
    assert codec == "context" and shards == encode(patch, codec="context", base=old)


def test_encode_smallest_keeps_zstd_where_it_wins() -> None:
    # Wide random deltas repeating with a period: an adaptive model of single symbols
    # pays their entropy every time, zstd's matches pay it once.
    spec = TensorSpec("counter", "U32", (50_000,))
    old = {"counter": np.arange(50_000, dtype=np.uint32)}
    period = np.random.default_rng(0).integers(1, 1 << 32, size=97, dtype=np.uint64).astype(np.uint32)
    new = {"counter": old["counter"] + np.resize(period, 50_000)}
    patch = the_patch({"counter": spec}, old, new)
    codec, shards = encode_smallest(patch, base=old)
    context = encode(patch, codec="context", base=old)
    assert codec == "zstd" and sum(map(len, shards)) < sum(map(len, context))
    assert_patches_equal(decode(shards), patch)


def test_the_base_is_only_read() -> None:
    specs, old, new = model()
    patch = the_patch(specs, old, new)
    frozen = {n: a.copy() for n, a in old.items()}
    for a in frozen.values():
        a.flags.writeable = False
    shards = encode(patch, codec="context", base=frozen)
    assert_patches_equal(decode(shards, base=frozen), patch)
    assert all(fingerprint(frozen[n]) == fingerprint(old[n]) for n in specs)


def test_apply_of_a_decoded_context_patch_is_the_plain_apply() -> None:
    specs, old, new = model()
    patch = decode(encode(the_patch(specs, old, new), codec="context", base=old), base=old)
    held = {n: a.copy() for n, a in old.items()}
    assert apply(patch, held, fingerprints(old)) == fingerprints(new)


def _rewritten(shard: bytes, edit: Any) -> bytes:
    """``shard`` with its header document changed by ``edit`` (stored verbatim, re-sealed)."""
    from tests.fuzz.mutations import _json_text, _with_header

    text = _json_text(shard)
    assert text is not None
    doc = json.loads(text)
    edit(doc)
    return _with_header(shard, json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["entries"][0].update(classes=17), "classes"),
        (lambda d: d["entries"][0].update(lo=250, classes=16), "window"),
        (lambda d: d["entries"][0].update(gap_escapes=0), "unknown keys"),
        (lambda d: d["streams"].update(coded=[1, 5]), "payload"),
        (lambda d: d["streams"].update(gap_low=[0, 0]), "unknown keys"),
    ],
)
def test_hostile_context_headers_are_format_errors(edit: Any, message: str) -> None:
    specs, old, new = model()
    shard = encode(the_patch(specs, old, new), codec="context", base=old)[0]
    with pytest.raises(FormatError, match=message):
        read_shard_header(_rewritten(shard, edit))


def test_a_few_bytes_cannot_claim_many_changes() -> None:
    # A header promising a change for every element of a large tensor over a stream of a
    # few bytes is refused from the header, before anything is allocated for them.
    spec = TensorSpec("table", "U8", (1 << 20,))
    old = {"table": np.zeros(1 << 20, dtype=np.uint8)}
    new = {"table": old["table"].copy()}
    new["table"][12345] = 7
    shard = encode(the_patch({"table": spec}, old, new), codec="context", base=old)[0]
    assert read_shard_header(shard).payload_length < 16

    def claim(doc: dict[str, Any]) -> None:
        doc["tensors"]["table"]["changed"] = 1 << 20
        doc["entries"][0]["count"] = 1 << 20

    with pytest.raises(FormatError, match="cannot hold"):
        read_shard_header(_rewritten(shard, claim))


def test_a_damaged_stream_changes_nothing() -> None:
    from tests.fuzz.mutations import seal

    specs, old, new = model()
    shard = bytearray(encode(the_patch(specs, old, new), codec="context", base=old)[0])
    header = read_shard_header(bytes(shard))
    # (Not the last bytes: the coder's flush leaves slack there that decodes the same.)
    for at in (
        header.payload_offset + 1,
        header.payload_offset + 10,
        header.payload_offset + header.payload_length // 2,
    ):
        bad = bytearray(shard)
        bad[at] ^= 0x24
        held = {n: a.copy() for n, a in old.items()}
        with pytest.raises((FormatError, VerificationFailed)):
            apply_shards([seal(bytes(bad))], held, fingerprints(old), threads=1)
        for name in specs:
            np.testing.assert_array_equal(held[name], old[name])
