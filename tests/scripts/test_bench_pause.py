"""scripts/bench_pause.py: its TP part end to end at toy size, and how it finds vLLM's kit.

The TP run needs the vLLM source kit (``scripts/vllm_source.py``, as ``tests/tp``): it
skips without it, except under ``CI=true``, where a missing kit fails it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import bench_pause
from scripts._vllm_tp import VLLM_PATH_ENV
from tests.tp.conftest import vllm_kit  # noqa: F401  (the TP tests' skip, and failure under CI=true)

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "scripts/bench_pause.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=timeout)


@pytest.mark.slow
def test_the_tp_path_measures_both_pauses_next_to_vllms_reload(tmp_path: Path, vllm_kit: str) -> None:  # noqa: F811
    env = {**os.environ, VLLM_PATH_ENV: vllm_kit}
    out = tmp_path / "out.json"
    result = _bench("--tp", "2", "--tp-preset", "tiny", "--steps", "1", "--json", str(out), env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "== TP tiny" in result.stdout and "TP 2: median pause" in result.stdout
    assert "GPU path" not in result.stdout  # --tp alone: the in-process part does not run
    payload = json.loads(out.read_text())
    assert payload["results"] == []
    tp = payload["tp"]
    assert tp["preset"] == "tiny" and tp["parameters"] > 0
    [size] = tp["sizes"]
    assert size["tp"] == 2
    assert len(size["changed"]) == len(size["gate_pauses_s"]) == len(size["engine_pauses_s"]) == 1
    assert len(size["reloads_s"]) == len(size["file_reloads_s"]) == 1
    assert 0 < size["changed"][0] < tp["parameters"]
    # The engine is paused inside the sidecar's gate, never longer.
    assert 0 < size["engine_pauses_s"][0] <= size["gate_pauses_s"][0]
    assert size["median_reload_s"] > 0 and size["median_file_reload_s"] > 0
    assert size["reload_over_engine_pause"] == pytest.approx(size["median_reload_s"] / size["median_engine_pause_s"])


def test_without_the_kit_tp_is_refused_with_the_reason(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != VLLM_PATH_ENV}
    env["BULLETIN_VLLM_KIT_DIR"] = str(tmp_path / "no-kit")
    result = _bench("--tp", "2", env=env, timeout=120)
    assert result.returncode == 2
    assert f"--tp needs vLLM's source kit: {VLLM_PATH_ENV} is not set" in result.stderr
    assert "scripts/vllm_source.py" in result.stderr


def test_the_kit_is_the_variable_else_a_complete_cached_kit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from scripts import vllm_source

    monkeypatch.delenv(VLLM_PATH_ENV, raising=False)
    kit = tmp_path / "kit"
    monkeypatch.setenv("BULLETIN_VLLM_KIT_DIR", str(kit))
    path, why = bench_pause.find_kit()
    assert path is None and str(kit) in why
    kit.mkdir()  # a half-built kit (no stamp) is not a kit
    assert bench_pause.find_kit()[0] is None
    (kit / vllm_source.STAMP).write_text("done\n")
    assert bench_pause.find_kit() == (vllm_source.search_path(kit), "")
    monkeypatch.setenv(VLLM_PATH_ENV, "/given")
    assert bench_pause.find_kit() == ("/given", "")


def test_tp_sizes_are_a_list_of_positive_integers() -> None:
    import argparse

    assert bench_pause._tp_sizes("1,2,4") == [1, 2, 4]
    for bad in ("", "two", "0", "2,-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_pause._tp_sizes(bad)
