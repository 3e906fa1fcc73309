"""Killed trainers and killed nodes never leave a half-visible or wrong version.

The trainer tests run on the local-directory store here and on LocalStack in
test_s3_run.py (same scenarios, real S3 conditional writes).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bulletin import Publisher, Subscriber
from bulletin.checkpoint import Checkpoint
from bulletin.maintenance import verify
from bulletin.replica_log import LogDirTarget
from bulletin.run import Run
from bulletin.storage import open_store
from bulletin.target import ArrayTarget, Held, LocalDirTarget, read_local_state
from patcher.fingerprint import fingerprint, parse_fingerprint
from schemas.local_state import LocalStateV3
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
        target = LocalDirTarget(node, run="run")  # the locked open: recovery, the link repaired
        restored = target.restored()
        if restored is None:
            target.close()
            continue
        version, fps = restored.version, restored.fingerprints
        assert fps == expected[version]
        assert target.full_fingerprints() == expected[version], f"bits on disk are not version {version}"
        state = read_local_state(node)
        assert state is not None and os.readlink(node / LocalDirTarget.CURRENT) == state.model_dir
        target.close()
    final = Subscriber(url, "run", node)
    assert final.sync() == 6
    assert final.target.full_fingerprints() == expected[6]


# -- a node killed at every step of every route ----------------------------------------------
#
# tests/run/crash_node.py forks a node per trial that dies just before the k-th call that
# changes a file (every k of the route, in order) or at a random instant. After each
# death a locked open (what any next writer does) must leave the folder on an exact
# version: `current` resolving to the folder state.json names, holding the bits
# state.json records (fingerprints recomputed) and that version's model files byte for
# byte (every route below changes some: added, changed, removed, nested), and nothing else
# in the folder.

#: name: (version held at the start, None for an empty folder; version synced to)
ROUTES: dict[str, tuple[int | None, int]] = {
    "fresh": (None, 5),  # keyframe 4 into an empty folder, then patch 5 in place
    "keyframe": (1, 4),  # a newer keyframe over a held version (cheaper than its patches)
    "downgrade": (5, 1),  # an older version: through its keyframe
    "catch-up": (4, 6),  # patches 5 and 6, folded, applied in place
    "recovery": (4, 6),  # as catch-up, from a node killed halfway through that apply
}
RANDOM_KILLS_PER_ROUTE = 40
BASE_FILES = {LocalDirTarget.STATE, LocalDirTarget.CURRENT, LocalDirTarget.LOCK}

#: The model files of each version of the crash run: every route changes some.
_CONFIG = b'{"model_type": "toy", "torch_dtype": "bfloat16"}\n'
_TOKENIZER = b'{"version": "1.0", "model": {"type": "BPE"}}\n'
CRASH_FILES: dict[int, dict[str, bytes]] = {
    1: {"config.json": _CONFIG, "tokenizer.json": _TOKENIZER},
    2: {"config.json": _CONFIG, "tokenizer.json": _TOKENIZER},
    3: {"config.json": _CONFIG, "tokenizer.json": _TOKENIZER},
    4: {"config.json": _CONFIG, "tokenizer.json": _TOKENIZER + b" ", "chat_template.jinja": b"{{ messages }}"},
    5: {"config.json": _CONFIG.replace(b"toy", b"toy2"), "tokenizer.json": _TOKENIZER + b" "},
    6: {
        "config.json": _CONFIG.replace(b"toy", b"toy2"),
        "tokenizer.json": _TOKENIZER + b" ",
        "original/tokenizer.model": b"\x00sentencepiece\xff",
    },
}


class CrashNode:
    """The zygote of tests/run/crash_node.py: one trial per request."""

    def __init__(self) -> None:
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.run.crash_node"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def trial(self, **request: object) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return answer

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


def publish_crash_run(url: str) -> dict[int, dict[str, int]]:
    """Versions 1..6, keyframes 1 and 4; 2..4 change every element (so that from 1 the
    keyframe 4 is cheaper than three patches), 5 and 6 a few percent."""
    trainer = ToyTrainer(seed=21, shapes={"w": (96, 64), "b": (64,), "e": (128, 48), "n.norm.weight": (64,)})
    expected = {}
    with Publisher(url, "run", keyframe_every=3) as pub:
        for version in range(1, 7):
            if version > 1:
                trainer.step(lr=0.05 if version <= 4 else 3e-4)
            assert pub.publish(trainer.state, files=CRASH_FILES[version]) == version
            expected[version] = {n: fingerprint(b) for n, b in trainer.served().items()}
    return expected


def model_files(folder: Path) -> dict[str, bytes]:
    """Every file of a model folder but its tensors and mark, by relative path."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_dir() or rel == LocalDirTarget.MARKER or rel.endswith(".safetensors"):
            continue
        out[rel] = path.read_bytes()
    return out


