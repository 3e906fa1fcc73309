"""The SGLang adapter against a loopback server implementing SGLang's reload contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bulletin.engines.sglang import SGLangTarget
from bulletin.errors import ConfigError, EngineError
from bulletin.publisher import Publisher
from bulletin.subscriber import Subscriber
from bulletin.target import LocalDirTarget
from scripts._common import llama, llama_config
from tests.sidecar.engine_servers import LoadFault, SglangServer, prefix_values

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


def _two_versions(
    tmp_path: Path, server: SglangServer
) -> tuple[Subscriber, SGLangTarget, Publisher, torch.nn.Module, torch.nn.Module]:
    """A subscriber on version 1, version 2 published; the trainers' copies of both."""
    trainer = llama(CONFIG, 0)
    local = LocalDirTarget(tmp_path / "local", run="r")
    target = SGLangTarget(local, server.url)
    sub = Subscriber(str(tmp_path / "store"), "r", target=target)
    pub = Publisher(str(tmp_path / "store"), "r", keyframe_every=10)
    pub.publish(trainer.state_dict())
    sub.sync()
    v1 = llama(CONFIG, 0)
    v1.load_state_dict(trainer.state_dict())
    _step(trainer)
    pub.publish(trainer.state_dict())
    return sub, target, pub, v1, trainer


@pytest.mark.parametrize("engines", [1, 2])
def test_a_failed_reload_that_left_the_new_weights_is_undone(tmp_path: Path, engines: int) -> None:
    models = [llama(CONFIG, 1, dtype=torch.bfloat16) for _ in range(engines)]
    server = SglangServer(engines=models)
    try:
        sub, target, pub, v1, v2 = _two_versions(tmp_path, server)
        # SGLang fails mid-load and "rolls back" by loading the new folder again, on the
        # last data-parallel engine: every engine now holds version 2's bits, and it says 400.
        server.fault = LoadFault(after=2, rollback=True, engines={engines - 1})
        with pytest.raises(EngineError, match="Rolling back"):
            sub.sync()
        assert sub.current_version == 1 and server.weight_version == "1"
        assert all(_same_bits(m, v1) for m in models)  # version 1 reloaded into every engine
        assert target.lost is None and target.full_fingerprints() == sub.held.fingerprints  # type: ignore[union-attr]
        assert sub.sync() == 2
        assert all(_same_bits(m, v2) for m in models) and server.weight_version == "2"
        pub.close()
    finally:
        server.close()


def test_a_reload_that_cannot_be_undone_leaves_nothing_claimed_until_repaired(tmp_path: Path) -> None:
    engine = llama(CONFIG, 1, dtype=torch.bfloat16)
    server = SglangServer(engine)
    try:
        sub, target, pub, v1, _ = _two_versions(tmp_path, server)
        server.fault = LoadFault(after=2, rollback=False, times=2)  # the restore fails too: mixed bits
        with pytest.raises(EngineError):
            sub.sync()
        assert target.lost is not None
        assert target.full_fingerprints() == {}  # nothing vouched for: a verification finds damage
        report = sub.verify()  # what the sidecar runs at once (worker.py), repairing from a keyframe
        assert not report.ok and report.repaired_to == 1
        assert target.lost is None and _same_bits(engine, v1) and server.weight_version == "1"
        pub.close()
    finally:
        server.close()


def test_a_reload_whose_cache_flush_is_refused_is_not_reported_as_the_old_version(tmp_path: Path) -> None:
    import threading
    import urllib.request

    engine = llama(CONFIG, 1, dtype=torch.bfloat16)
    server = SglangServer(engine)
    try:
        sub, target, pub, v1, _v2 = _two_versions(tmp_path, server)
        target.abort_all_requests = False  # a request keeps running across the reload
        body = json.dumps({"prompt": [1, 2], "hold": True}).encode()

        def request() -> None:
            req = urllib.request.Request(f"{server.url}/v1/completions", data=body, method="POST")
            with urllib.request.urlopen(req, timeout=30) as resp:
                resp.read()

        running = threading.Thread(target=request)
        running.start()
        while not server.running:
            pass
        with pytest.raises(EngineError, match="cache was not flushed"):
            sub.sync()
        # SGLang loaded new bits and could not flush its cache (nor after reloading version 1):
        # the node claims nothing until a verification repairs it.
        assert target.lost is not None and target.full_fingerprints() == {}
        server.release()
        running.join(10)
        assert sub.verify().repaired_to == 1 and _same_bits(engine, v1)
        pub.close()
    finally:
        server.close()


def test_a_prompt_sharing_a_cached_prefix_gets_the_new_versions_numbers(tmp_path: Path) -> None:
    engine = llama(CONFIG, 1, dtype=torch.bfloat16)
    server = SglangServer(engine)
    try:
        sub, _, pub, _, _ = _two_versions(tmp_path, server)
        prompt = [5, 3, 5, 8, 9, 7, 9]
        old = _completion(server, prompt)
        assert server.caches[0].blocks
        assert sub.sync() == 2
        new = _completion(server, [*prompt, 1])
        assert new == prefix_values(engine, [*prompt, 1]) and new[: len(prompt)] != old
        assert server.count("/flush_cache") >= 1
        pub.close()
    finally:
        server.close()


def test_data_parallel_engines_holding_different_weights_are_refused(tmp_path: Path) -> None:
    models = [llama(CONFIG, 1, dtype=torch.bfloat16) for _ in range(2)]
    server = SglangServer(engines=models)
    try:
        _sub, target, pub, _, _ = _two_versions(tmp_path, server)
        with torch.no_grad():
            next(models[1].parameters()).view(torch.int16)[0] += 1
        with pytest.raises(EngineError, match="data-parallel engines hold different weights"):
            target.checksum()
        pub.close()
    finally:
        server.close()


def _completion(server: SglangServer, prompt: list[int]) -> list[float]:
    import urllib.request

    req = urllib.request.Request(
        f"{server.url}/v1/completions", data=json.dumps({"prompt": prompt}).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        values: list[float] = json.loads(resp.read())["choices"][0]["prompt_logprobs"]
    return values


@pytest.mark.parametrize("legacy", [False, True])
def test_reconcile_reloads_an_engine_that_reports_another_version(tmp_path: Path, legacy: bool) -> None:
    trainer, engine = llama(CONFIG, 0), llama(CONFIG, 1, dtype=torch.bfloat16)
    server = SglangServer(engine, legacy=legacy)
    try:
        with Publisher(str(tmp_path / "store"), "r") as pub:
            pub.publish(trainer.state_dict())
        Subscriber(str(tmp_path / "store"), "r", local_dir=tmp_path / "local").sync()
        target = SGLangTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url)
        assert target.engine_version() == "default"  # SGLang's label before any update
        target.reconcile()
        assert server.weight_version == "1" and _same_bits(engine, trainer)
        calls = len(server.calls)
        target.reconcile()  # already there: only the version (and the checksum) is asked for
        asked = [p for _, p in server.calls[calls:]]
        assert "/update_weights_from_disk" not in asked
        assert asked[0] == "/model_info" and ("/get_weight_version" in asked) is legacy
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
