"""The sidecar re-hashes what it serves at start and on a schedule, in the background, and
refuses a run that was rolled back or rewritten unless told to follow it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from bulletin.checkpoint import Checkpoint
from bulletin.cli import main
from bulletin.publisher import Publisher
from bulletin.run import Run
from bulletin.sidecar import GatedTarget, Sidecar, SidecarConfig, SidecarSettings, build_sidecar
from bulletin.sidecar import compose as compose_module
from bulletin.storage import open_store
from bulletin.subscriber import Subscriber
from bulletin.target import LocalDirTarget
from patcher.fingerprint import fingerprint
from tests.run.rollback import rewind
from tests.run.test_disk_damage import flip_a_bit
from tests.sidecar.harness import RUN, Engine, make_module, stack


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def _manifest_fps(store: Path, version: int) -> dict[str, int]:
    return dict(Run(open_store(str(store)), RUN).read_manifest(version).manifest.fingerprints)


def test_background_verification_repairs_damaged_live_weights(tmp_path: Path) -> None:
    async def scenario() -> None:
        config = SidecarConfig(poll_interval=0.05, default_wait=5.0, verify_interval=0.1)
        async with stack(tmp_path, config) as s:
            metrics = s.sidecar.metrics
            await until(lambda: metrics.verifications.value("ok") >= 1, "a clean verification")
            target = s.sidecar.target
            assert target is not None
            param = next(s.engine.model.parameters())
            with torch.no_grad():
                bits = param.view(torch.int16).view(-1)
                bits[3] = bits[3] ^ 1  # a bit flipped in the engine's memory, behind Bulletin's back
            await until(lambda: metrics.repairs.value() == 1, "the repair")
            assert metrics.verifications.value("damaged") == 1
            assert target.full_fingerprints() == _manifest_fps(s.store, 1)
            await until(lambda: (s.sidecar.describe()["last_verify"] or {}).get("ok") is True, "a clean check")
            info = s.sidecar.describe()
            assert info["current_version"] == 1 and info["last_verify"]["version"] == 1
            async with s.client.get("/metrics") as resp:
                text = await resp.text()
            assert "bulletin_repairs_total 1" in text
            assert 'bulletin_verifications_total{result="damaged"} 1' in text
            status, headers, _ = await s.post("/v1/completions")
            assert status == 200 and headers["X-Bulletin-Version"] == "1"

    asyncio.run(scenario())


def test_damaged_bits_are_withdrawn_from_serving_until_a_repair_lands(tmp_path: Path) -> None:
    """With the keyframe gone from the bucket the repair cannot land: the node must stop
    serving the damaged version (no response labelled with it), not keep relaying it."""

    async def scenario() -> None:
        config = SidecarConfig(poll_interval=0.05, default_wait=0.2, verify_interval=0.1)
        async with stack(tmp_path, config) as s:
            metrics = s.sidecar.metrics
            await until(lambda: metrics.verifications.value("ok") >= 1, "a clean verification")
            for path in (s.store / RUN / "keyframes").rglob("*"):
                if path.is_file():
                    path.unlink()
            param = next(s.engine.model.parameters())
            with torch.no_grad():
                bits = param.view(torch.int16).view(-1)
                bits[5] = bits[5] ^ 1
            await until(lambda: metrics.verifications.value("damaged") >= 1, "the damage found")
            assert metrics.repairs.value() == 0
            assert s.sidecar.gate.active_version is None
            status, _, _ = await s.post("/v1/completions")
            assert status == 503  # not_ready, as a node that holds nothing
            async with s.client.get("/readyz") as resp:
                assert resp.status == 503

    asyncio.run(scenario())


def test_a_verification_in_progress_never_blocks_requests(tmp_path: Path) -> None:
    async def scenario() -> None:
        config = SidecarConfig(poll_interval=0.05, default_wait=5.0, verify_interval=0.1)
        async with stack(tmp_path, config) as s:
            target = s.sidecar.target
            assert target is not None
            inner: Any = target.inner
            entered, release = threading.Event(), threading.Event()
            real = inner.full_fingerprints

            def slow() -> dict[str, int]:
                entered.set()
                release.wait(10.0)
                return real()  # type: ignore[no-any-return]

            inner.full_fingerprints = slow
            try:
                assert await asyncio.to_thread(entered.wait, 10.0)
                for _ in range(3):
                    status, headers, _ = await asyncio.wait_for(s.post("/v1/completions"), 2.0)
                    assert status == 200 and headers["X-Bulletin-Version"] == "1"
                info = s.sidecar.describe()
                assert info["verifying"] is True and info["ready"] is True
                await s.publish()  # a sync waits for the check: it never races an apply
                await asyncio.sleep(0.2)
                assert s.sidecar.gate.active_version == 1
            finally:
                release.set()
            await s.wait_version(2)
            await until(lambda: s.sidecar.metrics.verifications.value("ok") >= 2, "checks after the release")

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def local_sidecar(tmp: Path, node: Path, config: SidecarConfig) -> AsyncIterator[Sidecar]:
    """A sidecar keeping the run's version in a folder, in front of a test engine."""
    engine_server = TestServer(Engine(make_module(1)).app())
    await engine_server.start_server()
    target = GatedTarget(LocalDirTarget(node, run=RUN), in_place=False)
    subscriber = Subscriber(str(tmp / "store"), RUN, target=target)
    sidecar = Sidecar(subscriber, str(engine_server.make_url("/")), config=config, target=target)
    client = TestClient(TestServer(sidecar.create_app()))
    await client.start_server()
    try:
        yield sidecar
    finally:
        await client.close()
        await engine_server.close()