def assert_exact_version(node: Path, expected: dict[int, dict[str, int]], allowed: set[int | None], why: str) -> None:
    """Open ``node`` as the next writer would, then check it holds an exact version."""
    target = LocalDirTarget(node, run="run")  # the locked open: recovery, the link repaired
    try:
        state = read_local_state(node)
        version = state.version if state else None
        assert version in allowed, f"{why}: version {version}, expected one of {allowed}"
        if state is None:
            assert target.restored() is None
            assert set(os.listdir(node)) == {LocalDirTarget.LOCK}, f"{why}: left {sorted(os.listdir(node))}"
            return
        assert {n: parse_fingerprint(f) for n, f in state.fingerprints.items()} == expected[state.version], why
        assert os.readlink(node / LocalDirTarget.CURRENT) == state.model_dir, why
        assert (node / LocalDirTarget.CURRENT).resolve() == (node / state.model_dir).resolve(), why
        with Checkpoint(node / LocalDirTarget.CURRENT) as ckpt:
            held = {name: fingerprint(ckpt.bits(name)) for name in ckpt.specs}
        assert held == expected[state.version], f"{why}: the bits in current/ are not version {state.version}"
        assert target.full_fingerprints() == expected[state.version], why
        files = CRASH_FILES[state.version]
        held_files = model_files(node / LocalDirTarget.CURRENT)
        assert held_files == files, (
            f"{why}: the files in current/ are {sorted(held_files)}, not version {state.version}'s"
        )
        assert target.files == {p: hashlib.sha256(b).hexdigest() for p, b in files.items()}, why
        assert sorted(os.listdir(node / LocalDirTarget.FILES)) == sorted(
            {hashlib.sha256(b).hexdigest() for b in files.values()}
        ), why
        base = BASE_FILES | {state.model_dir, LocalDirTarget.FILES}
        assert set(os.listdir(node)) == base, f"{why}: left {sorted(os.listdir(node))}"
    finally:
        target.close()


def fresh_copy(template: Path | None, node: Path) -> None:
    if node.exists():
        shutil.rmtree(node)
    if template is not None:
        shutil.copytree(template, node, symlinks=True)


def test_node_killed_at_every_step_of_every_route_recovers_an_exact_version(tmp_path: Path) -> None:
    url = str(tmp_path / "bucket")
    expected = publish_crash_run(url)
    templates: dict[str, Path | None] = {}
    for name, (start, _) in ROUTES.items():
        if start is None or name == "recovery":  # recovery's is made below
            templates[name] = None
            continue
        templates[name] = tmp_path / f"template-{name}"
        with Subscriber(url, "run", templates[name]) as sub:
            assert sub.sync(start) == start
    with Subscriber(url, "run", tmp_path / "probe") as sub:  # the routes are the ones named
        sub.sync(1)
        sub.sync(4)
        assert sub.stats.last_report is not None and sub.stats.last_report.keyframe == 4
        sub.sync(6)
        assert sub.stats.last_report is not None and sub.stats.last_report.transitions == 2
    node = tmp_path / "node"
    zygote = CrashNode()
    rng = np.random.default_rng(7)
    trials = {name: 0 for name in ROUTES}
    t0 = time.perf_counter()
    try:
        # The recovery route starts from a node killed halfway through the catch-up apply.
        fresh_copy(templates["catch-up"], node)
        steps = zygote.trial(url=url, node=str(node), version=6)["steps"]
        fresh_copy(templates["catch-up"], node)
        half = steps.index("apply: half the changes written")
        assert zygote.trial(url=url, node=str(node), version=6, kill_at=half)["killed"]
        assert (node / LocalDirTarget.JOURNAL).exists()
        templates["recovery"] = tmp_path / "template-recovery"
        shutil.copytree(node, templates["recovery"], symlinks=True)

        for name, (start, target) in ROUTES.items():
            allowed = {start, target} | ({4} if name == "fresh" else set())
            fresh_copy(templates[name], node)
            counted = zygote.trial(url=url, node=str(node), version=target)
            assert counted["code"] == 0 and not counted["killed"], name
            steps = counted["steps"]
            assert_exact_version(node, expected, {target}, f"{name}, not killed")
            duration = counted["seconds"]
            kills: list[dict[str, Any]] = [{"kill_at": k} for k in range(len(steps))]
            kills += [{"kill_after": float(rng.uniform(0, duration))} for _ in range(RANDOM_KILLS_PER_ROUTE)]
            for kill in kills:
                fresh_copy(templates[name], node)
                answer = zygote.trial(url=url, node=str(node), version=target, **kill)
                at = f"{name}, killed at step {kill['kill_at']} ({steps[kill['kill_at']]})" if "kill_at" in kill else ""
                if "kill_at" in kill:
                    assert answer["killed"] and answer["steps"][-1] == steps[kill["kill_at"]], at
                else:
                    at = f"{name}, killed after {kill['kill_after'] * 1000:.2f} ms (at {answer['steps'][-1:]})"
                assert_exact_version(node, expected, allowed, at)
                trials[name] += 1
            # And the node goes on from whatever it was left at (a no-op sync included).
            with Subscriber(url, "run", node) as sub:
                assert sub.sync(target) == target
            assert_exact_version(node, expected, {target}, f"{name}: synced after the kills")
    finally:
        zygote.close()
    elapsed = time.perf_counter() - t0
    total = sum(trials.values())
    print(f"{total} killed nodes ({trials}) in {elapsed:.1f}s")
    assert total >= 200, trials


