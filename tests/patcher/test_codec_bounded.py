"""What a reader allocates is bounded by what the headers declare, once checked.

``decode`` allocates every tensor's ``changed`` indices and deltas once (no per-shard
arenas concatenated afterwards) plus one shard's streams at a time, and, given the
holder's layout, refuses a patch of other tensors from its headers alone: a shard of a
few KiB that claims millions of changes of a tensor the holder does not have costs
nothing (docs/FORMAT.md, 3.10 "Limits").
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from bulletin.errors import IncompatibleTensors
from patcher import native
from patcher.apply_shards import apply_shards
from patcher.decode import decode, decode_views, shard_views
from patcher.encode import encode
from patcher.format import DEFAULT_LIMITS
from patcher.patch import Patch, TensorDelta, TensorSpec
from tests.patcher.helpers import assert_patches_equal

DENSE = 1 << 22


def _dense(name: str, dtype: str, n: int) -> TensorDelta:
    spec = TensorSpec(name, dtype, (n,))
    return TensorDelta(spec, np.arange(n, dtype=np.int64), np.ones(n, spec.bits_dtype), 1, 2)


def _peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    tracemalloc.start()
    try:
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak


def test_a_patch_of_other_tensors_is_refused_from_its_headers() -> None:
    shards = encode(Patch({"dense": _dense("dense", "U8", DENSE)}))
    assert sum(map(len, shards)) < DENSE // 100  # a few KiB that decode to ~40 MiB
    held = {"dense": TensorSpec("dense", "U8", (1000,))}
    for attempt in (
        lambda: decode(shards, specs=held),
        lambda: apply_shards(shards, {"dense": np.zeros(1000, np.uint8)}, {"dense": 1}, specs=held),
    ):

        def refused(attempt: Callable[[], Any] = attempt) -> BaseException:
            with pytest.raises(IncompatibleTensors, match="dense") as info:
                attempt()
            return info.value

        _, peak = _peak(refused)
        assert peak < 1 << 20
    assert decode(shards, specs={"dense": TensorSpec("dense", "U8", (DENSE,))}).changed_elements == DENSE


def test_decode_allocates_each_tensor_once_at_its_declared_size() -> None:
    # Several shards and entries per tensor: the arrays are not built per shard and
    # then concatenated (twice the patch at the peak), but filled in place.
    patch = Patch({"a": _dense("a", "U16", DENSE), "b": _dense("b", "U8", DENSE // 2)})
    shards = encode(patch, max_shard_bytes=16 << 10)
    assert len(shards) > 2
    declared = DENSE * (8 + 2) + DENSE // 2 * (8 + 1)
    decoded, peak = _peak(lambda: decode(shards))
    assert_patches_equal(decoded, patch)
    assert peak < declared * 1.2, f"peak {peak / 2**20:.1f} MiB for {declared / 2**20:.1f} MiB declared"


def test_decode_views_is_decode_after_the_headers() -> None:
    rng = np.random.default_rng(3)
    spec = TensorSpec("w", "BF16", (300, 70))
    where = np.sort(rng.choice(spec.numel, 2000, replace=False)).astype(np.int64)
    delta = rng.integers(1, 1 << 16, 2000).astype(np.uint16)
    patch = Patch(
        {
            "w": TensorDelta(spec, where, delta, 5, 6),
            "z": TensorDelta(TensorSpec("z", "F32", (4,)), np.empty(0, np.int64), np.empty(0, np.uint32), 7, 7),
        }
    )
    shards = encode(patch, max_shard_bytes=1500)
    views, headers, tensors = shard_views(shards, DEFAULT_LIMITS)
    assert_patches_equal(decode_views(views, headers, tensors), patch)
    assert_patches_equal(decode(list(reversed(shards))), patch)


def test_the_numpy_path_of_apply_shards_checks_the_layout_before_decoding() -> None:
    shards = encode(Patch({"dense": _dense("dense", "U8", DENSE)}))
    held = {"dense": TensorSpec("dense", "U16", (DENSE,))}

    def refused() -> None:
        with pytest.raises(IncompatibleTensors):
            apply_shards(shards, {}, {"dense": 1}, specs=held)

    with native.disabled():
        _, peak = _peak(refused)
    assert peak < 1 << 20
