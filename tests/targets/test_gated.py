"""The sidecar's GatedTarget, wrapping a target, passes the contract too: it forwards
every method and capability (no gate is bridged here, so nothing pauses)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from numpy.typing import NDArray

from bulletin.sidecar.worker import GatedTarget
from bulletin.target import ArrayTarget, WeightTarget
from tests.targets.contract import TargetContract


def _inner(target: WeightTarget) -> ArrayTarget:
    assert isinstance(target, GatedTarget) and isinstance(target.inner, ArrayTarget)
    return target.inner


class TestGatedArrayTarget(TargetContract):
    @pytest.fixture
    def target(self) -> Iterator[WeightTarget]:
        target = GatedTarget(ArrayTarget())
        yield target
        target.close()

    def held_bits(self, target: WeightTarget) -> Mapping[str, NDArray[Any]]:
        return _inner(target).arrays

    def active_version(self, target: WeightTarget) -> int | None:
        return _inner(target).version


def test_the_wrapper_takes_its_capabilities_from_the_inner_target() -> None:
    gated = GatedTarget(ArrayTarget())
    assert gated.supports_shards and gated.in_place
    assert not GatedTarget(ArrayTarget(), in_place=False).in_place
