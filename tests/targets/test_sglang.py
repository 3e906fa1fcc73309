"""The SGLang adapters against the contract, on a loopback server imitating SGLang
(tests/sidecar/engine_servers.py): the disk reload (with and without the ranks' read-back
through Bulletin's loader) and the in-place path through ``/update_weights_from_tensor``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from numpy.typing import NDArray

from bulletin.engines.sglang import SGLangInPlaceTarget, SGLangTarget
from bulletin.engines.sglang_loader import LOADER
from bulletin.target import Held, LocalDirTarget, WeightTarget
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


class TestSGLangTargetReadBack(TestSGLangTarget):
    """The disk reload, with every load read back from the ranks through Bulletin's loader."""

    @pytest.fixture
    def target(self, tmp_path: Path, server: SglangServer) -> Iterator[WeightTarget]:
        self._model = module_for(SPECS)
        server.model, server.weight_version, server.loaded_from = self._model, None, []
        server.custom_weight_loader = [LOADER]
        target = SGLangTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url, readback=True)
        yield target
        target.close()
        server.custom_weight_loader = []


class TestSGLangInPlaceTarget(TargetContract):
    """Every TP rank patched in place through ``/update_weights_from_tensor``."""

    durable: ClassVar[bool] = True
    # A load overwrites the ranks' parameters; only the folder has a second copy.
    restores_aborted_loads: ClassVar[bool] = False

    #: TP ranks of the server (each a module laid out as the contract's tensors).
    tp: ClassVar[int] = 1

    @pytest.fixture
    def target(self, tmp_path: Path, server: SglangServer) -> Iterator[WeightTarget]:
        self._ranks = [module_for(SPECS) for _ in range(self.tp)]
        self._model = self._ranks[-1]
        server.model, server.weight_version, server.session = self._ranks[0], None, None
        server.ranks = self._ranks if self.tp > 1 else None
        server.custom_weight_loader = [LOADER]
        target = SGLangInPlaceTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url)
        yield target
        target.close()
        server.custom_weight_loader, server.ranks = [], None
        # A target closed between an apply and its activation leaves generation paused:
        # the next one resumes it once it knows what the ranks hold.
        assert server.dead is None and server.session is None
        first = module_bits(self._ranks[0])  # bits: the contract's tensors hold NaNs
        assert all(all(np.array_equal(first[n], b) for n, b in module_bits(m).items()) for m in self._ranks)

    def held_bits(self, target: WeightTarget) -> Mapping[str, NDArray[Any]]:
        return module_bits(self._model)

    def active_version(self, target: WeightTarget) -> int | None:
        # The folder's committed version; restored() also asks the ranks to agree.
        assert isinstance(target, SGLangInPlaceTarget)
        held: Held | None = target.local.restored()
        return held.version if held else None

    def reopen(self, target: WeightTarget) -> WeightTarget:
        assert isinstance(target, SGLangInPlaceTarget)
        target.close()
        return SGLangInPlaceTarget(LocalDirTarget(target.local.dir, run="r"), target.url)


class TestSGLangInPlaceTargetReplicatedRanks(TestSGLangInPlaceTarget):
    """Two TP ranks whose modules have no parallel layers: every rank holds every tensor
    whole (one replica set per tensor), each patched and checked on its own."""

    tp: ClassVar[int] = 2
