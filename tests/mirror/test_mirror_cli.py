"""``bulletin mirror`` and the subscriber commands' repeated ``--store``, through the CLI:
output, exit statuses, a clean stop of ``--follow`` on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import bulletin.sidecar.compose
from bulletin import Publisher
from bulletin.cli import main
from bulletin.mirror import Mirror
from bulletin.run import Run
from bulletin.sidecar import SidecarConfig, SidecarSettings, build_sidecar
from bulletin.storage import open_store
from tests.cli.test_serve import root_logging
from tests.mirror.helpers import assert_valid_mirror, objects
from tests.run.helpers import ToyTrainer, publish_versions
from tests.run.rollback import rewrite

ROOT = Path(__file__).resolve().parents[2]
__all__ = ["root_logging"]  # a fixture, used by name


def _json(capsys: pytest.CaptureFixture[str]) -> Any:
    return json.loads(capsys.readouterr().out)


def test_mirror_command_copies_reports_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    origin, mirror = str(tmp_path / "origin"), str(tmp_path / "mirror")
    publish_versions(origin, "run", 6, seed=51, keyframe_every=3)
    assert main(["mirror", "--from", origin, "--to", mirror, "--run", "run", "--keep", "2", "--json"]) == 0
    report = _json(capsys)
    assert report["versions"] == [4, 5, 6] and report["head_version"] == 6 and report["objects_copied"] > 0
    assert assert_valid_mirror(mirror) == [4, 5, 6]
    assert main(["mirror", "--from", origin, "--to", mirror, "--run", "run"]) == 0
    assert "nothing new" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("damage", "code", "error"),
    [
        ("rewritten", 10, "chain_mismatch"),
        ("corrupt", 5, "corrupt_data"),
        ("missing origin", 3, "not_found"),
        ("same store", 2, "config_error"),
    ],
)
def test_mirror_command_errors_are_typed_exit_statuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str, code: int, error: str
) -> None:
    origin, mirror = str(tmp_path / "origin"), str(tmp_path / "mirror")
    publish_versions(origin, "run", 2, seed=52, keyframe_every=3)
    Mirror(origin, mirror, "run").sync()
    source, destination = origin, mirror
    if damage == "rewritten":
        rewrite(origin, "run", 3, seed=53)
    elif damage == "corrupt":  # an object of version 3 already in the mirror, with other bytes
        with Publisher(origin, "run") as pub:
            trainer = ToyTrainer(seed=52)
            trainer.step()
            trainer.step()
            pub.publish(trainer.state)
        shard = Run(open_store(origin), "run").read_manifest(3).manifest.patch.shards[0]  # type: ignore[union-attr]
        open_store(mirror).put_if_absent(f"run/{shard.key}", b"\x01" * shard.size)
    elif damage == "missing origin":
        source = str(tmp_path / "no-such-origin")
    else:
        destination = origin
    before = objects(mirror)
    assert main(["mirror", "--from", source, "--to", destination, "--run", "run", "--json"]) == code
    assert _json(capsys)["error"]["code"] == error
    assert objects(mirror) == before  # nothing changed


def test_mirror_follow_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    origin, mirror = str(tmp_path / "origin"), str(tmp_path / "mirror")
    trainer = ToyTrainer(seed=54)
    pub = Publisher(origin, "run", keyframe_every=3)
    pub.publish(trainer.state)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "bulletin", "mirror", "--from", origin, "--to", mirror, "--run", "run"]
    with subprocess.Popen(
        [*command, "--follow", "--interval", "0.05", "--json"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            for version in (1, 2, 3):
                if version > 1:
                    trainer.step()
                    assert pub.publish(trainer.state) == version
                deadline = time.monotonic() + 60
                while (head := Run(open_store(mirror), "run").read_head()) is None or head.head.version < version:
                    assert time.monotonic() < deadline and proc.poll() is None, "the mirror did not follow"
                    time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
            pub.close()
    assert proc.returncode == 0, err
    decoder, docs, at = json.JSONDecoder(), [], 0
    while at < len(out.strip()):
        doc, at = decoder.raw_decode(out, at)
        docs.append(doc)
        while at < len(out) and out[at].isspace():
            at += 1
    assert [d["versions"] for d in docs] == [[1], [2], [3]]
    assert objects(mirror) == objects(origin)


def test_sync_and_status_take_several_stores(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    origin, mirror = str(tmp_path / "origin"), str(tmp_path / "mirror")
    trainer = ToyTrainer(seed=55)
    with Publisher(origin, "run", keyframe_every=3) as pub:
        pub.publish(trainer.state)
        Mirror(origin, mirror, "run").sync()
        trainer.step()
        pub.publish(trainer.state)  # the mirror lags by one version
    node = str(tmp_path / "node")
    stores = ["--store", mirror, "--store", origin]
    assert main(["sync", *stores, "--run", "run", "--to", node, "--json"]) == 0
    assert _json(capsys)["version"] == 1  # within the grace: the mirror's
    assert main(["sync", *stores, "--run", "run", "--to", node, "--lag-grace", "0", "--json"]) == 0
    assert _json(capsys)["version"] == 2  # the origin's, at once
    assert main(["status", *stores, "--run", "run", "--local", node, "--lag-grace", "0", "--json"]) == 0
    status = _json(capsys)
    assert [s["head_version"] for s in status["stores"]] == [1, 2]
    assert status["newest_version"] == 2 and status["local_version"] == 2 and status["local_chain"]["ok"]
    assert main(["status", *stores, "--run", "run"]) == 0
    assert "heads:" in capsys.readouterr().out


@pytest.mark.usefixtures("root_logging")
def test_serve_takes_several_stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[SidecarSettings] = []

    class Stack:
        def run(self) -> None:
            pass

    def build(settings: SidecarSettings) -> Stack:
        seen.append(settings)
        return Stack()

    monkeypatch.setattr(bulletin.sidecar.compose, "build_sidecar", build)
    mirror, origin = str(tmp_path / "mirror"), str(tmp_path / "origin")
    args = ["serve", "--store", mirror, "--store", origin, "--run", "r", "--lag-grace", "5"]
    assert main([*args, "--upstream", "http://127.0.0.1:9", "--local-dir", str(tmp_path / "node")]) == 0
    assert seen[0].store == (mirror, origin) and seen[0].lag_grace == 5


def test_a_sidecar_follows_its_mirror_first(tmp_path: Path) -> None:
    origin, mirror = str(tmp_path / "origin"), str(tmp_path / "mirror")
    publish_versions(origin, "r", 2, seed=56, keyframe_every=3)
    Mirror(origin, mirror, "r").sync()
    port = _free_port()
    stack = build_sidecar(
        SidecarSettings(
            store=(mirror, origin),
            run="r",
            engine="local",
            upstream="http://127.0.0.1:9",
            local_dir=tmp_path / "node",
            port=port,
            config=SidecarConfig(poll_interval=0.05),
        )
    )
    assert [run.store.url for run in stack.sidecar.subscriber.sources.runs] == [
        open_store(mirror).url,
        open_store(origin).url,
    ]

    async def scenario() -> dict[str, object]:
        stop = asyncio.Event()
        serving = asyncio.create_task(stack.serve(stop))
        try:
            for _ in range(200):
                await asyncio.sleep(0.05)
                try:
                    body = await asyncio.to_thread(_get, port, "/readyz")
                except OSError:
                    continue
                if body.get("current_version") == 2:
                    return body
            raise AssertionError("the sidecar never reached version 2")
        finally:
            stop.set()
            await serving

    assert asyncio.run(scenario())["current_version"] == 2


def _get(port: int, path: str) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
        body: dict[str, object] = json.loads(resp.read())
        return body


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
