"""VLLMTarget against the contract, through vLLM's ``/collective_rpc`` contract on a
loopback server (tests/sidecar/engine_servers.py) with two workers."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from numpy.typing import NDArray

from bulletin.engines.vllm import VLLMTarget
from bulletin.target import Held, LocalDirTarget, WeightTarget
from tests.sidecar.engine_servers import VllmServer, extended_worker
from tests.targets.contract import SPECS, TargetContract, assert_bits
from tests.targets.modules import module_bits, module_for


@pytest.fixture(scope="module")
def server() -> Iterator[VllmServer]:
    # One server for the module (stopping one takes half a second); each test gives it
    # fresh workers.
    server = VllmServer([])
    yield server
    server.close()


class TestVLLMTarget(TargetContract):
    durable: ClassVar[bool] = True
    # A load overwrites the workers' parameters; only the folder has a second copy.
    restores_aborted_loads: ClassVar[bool] = False

    @pytest.fixture
    def target(self, tmp_path: Path, server: VllmServer) -> Iterator[WeightTarget]:
        self._models: list[torch.nn.Module] = [module_for(SPECS), module_for(SPECS)]
        server.workers = [extended_worker(m) for m in self._models]
        target = VLLMTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url)
        yield target
        target.close()

    def held_bits(self, target: WeightTarget) -> Mapping[str, NDArray[Any]]:
        first, *others = (module_bits(m) for m in self._models)
        for other in others:
            assert_bits(other, first)  # every worker holds the same bits
        return first

    def active_version(self, target: WeightTarget) -> int | None:
        # The folder's committed version; restored() also asks the workers to agree.
        assert isinstance(target, VLLMTarget)
        held: Held | None = target.local.restored()
        return held.version if held else None

    def reopen(self, target: WeightTarget) -> WeightTarget:
        assert isinstance(target, VLLMTarget)
        target.close()
        return VLLMTarget(LocalDirTarget(target.local.dir, run="r"), target.url)
