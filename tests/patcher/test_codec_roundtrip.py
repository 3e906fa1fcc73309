"""diff -> encode -> decode -> apply gives back the new bits exactly, for every dtype."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patcher.apply import apply
from patcher.decode import decode, decode_shard, read_shard_header
from patcher.diff import diff
from patcher.encode import encode
from patcher.fingerprint import fingerprint
from patcher.patch import Patch, TensorSpec
from tests.patcher.helpers import DTYPES, assert_patches_equal, fingerprints, model_cases, mutate, tensor_cases

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _roundtrip(
    specs: dict[str, TensorSpec],
    old: dict[str, Any],
    new: dict[str, Any],
    **encode_args: Any,
) -> tuple[Patch, list[bytes]]:
    base = fingerprints(old)
    patch = diff(specs, old, new, base_fingerprints=base)
    shards = encode(patch, **encode_args)
    decoded = decode(shards)
    assert_patches_equal(decoded, patch)
    held = {name: bits.copy() for name, bits in old.items()}
    new_fps = apply(decoded, held, base)
    for name in specs:
        # Bits compare: NaN payloads, -0.0 and Inf must come back exactly.
        assert held[name].tobytes() == new[name].tobytes(), name
        assert new_fps[name] == fingerprint(new[name]), name
    return patch, shards


@SETTINGS
@given(case=model_cases(), codec=st.sampled_from(["zstd", "lz4"]))
def test_roundtrip_models(case: tuple[dict[str, TensorSpec], dict[str, Any], dict[str, Any]], codec: str) -> None:
    _roundtrip(*case, codec=codec)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_roundtrip_every_dtype(dtype: str, data: st.DataObject) -> None:
    spec, old, new = data.draw(tensor_cases(dtypes=[dtype]))
    _roundtrip({spec.name: spec}, {spec.name: old}, {spec.name: new})


@SETTINGS
@given(case=model_cases(max_tensors=4), max_shard=st.integers(1024, 4000), codec=st.sampled_from(["zstd", "lz4"]))
def test_tiny_shards_split_tensors(
    case: tuple[dict[str, TensorSpec], dict[str, Any], dict[str, Any]], max_shard: int, codec: str
) -> None:
    _, shards = _roundtrip(*case, max_shard_bytes=max_shard, codec=codec)
    assert all(len(s) <= max_shard for s in shards)
    headers = [read_shard_header(s) for s in shards]
    assert [h.shard_index for h in headers] == list(range(len(shards)))
    assert len({h.patch_id for h in headers}) == 1
    # Any order of the shards decodes to the same patch.
    assert_patches_equal(decode(shards[::-1]), decode(shards))


def test_one_tensor_split_over_many_shards() -> None:
    rng = np.random.default_rng(7)
    spec = TensorSpec("w", "BF16", (20000,))
    old = rng.integers(0, 1 << 16, 20000, dtype=np.uint16)
    new = old.copy()
    new[rng.choice(20000, 3000, replace=False)] += 1
    patch, shards = _roundtrip({"w": spec}, {"w": old}, {"w": new}, max_shard_bytes=800)
    assert len(shards) >= 4
    entries = [e for s in shards for e in read_shard_header(s).entries]
    assert all(e.tensor == "w" for e in entries)
    # The entries tile [0, numel) in order and hold every change once.
    assert entries[0].start == 0 and entries[-1].stop == 20000
    assert all(a.stop == b.start for a, b in itertools.pairwise(entries))
    assert sum(e.count for e in entries) == patch.changed_elements == 3000
    # Each shard decodes on its own to its part of the tensor.
    parts = [d for s in shards for d in decode_shard(s).entries]
    np.testing.assert_array_equal(np.concatenate([d.indices for d in parts]), patch.tensors["w"].indices)


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_unchanged_empty_and_scalar_tensors(codec: str) -> None:
    specs = {
        "empty": TensorSpec("empty", "F32", (0, 5)),
        "scalar": TensorSpec("scalar", "F64", ()),
        "same": TensorSpec("same", "BF16", (7, 3)),
    }
    old: dict[str, Any] = {
        "empty": np.zeros((0, 5), np.uint32),
        "scalar": np.array(0x7FF8000000000001, dtype=np.uint64),
        "same": np.arange(21, dtype=np.uint16).reshape(7, 3),
    }
    new = {"empty": old["empty"].copy(), "scalar": np.array(1 << 63, dtype=np.uint64), "same": old["same"].copy()}
    patch, shards = _roundtrip(specs, old, new, codec=codec)
    assert patch.changed_elements == 1
    header = read_shard_header(shards[0])
    assert {e.tensor: (e.start, e.stop, e.count) for e in header.entries} == {
        "empty": (0, 0, 0),
        "scalar": (0, 1, 1),
        "same": (0, 21, 0),
    }


def test_empty_patch_is_one_shard() -> None:
    shards = encode(Patch({}))
    assert len(shards) == 1
    assert len(decode(shards)) == 0


@settings(max_examples=10, deadline=None)
@given(case=model_cases(max_tensors=3), level=st.integers(1, 19))
def test_encode_is_deterministic(
    case: tuple[dict[str, TensorSpec], dict[str, Any], dict[str, Any]], level: int
) -> None:
    specs, old, new = case
    patch = diff(specs, old, new)
    assert encode(patch, level=level) == encode(patch, level=level)
    # A patch decoded from shards encodes to the very same shards.
    shards = encode(patch, level=level, max_shard_bytes=1500)
    assert encode(decode(shards), level=level, max_shard_bytes=1500) == shards


def test_float_views_are_accepted_as_bits() -> None:
    spec = TensorSpec("x", "F32", (4,))
    old = np.array([0.0, 1.0, np.inf, np.nan], dtype=np.float32)
    new = np.array([-0.0, 1.0, -np.inf, np.nan], dtype=np.float32)
    new.view(np.uint32)[3] |= 1  # another NaN payload: a change that compares "equal" as floats
    patch = diff({"x": spec}, {"x": old}, {"x": new})
    assert patch.tensors["x"].indices.tolist() == [0, 2, 3]
    held = {"x": old.copy()}
    apply(decode(encode(patch)), held, {"x": fingerprint(old.view(np.uint32))})
    assert held["x"].tobytes() == new.tobytes()


def test_stored_bytes_are_shared_out_exactly() -> None:
    rng = np.random.default_rng(11)
    specs = {n: TensorSpec(n, "BF16", (3000,)) for n in ("a", "b", "c")}
    old = {n: rng.integers(0, 1 << 16, 3000, dtype=np.uint16) for n in specs}
    new = {n: mutate(rng, old[n], d, "BF16") for n, d in zip(specs, (0.0, 0.01, 0.2), strict=True)}
    for shard in encode(diff(specs, old, new), max_shard_bytes=1500):
        header = read_shard_header(shard)
        shares = header.stored_bytes_by_tensor()
        assert shares.keys() == header.tensors.keys()
        assert sum(shares.values()) == header.payload_length
        assert all(v >= 0 for v in shares.values())
