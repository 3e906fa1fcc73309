"""The mutation fuzzer, bounded, inside the suite: no decoder lets an untyped error out."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz.mutations import check_decoders, mutate, seal
from tests.fuzz.seeds import seed_shards

SEEDS = seed_shards()


def _fail(name: str, error: BaseException) -> None:
    pytest.fail(f"{name} raised {type(error).__name__}: {error}")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**64 - 1), rounds=st.integers(1, 3))
def test_mutated_shards_get_typed_errors(seed: int, rounds: int) -> None:
    rng = random.Random(seed)
    for _ in range(rounds):
        check_decoders(mutate(rng, SEEDS), _fail)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=2000))
def test_arbitrary_bytes_get_typed_errors(data: bytes) -> None:
    check_decoders([data], _fail)
    check_decoders([seal(b"\x89BLT\r\n\x1a\n" + data)], _fail)


def test_seeds_are_valid() -> None:
    # The fuzzer mutates real shards; if these stopped decoding it would fuzz nothing.
    bugs: list[str] = []
    check_decoders(SEEDS[:1], lambda name, e: bugs.append(name))
    assert not bugs
    from patcher.decode import decode_shard, read_shard_header
    from tests.fuzz.seeds import fuzz_base

    for data in SEEDS:
        base = {name: fuzz_base(info.spec) for name, info in read_shard_header(data).tensors.items()}
        decode_shard(data, base=None if read_shard_header(data).codec != "context" else base)
    assert any(read_shard_header(data).codec == "context" for data in SEEDS)
