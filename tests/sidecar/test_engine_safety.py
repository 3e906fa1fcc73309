"""The sidecar in front of the vLLM and SGLang imitations (tests/sidecar/engine_servers.py):
control endpoints are never relayed, a failed engine-side change takes the node out of
service until the engine is verified, and a permanent incompatibility stops it at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from aiohttp.test_utils import TestClient, TestServer
from yarl import URL

from bulletin.engines.sglang import SGLangTarget
from bulletin.engines.vllm import VLLMTarget
from bulletin.publisher import Publisher
from bulletin.sidecar import GatedTarget, Sidecar, SidecarConfig, SidecarMetrics
from bulletin.subscriber import Subscriber
from bulletin.target import LocalDirTarget, WeightTarget
from scripts._common import llama
from tests.sidecar.engine_servers import LoadFault, SglangServer, VllmServer, extended_worker
from tests.sidecar.test_vllm_adapter import CONFIG, VllmLlama, assert_holds

FAST = SidecarConfig(poll_interval=0.05, default_wait=2.0, max_backoff=0.2, verify_interval=0)


@contextlib.asynccontextmanager
async def sidecar(
    tmp: Path, engine: WeightTarget, upstream: str, config: SidecarConfig = FAST
) -> AsyncIterator[tuple[Sidecar, TestClient[Any, Any]]]:
    metrics = SidecarMetrics()
    target = GatedTarget(engine, metrics)
    sub = Subscriber(str(tmp / "store"), "r", target=target, on_bytes=metrics.bytes_downloaded.inc)
    car = Sidecar(sub, upstream, target=target, metrics=metrics, config=config)
    client = TestClient(TestServer(car.create_app()))
    await client.start_server()
    try:
        yield car, client
    finally:
        await client.close()


async def until(check: Any, what: str, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"never: {what}")
        await asyncio.sleep(0.02)


def test_control_endpoints_never_reach_the_engine(tmp_path: Path) -> None:
    models = [VllmLlama()]
    server = VllmServer([extended_worker(m) for m in models])
    trainer = llama(CONFIG, 0)

    async def scenario() -> None:
        engine = VLLMTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url)
        with Publisher(str(tmp_path / "store"), "r") as pub:
            await asyncio.to_thread(pub.publish, trainer.state_dict())
        async with sidecar(tmp_path, engine, server.url) as (car, client):
            await until(lambda: car.gate.active_version == 1, "version 1 active")
            before = {p: server.count(p) for p in ("/collective_rpc", "/pause", "/reset_prefix_cache")}
            paths = [
                "/collective_rpc",
                "/pause",
                "/reset_prefix_cache",
                "/update_weights_from_disk",
                "/v1/completions/../collective_rpc",
                "/v1/%63ollective_rpc",
                "/v1/models/..%2F..%2Fcollective_rpc",
                "//collective_rpc",
                "/v1/models/",
            ]
            for path in paths:
                url = client.make_url("").with_path(path, encoded=True)
                async with client.session.post(URL(str(url), encoded=True), json={"method": "x"}) as resp:
                    assert resp.status == 404, path
                    assert (await resp.json())["error"]["code"] == "not_forwarded"
            assert {p: server.count(p) for p in before} == before  # not one reached the engine
            async with client.post("/v1/completions", json={"prompt": [1, 2]}) as resp:
                assert resp.status == 200 and resp.headers["X-Bulletin-Version"] == "1"
            async with client.get("/health") as resp:
                assert resp.status == 200

    try:
        asyncio.run(scenario())
    finally:
        server.close()


def test_the_allow_list_is_configurable() -> None:
    config = SidecarConfig(forward=("/v1/embeddings", "/v1/files/*"))
    assert config.forwards("/v1/embeddings") and config.forwards("/v1/files/a/b")
    assert not config.forwards("/v1/completions") and not config.forwards("/v1/files/")
    assert not config.forwards("/v1/files/%2e%2e") and not config.forwards("/v1/files/../x")
    for bad in ("v1/x", "/v1/../x", "/healthz", "/a%2Fb", "/"):
        try:
            SidecarConfig(forward=(bad,))
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} accepted")


def test_a_permanent_incompatibility_stops_the_node_at_once(tmp_path: Path) -> None:
    models = [VllmLlama()]
    server = VllmServer([extended_worker(m) for m in models])
    trainer = llama(CONFIG, 0)

    async def scenario() -> None:
        engine = VLLMTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url)
        pub = Publisher(str(tmp_path / "store"), "r", keyframe_every=1)
        lacking = {**trainer.state_dict(), "model.layers.0.mlp.extra.weight": torch.ones(2)}
        await asyncio.to_thread(pub.publish, lacking)
        async with sidecar(tmp_path, engine, server.url) as (car, client):
            await until(lambda: car.describe()["not_ready_reason"]["code"] == "incompatible_layout", "halted")
            downloaded = car.metrics.bytes_downloaded.value()
            await asyncio.to_thread(pub.publish, lacking)  # a new keyframe: not downloaded again
            await asyncio.sleep(0.5)
            assert car.metrics.bytes_downloaded.value() == downloaded
            async with client.get("/readyz") as resp:
                body = await resp.json()
                assert resp.status == 503 and body["not_ready_reason"]["code"] == "incompatible_layout"
                assert "extra" in body["not_ready_reason"]["message"]
            async with client.get("/metrics") as resp:
                assert 'bulletin_not_ready{code="incompatible_layout"} 1' in await resp.text()
        pub.close()

    try:
        asyncio.run(scenario())
    finally:
        server.close()


def test_a_failed_apply_on_one_engine_withdraws_verifies_and_repairs(tmp_path: Path) -> None:
    models = [VllmLlama(), VllmLlama()]
    server = VllmServer(engines=[[extended_worker(models[0])], [extended_worker(models[1])]])
    trainer = llama(CONFIG, 0)

    async def scenario() -> None:
        engine = VLLMTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url)
        pub = Publisher(str(tmp_path / "store"), "r", keyframe_every=10)
        await asyncio.to_thread(pub.publish, trainer.state_dict())
        async with sidecar(tmp_path, engine, server.url) as (car, client):
            await until(lambda: car.gate.active_version == 1, "version 1 active")
            with torch.no_grad():  # the second data-parallel engine drifts
                models[1].layer(0).self_attn.qkv_proj.weight.add_(1)
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.linspace(-1e-2, 1e-2, p.numel()).reshape(p.shape))
            await asyncio.to_thread(pub.publish, trainer.state_dict())
            await until(lambda: car.metrics.repairs.value() == 1, "the damage repaired")
            assert car.metrics.verifications.value("damaged") == 1
            await until(lambda: car.gate.active_version == 2, "version 2 active")
            for model in models:
                assert_holds(model, trainer)
            async with client.get("/readyz") as resp:
                assert resp.status == 200 and (await resp.json())["not_ready_reason"] is None
        pub.close()

    try:
        asyncio.run(scenario())
    finally:
        server.close()


def test_an_engine_left_unknown_serves_nothing_until_repaired(tmp_path: Path) -> None:
    engine_model = llama(CONFIG, 1, dtype=torch.bfloat16)
    server = SglangServer(engine_model)
    trainer = llama(CONFIG, 0)

    async def scenario() -> None:
        engine = SGLangTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url)
        pub = Publisher(str(tmp_path / "store"), "r", keyframe_every=10)
        await asyncio.to_thread(pub.publish, trainer.state_dict())
        async with sidecar(tmp_path, engine, server.url) as (car, client):
            await until(lambda: car.gate.active_version == 1, "version 1 active")
            server.fault = LoadFault(after=2, rollback=False, times=10**6)  # every reload breaks
            await asyncio.to_thread(pub.publish, {k: v + 0.01 for k, v in trainer.state_dict().items()})
            await until(lambda: not car.describe()["ready"] and car.gate.active_version is None, "withdrawn")
            async with client.post("/v1/completions", json={"prompt": [1]}) as resp:
                assert resp.status == 503 and (await resp.json())["error"]["code"] == "not_ready"
            async with client.get("/readyz") as resp:
                assert resp.status == 503
            server.fault = None
            await until(lambda: car.gate.active_version == 2, "version 2 active")
            async with client.post("/v1/completions", json={"prompt": [1]}) as resp:
                assert resp.status == 200 and resp.headers["X-Bulletin-Version"] == "2"
        pub.close()

    try:
        asyncio.run(scenario())
    finally:
        server.close()