# -- the log layout (docs/FORMAT.md 9.1): every step of sync, compaction and recovery ----------

#: name: (how the template is made: the versions synced one after another, "dense:" first
#: for a dense folder; the request; the versions a kill may leave)
LOG_ROUTES: dict[str, tuple[list[int], dict[str, Any], set[int | None]]] = {
    "fresh": ([], {"version": 5}, {None, 4, 5}),  # keyframe 4 into a new base, patch 5 into it
    "keyframe": ([1], {"version": 4}, {1, 4}),  # a new base replaces base 1
    "append": ([4, 5], {"version": 6}, {5, 6}),  # base 4, log [5]: log [5, 6]
    "catch-up": ([4], {"version": 6}, {4, 6}),  # 5 and 6 folded into one entry
    "downgrade": ([4, 5], {"version": 1}, {5, 1}),  # base and log replaced by keyframe 1
    "convert": ([-4], {"version": 6}, {4, 6}),  # a dense folder at 4 becomes the base
    "compact": ([4, 5, 6], {"version": 6, "op": "compact"}, {6}),
    "auto-compact": ([4, 5], {"version": 6, "compact_share": 0.01}, {5, 6}),
    # A background compaction of version 5 (60% of the elements changed since base 4, over
    # the share; its copies held back until the syncs end) while 6 is applied and
    # activated (60% is under BACKLOG_FACTOR times the share: 6 does not wait for it):
    # it commits base 5 with the log [6].
    "background": ([4], {"version": 6, "through": [5], "compact_share": 0.45, "hold_copies": True}, {4, 5, 6}),
    # A background compaction of version 6 made moot by keyframe 1, activated meanwhile.
    "keyframe-mid-compaction": (
        [4, 5],
        {"version": 1, "through": [6], "compact_share": 0.45, "hold_copies": True},
        {5, 6, 1},
    ),
}
#: Routes whose compaction runs on a thread of its own: their steps interleave with the
#: sync's, so a kill at step k stops at whichever step came k-th in that run.
THREADED = {"background", "keyframe-mid-compaction"}


def assert_exact_log_version(
    node: Path, expected: dict[int, dict[str, int]], allowed: set[int | None], why: str
) -> None:
    """Open ``node`` as the next log-layout writer would, then check it holds an exact version."""
    target = LogDirTarget(node, run="run")
    try:
        state = read_local_state(node)
        version = state.version if state else None
        assert version in allowed, f"{why}: version {version}, expected one of {allowed}"
        if state is None:
            assert target.restored() is None
            assert set(os.listdir(node)) <= {LocalDirTarget.LOCK, LogDirTarget.LOG}, f"{why}: {os.listdir(node)}"
            return
        entries = state.log if isinstance(state, LocalStateV3) else []  # a dense folder: its base, no log
        assert target.restored() == Held(state.version, expected[state.version]), why
        assert target.full_fingerprints() == expected[state.version], f"{why}: the bits held are not {version}"
        files = CRASH_FILES[state.version]
        assert target.files == {p: hashlib.sha256(b).hexdigest() for p, b in files.items()}, why
        assert sorted(os.listdir(node / LocalDirTarget.FILES)) == sorted(
            {hashlib.sha256(b).hexdigest() for b in files.values()}
        ), why
        listed = {LocalDirTarget.STATE, LocalDirTarget.LOCK, LocalDirTarget.FILES, state.model_dir}
        if not entries:  # the base is exactly the version: `current` is a loadable checkpoint of it
            listed.add(LocalDirTarget.CURRENT)
            assert os.readlink(node / LocalDirTarget.CURRENT) == state.model_dir, why
            with Checkpoint(node / LocalDirTarget.CURRENT) as ckpt:
                assert {n: fingerprint(ckpt.bits(n)) for n in ckpt.specs} == expected[state.version], why
            assert model_files(node / LocalDirTarget.CURRENT) == files, why
        logs = set(os.listdir(node / LogDirTarget.LOG)) if (node / LogDirTarget.LOG).is_dir() else set()
        assert logs == {Path(e.file).name for e in entries}, f"{why}: log/ holds {sorted(logs)}"
        assert set(os.listdir(node)) - {LogDirTarget.LOG} == listed, f"{why}: left {sorted(os.listdir(node))}"
    finally:
        target.close()


