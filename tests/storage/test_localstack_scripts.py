"""The LocalStack and test scripts: well-formed, and stop.sh never signals a stranger."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = [
    REPO / "localstack" / "install.sh",
    REPO / "localstack" / "start.sh",
    REPO / "localstack" / "stop.sh",
    REPO / "scripts" / "test.sh",
    REPO / ".ci" / "run",
]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_scripts_parse_and_are_executable(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert os.access(script, os.X_OK)


def _stop(run_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LOCALSTACK_RUN_DIR": str(run_dir)}
    return subprocess.run([str(REPO / "localstack" / "stop.sh")], env=env, capture_output=True, text=True, check=True)


def test_stop_without_a_server_is_a_no_op(tmp_path: Path) -> None:
    assert "not running" in _stop(tmp_path).stderr
    assert "not running" in _stop(tmp_path).stderr


def test_stop_ignores_a_pid_that_is_not_localstack(tmp_path: Path) -> None:
    # A stale pid file whose pid now belongs to another process (here: a sleeper).
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "localstack.pid").write_text(f"{sleeper.pid}\n")
        assert "stale" in _stop(tmp_path).stderr
        assert sleeper.poll() is None  # still alive: never signalled
        assert not (tmp_path / "localstack.pid").exists()
    finally:
        sleeper.kill()
        sleeper.wait()
