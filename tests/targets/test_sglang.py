"""SGLangTarget against the contract, through SGLang's reload contract on a loopback
server (tests/sidecar/engine_servers.py) that loads the folder into a torch module."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from numpy.typing import NDArray

from bulletin.engines.sglang import SGLangTarget
from bulletin.target import LocalDirTarget, WeightTarget
from tests.sidecar.engine_servers import SglangServer
from tests.targets.contract import SPECS, TargetContract
from tests.targets.modules import module_bits, module_for


@pytest.fixture(scope="module")
def server() -> Iterator[SglangServer]:
    # One server for the module (stopping one takes half a second); each test gives it
    # a fresh engine model.
    server = SglangServer(module_for({}))
    yield server
    server.close()


class TestSGLangTarget(TargetContract):
    durable: ClassVar[bool] = True

    @pytest.fixture
    def target(self, tmp_path: Path, server: SglangServer) -> Iterator[WeightTarget]:
        self._model: torch.nn.Module = module_for(SPECS)
        server.model, server.weight_version, server.loaded_from = self._model, None, []
        target = SGLangTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url)
        yield target
        target.close()

    def held_bits(self, target: WeightTarget) -> Mapping[str, NDArray[Any]]:
        return module_bits(self._model)  # what the engine serves: reloaded at activate only

    def reopen(self, target: WeightTarget) -> WeightTarget:
        assert isinstance(target, SGLangTarget)
        target.close()
        return SGLangTarget(LocalDirTarget(target.local.dir, run="r"), target.url)
