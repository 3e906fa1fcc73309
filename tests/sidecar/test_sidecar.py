"""The sidecar over real HTTP, with a real store, Publisher, Subscriber and torch target."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from aiohttp import ClientSession

from bulletin.sidecar import SidecarConfig
from tests.sidecar.harness import RUN, Stack, stack


def test_not_ready_until_the_first_version(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with stack(tmp_path, publish_first=False) as s:
            async with s.client.get("/readyz") as resp:
                assert resp.status == 503
                assert (await resp.json())["ready"] is False
            status, headers, body = await s.post("/v1/completions", headers={"X-Bulletin-Max-Wait-Ms": "50"})
            assert status == 503 and body["error"]["code"] == "not_ready"
            assert int(headers["Retry-After"]) >= 1
            assert s.engine.received == []
            await s.publish()
            await s.wait_version(1)
            async with s.client.get("/readyz") as resp:
                assert resp.status == 200
            status, headers, body = await s.post("/v1/completions", {"prompt": [1]})
            assert status == 200 and headers["X-Bulletin-Version"] == "1"
            assert body["weights"] == pytest.approx(s.engine.weights_sum())

    asyncio.run(scenario())


def test_min_version_waits_for_the_trainer_then_serves(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with stack(tmp_path) as s:
            before = s.engine.weights_sum()
            waiting = asyncio.ensure_future(s.post("/v1/completions", headers={"X-Bulletin-Min-Version": "2"}))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            assert await s.publish() == 2
            status, headers, body = await waiting
            assert status == 200 and headers["X-Bulletin-Version"] == "2"
            assert body["weights"] != pytest.approx(before)  # computed with version 2's bits

    asyncio.run(scenario())


def test_behind_gone_and_exact(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with stack(tmp_path) as s:
            status, headers, body = await s.post("/v1/completions?bulletin_min_version=5&bulletin_max_wait_ms=100")
            assert status == 409
            assert body["error"]["code"] == "version_behind"
            assert body["bulletin"]["current_version"] == 1
            assert body["bulletin"]["required_min_version"] == 5
            assert int(headers["Retry-After"]) >= 1 and headers["X-Bulletin-Version"] == "1"
            await s.publish()
            await s.wait_version(2)
            status, headers, body = await s.post("/v1/completions", headers={"X-Bulletin-Version": "1"})
            assert status == 410 and body["error"]["code"] == "version_gone"
            assert "Retry-After" not in headers
            status, headers, _ = await s.post("/v1/completions", headers={"X-Bulletin-Version": "2"})
            assert status == 200 and headers["X-Bulletin-Version"] == "2"
            assert len(s.engine.received) == 1

    asyncio.run(scenario())


def test_an_exact_version_is_stopped_at_on_the_way_to_the_head(tmp_path: Path) -> None:
    async def scenario() -> None:
        config = SidecarConfig(poll_interval=3600.0, default_wait=5.0)  # only demand drives syncs
        async with stack(tmp_path, config, publish_first=False) as s:
            for _ in range(4):
                await s.publish()
            status, headers, _ = await s.post("/v1/completions", headers={"X-Bulletin-Version": "2"})
            assert status == 200 and headers["X-Bulletin-Version"] == "2"
            status, headers, _ = await s.post("/v1/completions", headers={"X-Bulletin-Min-Version": "4"})
            assert status == 200 and headers["X-Bulletin-Version"] == "4"

    asyncio.run(scenario())


def test_bad_requirements_are_400_and_never_reach_the_engine(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with stack(tmp_path) as s:
            for path, headers in [
                ("/v1/completions", {"X-Bulletin-Min-Version": "-3"}),
                ("/v1/completions", {"X-Bulletin-Version": "1.5"}),
                ("/v1/completions?bulletin_version=1&bulletin_min_version=1", {}),
                ("/v1/completions?bulletin_max_wait_ms=lots", {}),
            ]:
                status, _, body = await s.post(path, headers=headers)
                assert status == 400, path
                assert body["error"]["code"] == "invalid_input"
            assert s.engine.received == []

    asyncio.run(scenario())


def test_bulletin_parameters_and_headers_are_stripped(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with stack(tmp_path) as s:
            status, _, body = await s.post(
                "/v1/completions?a=1&bulletin_version=1&a=2&bulletin_max_wait_ms=10",
                {"prompt": [1, 2]},
                headers={"X-Bulletin-Version": "1", "X-Custom": "kept"},
            )
            assert status == 200
            assert body["path"] == "/v1/completions"
            assert body["query"] == [["a", "1"], ["a", "2"]]
            lowered = {k.lower() for k in body["headers"]}
            assert "x-bulletin-version" not in lowered and "x-custom" in lowered
            assert "x-forwarded-for" in lowered
            assert body["body"] == '{"prompt": [1, 2]}'

    asyncio.run(scenario())


def test_streams_pass_through_chunk_by_chunk(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with stack(tmp_path) as s, s.client.post("/v1/stream") as resp:
            assert resp.status == 200 and resp.headers["X-Bulletin-Version"] == "1"
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5.0)
            assert first == b'data: {"n": 1}\n\n'  # arrived while the engine still holds the rest
            s.engine.release.set()
            rest = await resp.read()
            assert rest == b'data: {"n": 2}\n\ndata: [DONE]\n\n'

    asyncio.run(scenario())


def test_activation_waits_for_requests_in_flight_and_holds_new_ones(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with stack(tmp_path) as s:
            held = asyncio.ensure_future(s.post("/hold"))
            await asyncio.wait_for(s.engine.entered.wait(), 5.0)
            weights_v1 = s.engine.weights_sum()
            await s.publish()
            for _ in range(200):  # the worker downloads, then waits for the request in flight
                if s.sidecar.gate.activating:
                    break
                await asyncio.sleep(0.01)
            assert s.sidecar.gate.activating and s.sidecar.gate.active_version == 1
            newcomer = asyncio.ensure_future(s.post("/v1/completions"))
            await asyncio.sleep(0.1)
            assert not newcomer.done()
            assert s.engine.weights_sum() == weights_v1  # nothing changed under the request
            s.engine.release.set()
            status, headers, body = await held
            assert status == 200 and headers["X-Bulletin-Version"] == "1"
            assert body["weights"] == weights_v1
            status, headers, _ = await newcomer
            assert status == 200 and headers["X-Bulletin-Version"] == "2"
            pauses = s.sidecar.metrics.pause_seconds
            assert pauses.count() >= 2  # keyframe, then the patch

    asyncio.run(scenario())


def test_a_stream_outliving_the_drain_timeout_is_told_at_its_end(tmp_path: Path) -> None:
    async def scenario() -> None:
        config = SidecarConfig(poll_interval=0.05, drain_timeout=0.1)
        async with stack(tmp_path, config) as s, s.client.post("/v1/stream") as resp:
            preempted: list[bool] = []
            assert s.sidecar.target is not None
            s.sidecar.target.on_preempt = lambda: preempted.append(True)  # the engine is told, once
            await resp.content.readuntil(b"\n\n")
            await s.publish()
            await s.wait_version(2)
            s.engine.release.set()
            rest = await resp.read()
            assert rest.endswith(b": bulletin-version-changed served=1 active=2\n\n")
            assert s.sidecar.metrics.preempted.value() == 1 and preempted == [True]

    asyncio.run(scenario())


def test_dead_engine_is_a_clear_502(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with stack(tmp_path) as s:
            await s.engine_server.close()
            status, headers, body = await s.post("/v1/completions")
            assert status == 502
            assert body["error"]["code"] == "upstream_unavailable"
            assert headers["X-Bulletin-Version"] == "1"
            assert s.sidecar.metrics.requests.value("502") == 1

    asyncio.run(scenario())


def test_a_failed_sync_keeps_the_last_good_version_serving(tmp_path: Path) -> None:
    async def scenario() -> None:
        # Only requests drive syncs here, so the shard can rot before anyone reads it.
        config = SidecarConfig(poll_interval=3600.0, max_backoff=0.2, default_wait=5.0)
        async with stack(tmp_path, config, publish_first=False) as s:
            await s.publish()
            await s.publish()
            status, _, body = await s.post("/v1/completions", headers={"X-Bulletin-Min-Version": "2"})
            assert status == 200
            weights_v2 = body["weights"]
            await asyncio.to_thread(_publish_with_a_rotten_shard, s)
            status, _, body = await s.post(
                "/v1/completions", headers={"X-Bulletin-Min-Version": "3", "X-Bulletin-Max-Wait-Ms": "500"}
            )
            assert status == 409
            assert body["bulletin"]["last_error"]["code"] == "digest_mismatch"
            async with s.client.get("/readyz") as resp:
                ready = await resp.json()
            assert resp.status == 200 and ready["current_version"] == 2 and ready["last_sync_ok"] is False
            async with s.client.get("/metrics") as resp:
                text = await resp.text()
            assert 'bulletin_sync_failures_total{code="digest_mismatch"}' in text
            assert "bulletin_last_sync_success 0" in text
            assert "bulletin_current_version 2" in text
            status, headers, body = await s.post("/v1/completions")
            assert status == 200 and headers["X-Bulletin-Version"] == "2"
            assert body["weights"] == weights_v2  # the bits of version 2, intact

    asyncio.run(scenario())


def _publish_with_a_rotten_shard(s: Stack) -> None:
    with torch.no_grad():
        for p in s.trainer.parameters():
            p.mul_(1.01)
    version = s.publisher.publish(s.trainer.state_dict())
    shards = sorted((s.store / RUN / "patches" / f"{version:020d}").iterdir())
    assert shards
    data = bytearray(shards[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    os.chmod(shards[0], 0o644)
    shards[0].write_bytes(bytes(data))


def test_internal_endpoints(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with stack(tmp_path) as s:
            async with s.client.get("/healthz") as resp:
                assert resp.status == 200
            async with s.client.get("/version") as resp:
                info = await resp.json()
            assert info["current_version"] == 1 and info["head_version"] == 1 and info["lag"] == 0
            assert info["run"] == RUN and info["ready"] is True
            await s.post("/v1/completions")
            async with s.client.get("/metrics") as resp:
                assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                text = await resp.text()
            assert 'bulletin_requests_total{status="200"} 1' in text
            assert "bulletin_head_version 1" in text and "bulletin_version_lag 0" in text

    asyncio.run(scenario())


def test_client_leaving_mid_stream_releases_its_hold(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with stack(tmp_path) as s:
            async with ClientSession() as session:
                resp = await session.post(s.client.make_url("/v1/stream"))
                await resp.content.readuntil(b"\n\n")
                assert s.sidecar.gate.in_flight == 1
                resp.close()
            s.engine.release.set()
            for _ in range(200):
                if s.sidecar.gate.in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            assert s.sidecar.gate.in_flight == 0
            await s.publish()
            await s.wait_version(2)

    asyncio.run(scenario())