def make_log_template(url: str, where: Path, versions: list[int]) -> None:
    if versions and versions[0] < 0:  # a dense folder
        with Subscriber(url, "run", where) as sub:
            assert sub.sync(-versions[0]) == -versions[0]
        return
    target = LogDirTarget(where, run="run", compact_share=1.0)
    with Subscriber(url, "run", target=target) as sub:
        for version in versions:
            assert sub.sync(version) == version
    if not versions:
        shutil.rmtree(where)


def test_log_node_killed_at_every_step_of_sync_compaction_and_recovery_recovers_an_exact_version(
    tmp_path: Path,
) -> None:
    url = str(tmp_path / "bucket")
    expected = publish_crash_run(url)
    node = tmp_path / "node"
    zygote = CrashNode()
    rng = np.random.default_rng(8)
    trials: dict[str, int] = {}
    recovery_templates: list[Path] = []
    try:
        for name, (versions, request, allowed) in LOG_ROUTES.items():
            template: Path | None = tmp_path / f"log-template-{name}"
            make_log_template(url, template, versions)  # type: ignore[arg-type]
            if not versions:
                template = None
            fresh_copy(template, node)
            counted = zygote.trial(url=url, node=str(node), layout="log", **request)
            assert counted["code"] == 0 and not counted["killed"], name
            steps = counted["steps"]
            assert_exact_log_version(node, expected, {request["version"]}, f"{name}, not killed")
            if name == "background":  # version 6 was applied while the compaction of 5 ran
                state = read_local_state(node)
                assert isinstance(state, LocalStateV3) and state.base_version == 5, state
                assert [entry.version for entry in state.log] == [6], state.log
            kills: list[dict[str, Any]] = [{"kill_at": k} for k in range(len(steps))]
            kills += [{"kill_after": float(rng.uniform(0, counted["seconds"]))} for _ in range(15)]
            for kill in kills:
                fresh_copy(template, node)
                answer = zygote.trial(url=url, node=str(node), layout="log", **request, **kill)
                at = f"{name}, killed at step {kill['kill_at']} ({steps[kill['kill_at']]})" if "kill_at" in kill else ""
                if "kill_at" in kill and name in THREADED:
                    at = f"{name}, killed at step {kill['kill_at']} ({answer['steps'][-1:]})"
                    # Threads interleave: a run may take fewer steps than the one counted.
                    assert answer["killed"] or answer["code"] == 0, at
                elif "kill_at" in kill:
                    assert answer["killed"] and answer["steps"][-1] == steps[kill["kill_at"]], at
                if "kill_at" in kill:
                    if kill["kill_at"] in (len(steps) // 3, len(steps) // 2, 2 * len(steps) // 3):
                        left = tmp_path / f"left-{name}-{kill['kill_at']}"  # leftovers recovery must clear
                        shutil.copytree(node, left, symlinks=True)
                        recovery_templates.append(left)
                else:
                    at = f"{name}, killed after {kill['kill_after'] * 1000:.2f} ms (at {answer['steps'][-1:]})"
                assert_exact_log_version(node, expected, allowed, at)
                trials[name] = trials.get(name, 0) + 1
            with Subscriber(url, "run", target=LogDirTarget(node, run="run")) as sub:
                assert sub.sync(request["version"]) == request["version"]
            assert_exact_log_version(node, expected, {request["version"]}, f"{name}: synced after the kills")
        # Recovery itself, killed at each of its steps, on folders a killed writer left.
        for left in recovery_templates:
            fresh_copy(left, node)
            counted = zygote.trial(url=url, node=str(node), layout="log", version=1, op="open")
            assert counted["code"] == 0, left.name
            allowed_left: set[int | None] = {None, 1, 4, 5, 6}
            for k in range(len(counted["steps"])):
                fresh_copy(left, node)
                answer = zygote.trial(url=url, node=str(node), layout="log", version=1, op="open", kill_at=k)
                assert answer["killed"], left.name
                assert_exact_log_version(node, expected, allowed_left, f"recovery of {left.name}, killed at {k}")
                trials["recovery"] = trials.get("recovery", 0) + 1
    finally:
        zygote.close()
    print(f"{sum(trials.values())} killed log-layout nodes ({trials})")
    assert trials.get("recovery", 0) >= 10 and all(trials.get(name, 0) >= 15 for name in LOG_ROUTES), trials
