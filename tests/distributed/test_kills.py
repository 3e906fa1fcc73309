"""A rank SIGKILLed at each phase of a sharded publish: never a partial or forked
version, and the restarted job continues the chain (tests/distributed/kills.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bulletin.distributed import PHASES

pytest.importorskip("torch.distributed")

ROOT = Path(__file__).resolve().parents[2]


def test_kill_trials_leave_no_partial_or_forked_version(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BULLETIN_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "tests.distributed.kills", str(tmp_path / "trials")],
        cwd=ROOT, env=env, capture_output=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    trials = json.loads(done.stdout)["trials"]
    assert len(trials) >= 50
    bad = [t for t in trials if t["problems"]]
    assert not bad, bad[:5]
    assert {t["phase"] for t in trials} == set(PHASES)
    # Both outcomes happen: a kill before the commit point loses the version, after it keeps it.
    assert any(t["tip"] == t["version"] - 1 for t in trials)
    assert any(t["tip"] == t["version"] for t in trials)
