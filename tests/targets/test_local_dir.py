"""LocalDirTarget (a safetensors folder with an undo journal) against the contract."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from numpy.typing import NDArray

from bulletin.checkpoint import Checkpoint
from bulletin.target import LocalDirTarget, WeightTarget
from tests.targets.contract import TargetContract


class TestLocalDirTarget(TargetContract):
    durable: ClassVar[bool] = True

    @pytest.fixture
    def target(self, tmp_path: Path) -> Iterator[WeightTarget]:
        target = LocalDirTarget(tmp_path / "local", run="r")
        yield target
        target.close()

    def held_bits(self, target: WeightTarget) -> Mapping[str, NDArray[Any]]:
        assert isinstance(target, LocalDirTarget)
        with Checkpoint(target.staged_path) as ckpt:
            return {name: np.array(ckpt.bits(name), copy=True) for name in ckpt.specs}

    def reopen(self, target: WeightTarget) -> WeightTarget:
        assert isinstance(target, LocalDirTarget)
        target.close()
        return LocalDirTarget(target.dir, run="r")
