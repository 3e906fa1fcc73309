"""scripts/bench_codec.py runs end to end on a tiny corpus and a toy synthetic model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import corpora
from tests.scripts.conftest import tiny_spec

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_bench_codec_smoke(tiny_cache: Path, tmp_path: Path) -> None:
    (folder,) = corpora.materialize([tiny_spec()], tmp_path / "corpora", tiny_cache)
    out = tmp_path / "results.json"
    cmd = [sys.executable, "scripts/bench_codec.py", "--corpus", str(folder), "--synthetic-gb", "0.002"]
    cmd += ["--sweep", "--repeat", "1", "--warm", "--json", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    corpus = report["corpora"]["llama-rl-lr1e-6"]
    assert [t["step"] for t in corpus["transitions"]] == [2, 3, 4, 5, 6]
    names = report["codecs"]
    assert names[:2] == ["zstd", "lz4"]  # and the context codec, once patcher has it
    for i, t in enumerate(corpus["transitions"]):
        for name in names:
            c = t["codecs"][name]
            assert c["bytes_per_changed"] > c["payload_bytes_per_changed"] > 0
            assert c["encode_gbps"] > 0 and c["decode_apply_one_thread_gbps"] > 0
        assert t["codecs"]["zstd"]["vs_zstd"]["bytes"] == 1
        b = t["bounds"]
        # Conditioning never raises an empirical entropy.
        assert b["exponent+previous"]["bytes_per_changed"] <= b["exponent"]["bytes_per_changed"] + 1e-9
        assert b["exponent"]["bytes_per_changed"] <= b["iid"]["bytes_per_changed"] + 1e-9
        assert (b["exponent"]["held_out_bytes_per_changed"] is None) == (i == 0)
        if "context" in names:  # its own bounds: the model's contexts and the coder's decisions
            assert {"codec", "coder"} <= b.keys()
    fold = corpus["fold5"]
    assert fold["steps"] == [2, 3, 4, 5, 6] and 0 < fold["changed"] <= fold["sum_changed"]
    assert report["synthetic"]["main"]["codecs"]["zstd"]["bytes_per_changed"] > 0
    assert set(report["targets"]) == set(names) - {"zstd", "lz4"}
    assert set(fold["codecs"]) == set(names)
