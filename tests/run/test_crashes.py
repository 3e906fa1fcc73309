"""Killed trainers and killed nodes never leave a half-visible or wrong version.

The trainer tests run on the local-directory store here and on LocalStack in
test_s3_run.py (same scenarios, real S3 conditional writes).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bulletin import Publisher, Subscriber
from bulletin.maintenance import verify
from bulletin.run import Run
from bulletin.storage import open_store
from bulletin.target import ArrayTarget, LocalDirTarget
from patcher.fingerprint import fingerprint
from tests.run.helpers import ToyTrainer, assert_bits_equal

ROOT = Path(__file__).resolve().parents[2]
CRASH_POINTS = ["shard", "manifest", "head", "after"]


def crash_publisher(url: str, run: str, seed: int, steps: int, crash_at: str) -> int:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.run.crash_publisher", url, run, str(seed), str(steps), crash_at],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return proc.returncode


def check_trainer_crash(url: str, crash_at: str, steps: int) -> None:
    """Kill a trainer at ``crash_at`` while it commits version ``steps``, then resume."""
    run = f"crash-{crash_at}"
    code = crash_publisher(url, run, seed=11, steps=steps, crash_at=crash_at)
    assert code == -signal.SIGKILL
    remote = Run(open_store(url), run)
    committed = steps if crash_at in ("head", "after") else steps - 1
    assert remote.versions() == list(range(1, committed + 1))  # nothing half-visible
    head = remote.read_head()
    head_version = committed if crash_at == "after" else steps - 1
    assert (head.head.version if head else 0) == head_version

    # A node sees exactly the committed versions, bit-exact.
    trainer = ToyTrainer(seed=11)
    node = ArrayTarget()
    for _ in range(committed - 1):
        trainer.step()
    if committed:
        assert Subscriber(url, run, target=node).sync() == committed
        assert_bits_equal(node.arrays, trainer.served())
        trainer.step()

    # A new trainer continues the chain from the newest committed version.
    with Publisher(url, run, keyframe_every=3) as pub:
        assert pub.publish(trainer.state) == committed + 1
    assert remote.read_head().head.version == committed + 1  # type: ignore[union-attr]
    report = verify(remote)
    assert report.ok, report.problems
    assert Subscriber(url, run, target=node).sync() == committed + 1
    assert_bits_equal(node.arrays, trainer.served())


@pytest.mark.parametrize("crash_at", CRASH_POINTS)
@pytest.mark.parametrize("steps", [1, 2, 4])
def test_trainer_killed_during_a_commit_local(tmp_path: Path, crash_at: str, steps: int) -> None:
    check_trainer_crash(str(tmp_path / "bucket"), crash_at, steps)


SYNC_LOOP = """
import sys
from bulletin import Subscriber
sub = Subscriber(sys.argv[1], "run", sys.argv[2])
print("ready", flush=True)
while True:
    for v in (1, 5, 2, 6, 3, 4):
        sub.sync(v)
"""


@pytest.mark.slow
def test_node_killed_at_any_instant_recovers_an_exact_version(tmp_path: Path) -> None:
    url = str(tmp_path / "bucket")
    trainer = ToyTrainer(seed=12, shapes={"w": (256, 256), "b": (256,), "e": (512, 64)})
    expected = {}
    with Publisher(url, "run", keyframe_every=4) as pub:
        for i in range(6):
            if i:
                trainer.step(lr=3e-3)
            expected[pub.publish(trainer.state)] = {n: fingerprint(b) for n, b in trainer.served().items()}
    node = tmp_path / "node"
    rng = np.random.default_rng(0)
    for _ in range(12):
        with subprocess.Popen(
            [sys.executable, "-c", SYNC_LOOP, url, str(node)], cwd=ROOT, stdout=subprocess.PIPE, text=True
        ) as proc:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            time.sleep(float(rng.uniform(0.0, 0.4)))
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        target = LocalDirTarget(node, run="run")
        restored = target.restored()
        if restored is None:
            continue
        version, fps = restored.version, restored.fingerprints
        assert fps == expected[version]
        assert target.full_fingerprints() == expected[version], f"bits on disk are not version {version}"
        target.close()
    final = Subscriber(url, "run", node)
    assert final.sync() == 6
    assert final.target.full_fingerprints() == expected[6]
