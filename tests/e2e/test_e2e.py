"""End to end on CPU: a trainer process fine-tunes a real (tiny) transformers model and
publishes every version; a rollout process serves it behind the sidecar (``bulletin
serve --engine torch``) and patches the live model in place. Through real HTTP, every
version's greedy tokens and logprobs must equal those of a model loaded directly with
the trainer's BF16 weights of that version; version gating is exercised on the way."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp
import pytest

from scripts._common import llama_config

pytestmark = pytest.mark.slow

RUN = "e2e"
PROMPTS = [[1, 17, 33, 5], [200, 3]]
MAX_TOKENS = 8
TOP = 3
HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    trainer: subprocess.Popen[str]
    rollout: subprocess.Popen[bytes]
    url: str
    log: Path

    def step(self) -> dict[str, Any]:
        """One training step; returns the trainer's version and reference answers."""
        stdin: IO[str] | None = self.trainer.stdin
        stdout: IO[str] | None = self.trainer.stdout
        assert stdin is not None and stdout is not None
        stdin.write("step\n")
        stdin.flush()
        line = stdout.readline()
        assert line, f"trainer exited ({self.trainer.poll()})"
        result: dict[str, Any] = json.loads(line)
        return result


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("e2e")
    config = llama_config(tied=True)  # tied weights: served once, patched through either name
    config.save_pretrained(tmp / "config")
    store = str(tmp / "store")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    trainer = subprocess.Popen(
        [
            *(sys.executable, str(HERE / "trainer.py"), store, RUN, str(tmp / "config")),
            *(json.dumps(PROMPTS), str(MAX_TOKENS), str(TOP)),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    port = _free_port()
    log = tmp / "rollout.log"
    with open(log, "wb") as log_file:
        rollout = subprocess.Popen(
            [
                *(sys.executable, "-m", "bulletin.sidecar", "--store", store, "--run", RUN, "--engine", "torch"),
                *("--model-config", str(tmp / "config"), "--port", str(port), "--poll-interval", "0.1"),
                *("--torch-threads", "1", "--default-wait", "30", "--drain-timeout", "30"),
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )
    cluster = Cluster(trainer, rollout, f"http://127.0.0.1:{port}", log)
    try:
        _wait_healthy(cluster)
        yield cluster
    finally:
        if trainer.stdin is not None:
            trainer.stdin.write("quit\n")
            trainer.stdin.close()
        rollout.send_signal(signal.SIGTERM)
        for proc in (trainer, rollout):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if trainer.stdout is not None:
            trainer.stdout.close()


def _wait_healthy(cluster: Cluster, timeout: float = 90.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cluster.rollout.poll() is not None:
            raise AssertionError(f"rollout exited:\n{cluster.log.read_text()}")
        try:
            with urllib.request.urlopen(f"{cluster.url}/healthz", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"rollout never became healthy:\n{cluster.log.read_text()}")


async def _complete(
    session: aiohttp.ClientSession, url: str, prompt: list[int], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    body = {"model": "bulletin-model", "prompt": prompt, "max_tokens": MAX_TOKENS, "logprobs": TOP}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers or {}) as resp:
        return resp.status, dict(resp.headers), await resp.json()


def _assert_matches(choice: dict[str, Any], expected: dict[str, Any]) -> None:
    assert choice["token_ids"] == expected["token_ids"]
    assert choice["logprobs"]["token_logprobs"] == expected["logprobs"]  # exact, not approximate
    assert choice["logprobs"]["top_logprobs"] == expected["top"]


async def _check_version(session: aiohttp.ClientSession, cluster: Cluster, published: dict[str, Any]) -> None:
    version = published["version"]
    for prompt, expected in zip(PROMPTS, published["expected"], strict=True):
        status, headers, body = await _complete(session, cluster.url, prompt, {"X-Bulletin-Min-Version": str(version)})
        assert status == 200, body
        assert headers["X-Bulletin-Version"] == str(version)
        _assert_matches(body["choices"][0], expected)


def test_every_version_served_equals_the_trainers_weights(cluster: Cluster) -> None:
    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            v1 = cluster.step()
            assert v1["version"] == 1
            await _check_version(session, cluster, v1)

            # Ahead of the trainer, with a short budget: a retryable 409.
            status, headers, body = await _complete(
                session, cluster.url, PROMPTS[0], {"X-Bulletin-Min-Version": "2", "X-Bulletin-Max-Wait-Ms": "300"}
            )
            assert status == 409 and body["error"]["code"] == "version_behind"
            assert int(headers["Retry-After"]) >= 1 and headers["X-Bulletin-Version"] == "1"

            # Asked before it exists, with a long budget: served as soon as it is published.
            waiting = asyncio.ensure_future(
                _complete(session, cluster.url, PROMPTS[0], {"X-Bulletin-Min-Version": "2"})
            )
            v2 = await asyncio.to_thread(cluster.step)
            status, headers, body = await waiting
            assert status == 200 and headers["X-Bulletin-Version"] == "2"
            _assert_matches(body["choices"][0], v2["expected"][0])

            # An exact version in the past is gone; the current one is served.
            status, _, body = await _complete(session, cluster.url, PROMPTS[0], {"X-Bulletin-Version": "1"})
            assert status == 410 and body["error"]["code"] == "version_gone"
            status, headers, _ = await _complete(session, cluster.url, PROMPTS[0], {"X-Bulletin-Version": "2"})
            assert status == 200 and headers["X-Bulletin-Version"] == "2"

            # Malformed requirements never reach the engine.
            status, _, body = await _complete(session, cluster.url, PROMPTS[0], {"X-Bulletin-Version": "two"})
            assert status == 400 and body["error"]["code"] == "invalid_input"

            # Streaming, with the requirement in the query string, passes through event by event.
            body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "logprobs": TOP, "stream": True}
            async with session.post(f"{cluster.url}/v1/completions?bulletin_min_version=2", json=body) as resp:
                assert resp.status == 200 and resp.headers["X-Bulletin-Version"] == "2"
                events = [line async for line in resp.content if line.strip()]
            assert events[-1] == b"data: [DONE]\n"
            chunks = [json.loads(e.removeprefix(b"data: "))["choices"][0] for e in events[:-1]]
            assert [t for c in chunks for t in c["token_ids"]] == v2["expected"][1]["token_ids"]
            assert [c["logprobs"]["token_logprobs"][0] for c in chunks[:-1]] == v2["expected"][1]["logprobs"]

            # More versions: patches and a keyframe (every third version), each checked.
            for _ in range(3):
                published = await asyncio.to_thread(cluster.step)
                await _check_version(session, cluster, published)

            async with session.get(f"{cluster.url}/version") as resp:
                info = await resp.json()
            assert info["current_version"] == 5 and info["last_sync_ok"] is True
            async with session.get(f"{cluster.url}/metrics") as resp:
                text = await resp.text()
            assert "bulletin_current_version 5" in text
            assert 'bulletin_requests_total{status="409"} 1' in text
            assert 'bulletin_requests_total{status="410"} 1' in text

    asyncio.run(scenario())
