"""scripts/bench_scale.py: its model generator, its node check, and a tiny end-to-end run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from scripts import bench_scale

ROOT = Path(__file__).resolve().parents[2]


def test_shapes_are_near_the_size_asked_for() -> None:
    for size in (0.5, 2.0, 6.0):
        model = bench_scale.Llama.of_size(size * bench_scale.GB)
        assert abs(model.nbytes / bench_scale.GB - size) / size < 0.1, model
        assert model.layers == model.hidden // 128
        assert model.heads * 64 == model.hidden


def test_versions_are_deterministic_and_change_the_share_asked_for(tmp_path: Path) -> None:
    model = bench_scale.Llama.of_size(2e6)
    v1, v2 = bench_scale.ensure_versions(tmp_path / "a", model, seed=0, share=0.004, shard_bytes=1 << 20)
    again, _ = bench_scale.ensure_versions(tmp_path / "b", model, seed=0, share=0.004, shard_bytes=1 << 20)
    assert len(list(v1.glob("*.safetensors"))) >= 2
    assert json.loads((v1 / "model.safetensors.index.json").read_text())["metadata"]["total_size"] == model.nbytes
    one, two, other = (dict(bench_scale.tensor_views(f)) for f in (v1, v2, again))
    changed = total = 0
    for name, bits in one.items():
        assert np.array_equal(bits, other[name])  # same seed, same bits
        delta = two[name].astype(np.int32) - bits.astype(np.int32)
        assert set(np.unique(delta)) <= {-1, 0, 1}  # one BF16 unit in the last place
        changed += int(np.count_nonzero(delta))
        total += bits.size
    assert 0.0035 < changed / total <= 0.004


def test_the_node_check_catches_a_wrong_version(tmp_path: Path) -> None:
    model = bench_scale.Llama.of_size(2e6)
    order = list(model.shapes())
    _, v2 = bench_scale.ensure_versions(tmp_path / "cache", model, seed=0, share=0.004, shard_bytes=1 << 20)
    node = tmp_path / "node"
    shutil.copytree(v2, node / "current")
    bench_scale.check_node(node, v2, 2, order, 0.004, 0)
    with pytest.raises(SystemExit, match="is not version 3"):
        bench_scale.check_node(node, v2, 3, order, 0.004, 0)


def _run(tmp_path: Path, *extra: str) -> dict[str, dict[str, object]]:
    out = tmp_path / "out.json"
    cmd = [sys.executable, "scripts/bench_scale.py", "--sizes", "0.004", "--catch-up", "3"]
    cmd += ["--cache", str(tmp_path / "cache"), "--work", str(tmp_path), "--json", str(out), *extra]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bulletin publish v1 (keyframe)" in result.stdout
    (size,) = json.loads(out.read_text())["results"]
    figures: dict[str, dict[str, object]] = size["figures"]
    return figures


@pytest.mark.slow
def test_bench_scale_smoke_local_store(tmp_path: Path) -> None:
    figures = _run(tmp_path, "--check")
    expected = {"cp", "save_file", "cli_keyframe", "cli_patch", "py_keyframe", "py_patch", "sync_fresh"}
    assert set(figures) == expected | {"catch_up_1", "catch_up_3"}
    for key, fig in figures.items():
        assert fig["ok"], (key, fig["error"])
        assert isinstance(fig["seconds"], float) and fig["seconds"] > 0
    for key in ("cli_keyframe", "cli_patch", "py_keyframe", "py_patch", "sync_fresh"):
        whats = {t["what"] for t in figures[key]["targets"]}  # type: ignore[attr-defined]
        assert whats == {"anon", "time"}, key
    for key in ("catch_up_1", "catch_up_3"):
        assert {t["what"] for t in figures[key]["targets"]} == {"anon", "writes/version"}  # type: ignore[attr-defined]
    # Counted through the store: a keyframe uploads the model, a patch far less.
    model = bench_scale.Llama.of_size(0.004 * bench_scale.GB).nbytes
    assert figures["cli_keyframe"]["store_up"] > 0.5 * model  # type: ignore[operator]
    assert figures["cli_patch"]["store_up"] < 0.1 * model  # type: ignore[operator]
    assert figures["py_keyframe"]["store_up"] > 0.5 * model  # type: ignore[operator]
    assert figures["sync_fresh"]["store_down"] > 0.5 * model  # type: ignore[operator]
    assert figures["cp"]["disk_write"] > 0.5 * model  # type: ignore[operator]


@pytest.mark.slow
def test_bench_scale_reports_an_operation_killed_for_memory(tmp_path: Path) -> None:
    figures = _run(tmp_path, "--max-anon-gb", "0.005")
    assert figures["cp"]["ok"]  # cp holds almost nothing
    for key in ("cli_keyframe", "save_file", "py_keyframe"):
        assert not figures[key]["ok"]
        assert "did not complete: out of memory" in str(figures[key]["error"]), figures[key]["error"]
    assert "skipped" in str(figures["cli_patch"]["error"])
