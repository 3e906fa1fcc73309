"""A real stack for sidecar tests: a local store, a Publisher, a Subscriber patching a
live torch module, a real HTTP engine on loopback, and the sidecar in front of it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from bulletin.engines.torch_module import TorchTarget
from bulletin.publisher import Publisher
from bulletin.sidecar import GatedTarget, Sidecar, SidecarConfig
from bulletin.subscriber import Subscriber

RUN = "sidecar-test"
#: Paths of the test engine that are not inference API paths, relayed in these tests.
TEST_PATHS = ("/hold", "/v1/stream")


@dataclass
class Engine:
    """An OpenAI-shaped engine on loopback that reports what it received.

    ``/v1/completions`` answers with the request's path, query and headers and the sum
    of the live weights (so a test can tell which version computed it). ``/hold``
    answers only once ``release`` is set. ``/v1/stream`` sends one SSE event, waits
    for ``release``, then sends another and ``[DONE]``.
    """

    model: torch.nn.Module
    received: list[dict[str, Any]] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    entered: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/hold", self._hold)
        app.router.add_post("/v1/stream", self._stream)
        app.router.add_get("/health", self._health)
        return app

    def weights_sum(self) -> float:
        return float(sum(p.detach().float().sum() for p in self.model.parameters()))

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.read()
        seen = {
            "path": request.path,
            "query": list(request.query.items()),
            "headers": dict(request.headers),
            "body": body.decode(),
            "weights": self.weights_sum(),
        }
        self.received.append(seen)
        return web.json_response(seen)

    async def _hold(self, request: web.Request) -> web.Response:
        self.entered.set()
        await self.release.wait()
        return web.json_response({"weights": self.weights_sum()})

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"n": 1}\n\n')
        self.entered.set()
        await self.release.wait()
        await response.write(b'data: {"n": 2}\n\n')
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def make_module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))


@dataclass
class Stack:
    store: Path
    trainer: torch.nn.Module
    publisher: Publisher
    engine: Engine
    sidecar: Sidecar
    client: TestClient[Any, Any]
    engine_server: TestServer

    async def publish(self, *, lr: float = 0.05) -> int:
        """One "training step" (a deterministic nudge of every weight), published."""
        with torch.no_grad():
            for p in self.trainer.parameters():
                p.add_(torch.linspace(-lr, lr, p.numel()).reshape(p.shape))
        return await asyncio.to_thread(self.publisher.publish, self.trainer.state_dict())

    async def wait_version(self, version: int, timeout: float = 10.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        # The gate serves a version as soon as it is activated; the sync worker records it
        # as held just after (a /readyz between the two still answers not_synced).
        while self.sidecar.gate.active_version != version or self._held() != version:
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"version {version} never became active ({self.sidecar.describe()})")
            await asyncio.sleep(0.01)

    def _held(self) -> int | None:
        status = self.sidecar.status()
        return status.current if status is not None else self.sidecar.gate.active_version

    async def post(self, path: str, body: Any = None, **kwargs: Any) -> tuple[int, dict[str, str], Any]:
        async with self.client.post(path, data=json.dumps(body or {}), **kwargs) as resp:
            text = await resp.text()
            try:
                parsed: Any = json.loads(text)
            except json.JSONDecodeError:
                parsed = text
            return resp.status, dict(resp.headers), parsed


@contextlib.asynccontextmanager
async def stack(tmp: Path, config: SidecarConfig | None = None, *, publish_first: bool = True) -> AsyncIterator[Stack]:
    store = tmp / "store"
    trainer = make_module(0)
    publisher = Publisher(str(store), RUN, keyframe_every=4)
    served = make_module(1).to(torch.bfloat16)
    engine = Engine(served)
    engine_server = TestServer(engine.app())
    await engine_server.start_server()
    target = GatedTarget(TorchTarget.from_module(served))
    subscriber = Subscriber(str(store), RUN, target=target)
    config = config or SidecarConfig(poll_interval=0.05, default_wait=5.0, drain_timeout=10.0)
    # The test engine's extra paths are relayed too (the default allow-list does not).
    config = dataclasses.replace(config, forward=(*config.forward, *TEST_PATHS))
    sidecar = Sidecar(subscriber, str(engine_server.make_url("/")), config=config, target=target)
    client = TestClient(TestServer(sidecar.create_app()))
    await client.start_server()
    s = Stack(store, trainer, publisher, engine, sidecar, client, engine_server)
    try:
        if publish_first:
            await s.publish()
            await s.wait_version(1)
        yield s
    finally:
        engine.release.set()
        await client.close()
        await engine_server.close()
        publisher.close()
