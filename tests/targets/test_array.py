"""ArrayTarget (host memory) against the WeightTarget contract."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from numpy.typing import NDArray

from bulletin.target import ArrayTarget, WeightTarget
from tests.targets.contract import TargetContract


class TestArrayTarget(TargetContract):
    @pytest.fixture
    def target(self) -> Iterator[WeightTarget]:
        target = ArrayTarget()
        yield target
        target.close()

    def held_bits(self, target: WeightTarget) -> Mapping[str, NDArray[Any]]:
        assert isinstance(target, ArrayTarget)
        return target.arrays

    def active_version(self, target: WeightTarget) -> int | None:
        assert isinstance(target, ArrayTarget)
        return target.version


def test_array_targets_apply_straight_from_shards() -> None:
    assert ArrayTarget().supports_shards
