"""A keyframe load that fails on live weights (no second copy to put back) must not leave
the node reporting the version it held: the engine may hold the new bits, the old ones,
or a mix. The node reports nothing until a verified version is activated again."""

from __future__ import annotations

import uuid

import pytest
import torch

from bulletin.engines.torch_module import TorchTarget, torch_dtype
from bulletin.errors import EngineError
from bulletin.run import Run
from bulletin.storage import open_store
from bulletin.subscriber import Subscriber
from tests.run.helpers import publish_versions


def _live_tensors(store: str) -> dict[str, torch.Tensor]:
    """Zeroed torch tensors laid out as the run's first version (an engine's weights)."""
    specs = Run(open_store(store), "run").read_manifest(1).manifest.specs
    return {name: torch.zeros(spec.shape, dtype=torch_dtype(spec.dtype)) for name, spec in specs.items()}


def test_a_failed_keyframe_load_into_live_weights_reports_no_version(monkeypatch: pytest.MonkeyPatch) -> None:
    store = f"memory://{uuid.uuid4().hex}"
    publish_versions(store, "run", 3, seed=5, keyframe_every=10)
    target = TorchTarget(_live_tensors(store))
    assert not target.restores_loads
    sub = Subscriber(store, "run", target=target)
    assert sub.sync() == 3

    def refuse(version: int, *, manifest_digest: str | None = None) -> None:
        raise EngineError("the engine refused the new weights")

    with monkeypatch.context() as patched:
        patched.setattr(target, "activate", refuse)
        with pytest.raises(EngineError):
            sub.sync(1)  # a chosen downgrade: a keyframe route, written into the live tensors
    assert sub.current_version is None  # not 3: the tensors now hold version 1's bits
    assert sub.sync() == 3  # the next route starts at a keyframe and lands verified
    assert target.full_fingerprints() == dict(sub.source.read_manifest(3).manifest.fingerprints)
