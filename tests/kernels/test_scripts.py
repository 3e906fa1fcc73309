"""scripts/check_kernels.py and scripts/bench_gpu.py keep working (no GPU needed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_dry_run(tmp_path: Path) -> None:
    cmd = [sys.executable, "scripts/bench_gpu.py", "--dry-run", "--no-tests", "--reps", "1", "--out", str(tmp_path)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    report = json.loads((tmp_path / "bench_gpu_dry_run.json").read_text())
    assert report["errors"] == {}
    assert report["diff"]["bf16"]["changed"] > 0
    assert {"copy", "fused", "naive"} <= report["diff"]["bf16"].keys()
    assert report["diff"]["f32_to_bf16"]["fused"]["seconds"] > 0
    assert report["publish"]["changed"] > 0 and report["publish"]["shards"] >= 1
    assert report["apply"]["verified"] is True
    assert report["apply"]["gpu_gap_decoding"]["matches_cpu_decode"] is True
    assert report["select"]["exact"] is True and report["select"]["queries"] > 0
    assert report["select"]["fused_apply_fingerprint_exact"] is True


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_check_kernels_compiles_every_file() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/check_kernels.py"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    verdicts = [line for line in result.stdout.splitlines() if line.startswith(("ok ", "FAIL"))]
    assert len(verdicts) == len(list((ROOT / "kernels" / "bulletin_kernels").glob("*.cu")))
    assert all(line.startswith("ok ") for line in verdicts)


def test_check_kernels_without_nvcc(tmp_path: Path) -> None:
    script = [sys.executable, "scripts/check_kernels.py", "--nvcc", str(tmp_path / "no-nvcc")]
    local = subprocess.run(script, cwd=ROOT, capture_output=True, text=True, check=False, env={"PATH": "/usr/bin"})
    assert local.returncode == 0 and "skipped" in local.stdout
    ci = subprocess.run(
        script, cwd=ROOT, capture_output=True, text=True, check=False, env={"PATH": "/usr/bin", "CI": "1"}
    )
    assert ci.returncode == 1
