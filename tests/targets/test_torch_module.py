"""TorchTarget (live torch tensors, patched in place) against the contract."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import pytest
from numpy.typing import NDArray

from bulletin.engines.torch_module import TorchTarget
from bulletin.target import WeightTarget
from tests.targets.contract import SPECS, TargetContract
from tests.targets.modules import module_for, tensor_bits


class TestTorchTarget(TargetContract):
    layout_up_front: ClassVar[bool] = True
    # A load overwrites the live tensors; there is no second copy to put back.
    restores_aborted_loads: ClassVar[bool] = False

    @pytest.fixture
    def target(self) -> Iterator[WeightTarget]:
        target = TorchTarget.from_module(module_for(SPECS))
        yield target
        target.close()

    def held_bits(self, target: WeightTarget) -> Mapping[str, NDArray[Any]]:
        assert isinstance(target, TorchTarget)
        return tensor_bits(target.tensors)

    def active_version(self, target: WeightTarget) -> int | None:
        assert isinstance(target, TorchTarget)
        return target.version
