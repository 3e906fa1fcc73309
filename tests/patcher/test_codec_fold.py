"""fold of k consecutive patches equals applying them one by one."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bulletin.errors import IncompatibleTensors, InvalidInput, WrongBase
from patcher.apply import apply
from patcher.decode import decode
from patcher.diff import diff
from patcher.encode import encode
from patcher.fold import fold
from patcher.patch import Patch, TensorDelta, TensorSpec
from tests.patcher.helpers import DTYPES, assert_patches_equal, fingerprints, mutate, random_bits


def _chain(
    seed: int, k: int, dtype: str, shape: tuple[int, ...], density: float
) -> tuple[list[Patch], list[dict[str, Any]]]:
    rng = np.random.default_rng(seed)
    spec = TensorSpec("w", dtype, shape)
    unchanged = TensorSpec("norm", "F32", (5,))
    versions = [{"w": random_bits(rng, dtype, shape), "norm": np.arange(5, dtype=np.uint32)}]
    for _ in range(k):
        prev = versions[-1]
        versions.append({"w": mutate(rng, prev["w"], density, dtype), "norm": prev["norm"]})
    specs = {"w": spec, "norm": unchanged}
    patches = [diff(specs, a, b) for a, b in itertools.pairwise(versions)]
    return patches, versions


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.integers(1, 6),
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 800),
    density=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
)
def test_fold_equals_sequential_apply(seed: int, k: int, dtype: str, n: int, density: float) -> None:
    patches, versions = _chain(seed, k, dtype, (n,), density)
    folded = fold(patches)
    held = {name: t.copy() for name, t in versions[0].items()}
    fps = apply(folded, held, fingerprints(versions[0]))
    assert {name: t.tobytes() for name, t in held.items()} == {name: t.tobytes() for name, t in versions[-1].items()}
    assert fps == fingerprints(versions[-1])
    # The fold is the direct diff of the end points: same elements, same net deltas.
    assert_patches_equal(folded, diff(patches[0].specs, versions[0], versions[-1]))
    assert_patches_equal(decode(encode(folded)), folded)


def test_net_zero_changes_drop_out_and_overlap_shrinks_the_patch() -> None:
    rng = np.random.default_rng(3)
    spec = TensorSpec("w", "BF16", (50000,))
    v0 = rng.integers(0, 1 << 16, 50000, dtype=np.uint16)
    where = rng.choice(50000, 2000, replace=False)
    v1 = v0.copy()
    v1[where] += 1
    v2 = v1.copy()
    v2[where[:1000]] -= 1  # back to v0: these drop out of the fold
    v2[where[1000:]] += 1  # same elements again: one index, a delta of 2
    p1 = diff({"w": spec}, {"w": v0}, {"w": v1})
    p2 = diff({"w": spec}, {"w": v1}, {"w": v2})
    folded = fold([p1, p2])
    td = folded.tensors["w"]
    assert td.changed == 1000
    assert np.all(td.delta == 2)
    folded_bytes = sum(map(len, encode(folded)))
    assert folded_bytes < sum(map(len, encode(p1))) + sum(map(len, encode(p2)))


def test_fold_checks_the_chain() -> None:
    patches, _ = _chain(1, 3, "F16", (100,), 0.1)
    with pytest.raises(WrongBase):
        fold([patches[0], patches[2]])
    with pytest.raises(WrongBase):
        fold([patches[1], patches[0]])
    other = TensorSpec("w", "F16", (101,))
    td = patches[1].tensors["w"]
    reshaped = TensorDelta(other, td.indices, td.delta, td.base_fingerprint, td.target_fingerprint)
    with pytest.raises(IncompatibleTensors):
        fold([patches[0], Patch({**patches[1].tensors, "w": reshaped})])
    with pytest.raises(IncompatibleTensors):
        fold([patches[0], Patch({"w": td})])
    with pytest.raises(InvalidInput):
        fold([])
    with pytest.raises(InvalidInput):
        fold(patches[0])  # type: ignore[arg-type]


def test_fold_of_one_patch_is_that_patch() -> None:
    patches, _ = _chain(2, 1, "F32", (300,), 0.2)
    assert_patches_equal(fold(patches), patches[0])
