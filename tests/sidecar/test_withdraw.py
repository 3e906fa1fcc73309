"""The sidecar never serves a version label over bits it cannot vouch for: a keyframe load
that fails on live weights (no second copy to put back) withdraws the version."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from bulletin.errors import EngineError
from bulletin.sidecar import SidecarConfig
from tests.sidecar.harness import stack


def test_a_failed_load_into_live_weights_withdraws_the_version(tmp_path: Path) -> None:
    async def scenario() -> None:
        config = SidecarConfig(poll_interval=0.05, default_wait=0.2, verify_interval=0)
        async with stack(tmp_path, config) as s:
            await s.publish()
            await s.wait_version(2)
            target = s.sidecar.target
            assert target is not None and not target.restores_loads
            inner: Any = target.inner
            real = inner.activate

            def refuse(version: int, *, manifest_digest: str | None = None) -> None:
                raise EngineError("the engine refused the new weights")

            inner.activate = refuse
            try:
                subscriber = s.sidecar.subscriber
                with pytest.raises(EngineError):
                    await asyncio.to_thread(subscriber.sync, 1)  # a keyframe route into live weights
                await asyncio.to_thread(target.finish)
                assert subscriber.current_version is None
                assert s.sidecar.gate.active_version is None
                status, _, _ = await s.post("/v1/completions")
                assert status == 503
            finally:
                inner.activate = real
            await s.wait_version(2)  # the worker brings a verified version back
            status, headers, _ = await s.post("/v1/completions")
            assert status == 200 and headers["X-Bulletin-Version"] == "2"

    asyncio.run(scenario())
