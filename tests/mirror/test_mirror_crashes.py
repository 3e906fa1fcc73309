"""A mirror killed at every write of a copy, and at random instants, is valid after each
death and a fresh run completes it.

tests/mirror/crash_mirror.py forks a mirror per trial that dies just before its k-th
write to the mirror's store (every k of the copy, in order) or at a random instant.
After each death the mirror's store must keep its guarantees (every manifest there has
all its objects, intact, and its chain; the head names a version it holds), and a new
``Mirror(...).sync()`` must leave exactly what an uninterrupted copy leaves.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bulletin import Publisher
from bulletin.mirror import Mirror
from tests.mirror.helpers import assert_valid_mirror, objects
from tests.run.helpers import ToyTrainer
from tests.run.test_crashes import CrashNode

ROOT = Path(__file__).resolve().parents[2]
RANDOM_KILLS_PER_COPY = 8


class CrashMirror(CrashNode):
    """The zygote of tests/mirror/crash_mirror.py: one trial per request."""

    def __init__(self) -> None:  # CrashNode's, with the mirror's zygote
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.mirror.crash_mirror"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"


def _publish(url: str, versions: int, *, then: dict[int, Callable[[], None]]) -> None:
    """Publish ``versions`` versions; ``then[v]()`` runs once version ``v`` is committed."""
    trainer = ToyTrainer(seed=31, shapes={"w": (64, 48), "b": (48,), "e": (96, 32)})
    with Publisher(url, "run", keyframe_every=3, max_shard_bytes=8192) as pub:  # several shards a version
        for i in range(versions):
            if i:
                trainer.step(lr=3e-3)
            version = pub.publish(trainer.state)
            if version in then:
                then[version]()


def _fresh(template: Path | None, mirror: Path) -> None:
    if mirror.exists():
        shutil.rmtree(mirror)
    if template is not None:
        shutil.copytree(template, mirror)


@pytest.fixture
def fast_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder on tmpfs where there is one: the local store fsyncs every object, which costs
    nothing there, and what is under test (create by link, replace by rename) is the same."""
    if not Path("/dev/shm").is_dir():
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix="bulletin-crash-mirror-", dir="/dev/shm"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_mirror_killed_at_every_write_and_at_random_instants_resumes(fast_dir: Path) -> None:
    tmp_path = fast_dir
    origin = str(tmp_path / "origin")
    # name: (the version the mirror holds before the copy, None for an empty mirror; keep). With
    # "jump" the mirror is more than `keep` versions behind: it skips to the kept versions.
    copies: dict[str, tuple[int | None, int | None]] = {
        "fresh": (None, None),
        "behind": (4, None),
        "keep": (6, 2),
        "jump": (3, 2),
    }
    templates: dict[str, Path | None] = {name: None for name, (start, _) in copies.items() if start is None}

    def template(name: str, keep: int | None) -> Callable[[], None]:
        def make() -> None:
            templates[name] = tmp_path / f"template-{name}"
            Mirror(origin, str(templates[name]), "run", keep=keep).sync()

        return make

    _publish(origin, 8, then={start: template(name, keep) for name, (start, keep) in copies.items() if start})
    mirror = tmp_path / "mirror"
    zygote = CrashMirror()
    rng = np.random.default_rng(5)
    trials = dict.fromkeys(copies, 0)
    t0 = time.perf_counter()
    try:
        for name, (_, keep) in copies.items():
            _fresh(templates[name], mirror)
            counted = zygote.trial(origin=origin, destination=str(mirror), keep=keep)
            assert counted["code"] == 0 and not counted["killed"], name
            steps, duration = counted["steps"], counted["seconds"]
            expected = objects(str(mirror))
            assert_valid_mirror(str(mirror))
            kills: list[dict[str, Any]] = [{"kill_at": k} for k in range(len(steps))]
            kills += [{"kill_after": float(rng.uniform(0, duration))} for _ in range(RANDOM_KILLS_PER_COPY)]
            for kill in kills:
                _fresh(templates[name], mirror)
                answer = zygote.trial(origin=origin, destination=str(mirror), keep=keep, **kill)
                if "kill_at" in kill:
                    at = f"{name}, killed before step {kill['kill_at']} ({steps[kill['kill_at']]})"
                    assert answer["killed"] and answer["steps"][-1] == steps[kill["kill_at"]], at
                else:
                    at = f"{name}, killed after {kill['kill_after'] * 1000:.1f} ms (at {answer['steps'][-1:]})"
                # A valid mirror at the instant of death (after a jump, the old versions below a
                # gap until they are pruned, later in the same pass).
                assert_valid_mirror(str(mirror), gap=name == "jump")
                Mirror(origin, str(mirror), "run", keep=keep).sync()  # resumed by a fresh run
                assert objects(str(mirror)) == expected, at
                trials[name] += 1
    finally:
        zygote.close()
    total = sum(trials.values())
    print(f"{total} killed mirrors ({trials}) in {time.perf_counter() - t0:.1f}s")
    assert total >= 50, trials
