"""The SGLang adapter against a loopback server implementing SGLang's reload contract."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bulletin.engines.sglang import SGLangTarget
from bulletin.errors import ConfigError, EngineError
from bulletin.publisher import Publisher
from bulletin.subscriber import Subscriber
from bulletin.target import LocalDirTarget
from scripts._common import llama, llama_config
from tests.sidecar.engine_servers import SglangServer

CONFIG = llama_config(vocab=64, hidden=16, intermediate=32, layers=1, heads=2, kv_heads=1, max_positions=32, tied=False)


def _same_bits(engine: torch.nn.Module, trainer: torch.nn.Module) -> bool:
    live = engine.state_dict()
    return all(
        torch.equal(live[n].view(torch.int16), t.detach().to(dtype=torch.bfloat16).view(torch.int16))
        for n, t in trainer.state_dict().items()
    )


def _step(trainer: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 1e-2)


def test_each_version_is_reloaded_and_labelled(tmp_path: Path) -> None:
    trainer, engine = llama(CONFIG, 0), llama(CONFIG, 1, dtype=torch.bfloat16)
    server = SglangServer(engine)
    try:
        local = LocalDirTarget(tmp_path / "local", run="r")
        sub = Subscriber(str(tmp_path / "store"), "r", target=SGLangTarget(local, server.url))
        with Publisher(str(tmp_path / "store"), "r", keyframe_every=2) as pub:
            for step in range(4):
                if step:
                    _step(trainer)
                version = pub.publish(trainer.state_dict())
                assert sub.sync() == version
                assert server.weight_version == str(version)
                assert _same_bits(engine, trainer)
                assert Path(server.loaded_from[-1]) == (local.dir / "current").resolve()
    finally:
        server.close()


def test_a_refused_reload_leaves_folder_and_engine_on_the_old_version(tmp_path: Path) -> None:
    trainer, engine = llama(CONFIG, 0), llama(CONFIG, 1, dtype=torch.bfloat16)
    server = SglangServer(engine)
    try:
        local = LocalDirTarget(tmp_path / "local", run="r")
        sub = Subscriber(str(tmp_path / "store"), "r", target=SGLangTarget(local, server.url))
        with Publisher(str(tmp_path / "store"), "r", keyframe_every=10) as pub:
            pub.publish(trainer.state_dict())
            sub.sync()
            reference = llama(CONFIG, 0)
            reference.load_state_dict(trainer.state_dict())
            _step(trainer)
            pub.publish(trainer.state_dict())
            server.refuse = True
            with pytest.raises(EngineError, match="out of memory"):
                sub.sync()
            restored = local.restored()
            assert sub.current_version == 1 and restored is not None
            assert restored.version == 1
            assert local.full_fingerprints() == restored.fingerprints
            assert _same_bits(engine, reference) and server.weight_version == "1"
            server.refuse = False
            assert sub.sync() == 2
            assert _same_bits(engine, trainer) and server.weight_version == "2"
    finally:
        server.close()


def test_reconcile_reloads_an_engine_that_reports_another_version(tmp_path: Path) -> None:
    trainer, engine = llama(CONFIG, 0), llama(CONFIG, 1, dtype=torch.bfloat16)
    server = SglangServer(engine)
    try:
        with Publisher(str(tmp_path / "store"), "r") as pub:
            pub.publish(trainer.state_dict())
        Subscriber(str(tmp_path / "store"), "r", local_dir=tmp_path / "local").sync()
        target = SGLangTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url)
        assert target.engine_version() is None
        target.reconcile()
        assert server.weight_version == "1" and _same_bits(engine, trainer)
        calls = len(server.calls)
        target.reconcile()  # already there: only the version is asked for
        assert server.calls[calls:] == [("GET", "/get_weight_version")]
    finally:
        server.close()


def test_bad_urls_and_dead_engines(tmp_path: Path) -> None:
    local = LocalDirTarget(tmp_path / "local")
    with pytest.raises(ConfigError):
        SGLangTarget(local, "localhost:30000")
    server = SglangServer(llama(CONFIG, 1))
    url = server.url
    server.close()
    with pytest.raises(EngineError, match="unreachable"):
        SGLangTarget(local, url, timeout=5.0).engine_version()
