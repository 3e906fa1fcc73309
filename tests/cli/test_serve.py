"""``bulletin serve``'s wiring: flags -> SidecarSettings -> build_sidecar -> a serving sidecar."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bulletin import Publisher
from bulletin.cli import main
from bulletin.errors import ConfigError
from bulletin.sidecar import ENGINES, SidecarConfig, SidecarSettings, TorchEngineSettings, build_sidecar


@pytest.fixture
def root_logging() -> Iterator[None]:
    """``serve`` configures the process's logging; give the next tests theirs back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_engine_table_is_the_flag_s_choices() -> None:
    assert tuple(ENGINES) == ("local", "torch", "sglang", "vllm")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"engine": "triton"}, "unknown engine"),
        ({"engine": "torch"}, "--engine torch takes --model-config"),
        ({"engine": "torch", "torch": TorchEngineSettings(model_config=Path("c")), "upstream": "http://x"}, "neither"),
        ({"engine": "sglang", "upstream": None}, "--engine sglang needs --upstream and --local-dir"),
        ({"local_dir": None}, "--engine local needs"),
        ({"port": 70000}, "port"),
        ({"wait_for_engine": float("nan")}, "wait_for_engine"),
    ],
)
def test_settings_refuse_what_cannot_be_served(tmp_path: Path, changes: dict[str, object], message: str) -> None:
    base: dict[str, object] = {
        "store": str(tmp_path),
        "run": "r",
        "upstream": "http://127.0.0.1:9",
        "local_dir": tmp_path / "node",
    }
    with pytest.raises(ConfigError, match=message):
        SidecarSettings(**(base | changes))  # type: ignore[arg-type]


@pytest.mark.usefixtures("root_logging")
def test_serve_flags_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    where = ["--store", str(tmp_path / "bucket"), "--run", "r"]
    for extra in (["--engine", "torch"], ["--engine", "local", "--upstream", "http://127.0.0.1:9"]):
        code = main(["serve", *where, *extra])
        _, err = capsys.readouterr()
        assert code == 2 and err.startswith("error: config_error:") and err.count("\n") == 1, err
    code = main(["serve", *where, "--upstream", "ftp://x", "--local-dir", str(tmp_path / "node")])
    _, err = capsys.readouterr()
    assert code == 2 and "upstream must be an http(s) URL" in err


def test_build_sidecar_follows_the_run_into_a_local_folder(tmp_path: Path) -> None:
    store = str(tmp_path / "bucket")
    with Publisher(store, "r") as pub:
        pub.publish({"w": np.arange(64, dtype=np.float32)})
    node = tmp_path / "node"
    port = _free_port()
    settings = SidecarSettings(
        store=store,
        run="r",
        engine="local",
        upstream="http://127.0.0.1:9",
        local_dir=node,
        port=port,
        config=SidecarConfig(poll_interval=0.05),
    )
    stack = build_sidecar(settings)
    assert stack.sidecar.engine == "local" and stack.sidecar.run == "r"
    assert stack.sidecar.target is not None and stack.sidecar.target.in_place is False

    def get(path: str) -> tuple[int, dict[str, object]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())

    async def scenario() -> dict[str, object]:
        stop = asyncio.Event()
        serving = asyncio.create_task(stack.serve(stop))
        try:
            for _ in range(200):
                await asyncio.sleep(0.05)
                try:
                    status, body = await asyncio.to_thread(get, "/readyz")
                except OSError:
                    continue
                if status == 200:
                    return body
            raise AssertionError("the sidecar never became ready")
        finally:
            stop.set()
            await serving

    body = asyncio.run(scenario())
    assert body["current_version"] == 1 and body["engine"] == "local"
    assert (node / "current" / "model.safetensors").exists()