def _publish_versions(store: Path, versions: int, *, keyframe_every: int = 10) -> None:
    trainer = make_module(0)
    with Publisher(str(store), RUN, keyframe_every=keyframe_every) as pub:
        for i in range(versions):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.linspace(-0.05, 0.05, p.numel()).reshape(p.shape) * (i + 1))
            pub.publish(trainer.state_dict())


def _folder_fps(node: Path) -> dict[str, int]:
    with Checkpoint(node / LocalDirTarget.CURRENT) as ckpt:
        return {name: fingerprint(np.array(ckpt.bits(name))) for name in ckpt.specs}


def test_a_folder_damaged_while_the_sidecar_was_down_is_repaired_at_start(tmp_path: Path) -> None:
    store, node = tmp_path / "store", tmp_path / "node"
    _publish_versions(store, 1)
    with Subscriber(str(store), RUN, node) as sub:
        assert sub.sync() == 1
    flip_a_bit(node)
    _publish_versions(store, 1)  # version 2 is a patch onto the bits of version 1

    async def scenario() -> None:
        config = SidecarConfig(poll_interval=0.05, verify_interval=3600.0)  # the start-up check only
        async with local_sidecar(tmp_path, node, config) as sidecar:
            await until(lambda: sidecar.gate.active_version == 2, "version 2")
            metrics = sidecar.metrics
            assert metrics.verifications.value("damaged") == 1 and metrics.repairs.value() == 1
            info = sidecar.describe()
            assert info["last_verify"]["ok"] is False and info["last_verify"]["repaired_to"] == 1

    asyncio.run(scenario())
    assert _folder_fps(node) == _manifest_fps(store, 2)


def test_a_rolled_back_run_is_reported_and_followed_only_when_allowed(tmp_path: Path) -> None:
    async def scenario() -> None:
        config = SidecarConfig(poll_interval=0.05, default_wait=5.0, max_backoff=0.1, verify_interval=0.0)
        async with stack(tmp_path, config) as s:
            await s.publish()
            await s.publish()
            await s.wait_version(3)
            await asyncio.to_thread(rewind, str(s.store), RUN, 2)

            def refused() -> bool:
                error = s.sidecar.describe()["last_error"]
                return error is not None and error["code"] == "run_rewound"

            await until(refused, "the refusal")
            assert s.sidecar.gate.active_version == 3
            status, headers, _ = await s.post("/v1/completions")
            assert status == 200 and headers["X-Bulletin-Version"] == "3"
            subscriber: Any = s.sidecar.subscriber
            subscriber.allow_reset = True  # what --allow-reset sets up front
            await s.wait_version(2)
            await until(lambda: s.sidecar.describe()["last_sync_ok"] is True, "a healthy sync")
            assert s.sidecar.target is not None
            assert s.sidecar.target.full_fingerprints() == _manifest_fps(s.store, 2)

    asyncio.run(scenario())


def test_settings_and_flags_reach_the_subscriber_and_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = SidecarSettings(
        store=str(tmp_path / "bucket"),
        run=RUN,
        upstream="http://127.0.0.1:9",
        local_dir=tmp_path / "node",
        allow_reset=True,
        config=SidecarConfig(verify_interval=5.0),
    )
    built = build_sidecar(settings)
    try:
        subscriber: Any = built.sidecar.subscriber
        assert subscriber.allow_reset is True and built.sidecar.config.verify_interval == 5.0
    finally:
        built.sidecar.subscriber.close()
    assert SidecarConfig().verify_interval == 3600.0

    seen: list[SidecarSettings] = []

    class Stack:
        def run(self) -> None:
            return None

    def fake_build(given: SidecarSettings) -> Stack:
        seen.append(given)
        return Stack()

    monkeypatch.setattr(compose_module, "build_sidecar", fake_build)
    where = ["--store", str(tmp_path / "bucket"), "--run", RUN, "--upstream", "http://127.0.0.1:9"]
    root = logging.getLogger()  # serve configures the process's logging: give it back after
    handlers, level = root.handlers[:], root.level
    try:
        code = main(["serve", *where, "--local-dir", str(tmp_path / "n"), "--allow-reset", "--verify-interval", "0"])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert code == 0 and len(seen) == 1
    assert seen[0].allow_reset is True and seen[0].config is not None and seen[0].config.verify_interval == 0.0
