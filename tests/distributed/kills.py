"""Kill trials: a rank of a sharded publishing job SIGKILLed at each phase of a publish.

``python -m tests.distributed.kills OUT_DIR`` prints one JSON summary. Each trial forks a
two-rank job (gloo over a fresh file store) that publishes a run whose version ``v`` has
known contents (:func:`expected`); one rank kills itself at a chosen phase of a chosen
version, and the driver then kills the other (as a job launcher does once a rank is
lost). Then, from the bucket alone: every committed version must verify and hold exactly
its contents (nothing partial, nothing forked), the tip must be the version before the
kill or the killed one (if its commit landed). A second job then resumes and publishes
two more versions, which must continue the chain.

The driver forks after importing torch but before running any torch operation, so that
each job costs a fork, not an interpreter start.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from bulletin import Subscriber
from bulletin.distributed import PHASES, LocalShard, ShardedPublisher
from bulletin.run import Run
from bulletin.storage import open_store
from patcher.cast import cast_bits

WORLD = 2
SHAPES = {"a.weight": (32, 24), "b.weight": (24, 32), "c.bias": (40,), "d.weight": (8, 8)}


def full(name: str, version: int) -> np.ndarray:
    """Tensor ``name`` at ``version``: a fixed base with 5% of its elements moved per version."""
    shape = SHAPES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    value = rng.standard_normal(shape).astype(np.float32)
    for v in range(2, version + 1):
        step = np.random.default_rng([sum(map(ord, name)), v])
        mask = step.random(shape) < 0.05
        value = value + np.where(mask, step.standard_normal(shape).astype(np.float32) * 0.05, 0).astype(np.float32)
    return value


def expected(version: int) -> dict[str, bytes]:
    return {name: cast_bits(full(name, version).view(np.uint32), "F32", "BF16").tobytes() for name in SHAPES}


def state(rank: int, version: int) -> dict[str, Any]:
    """Rank ``rank``'s part: ``a`` by rows, ``b`` by columns, ``c`` replicated, ``d`` on rank 1."""
    a, b = full("a.weight", version), full("b.weight", version)
    rows, cols = 32 // WORLD, 32 // WORLD
    out: dict[str, Any] = {
        "a.weight": LocalShard(np.ascontiguousarray(a[rank * rows : (rank + 1) * rows]), (32, 24), (rank * rows, 0)),
        "b.weight": LocalShard(np.ascontiguousarray(b[:, rank * cols : (rank + 1) * cols]), (24, 32), (0, rank * cols)),
        "c.bias": full("c.bias", version),
    }
    if rank == 1:
        out["d.weight"] = full("d.weight", version)
    return out


def rank_main(rank: int, init: str, store: str, last: int, kill: tuple[str, int, int] | None) -> int:
    from datetime import timedelta

    import torch

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30)
    )
    pub = ShardedPublisher(store, "k", keyframe_every=3, timeout_s=30, max_shard_bytes=1 << 11)
    if kill is not None and kill[1] == rank:

        def hook(phase: str, version: int) -> None:
            if (phase, version) == (kill[0], kill[2]):
                os.kill(os.getpid(), signal.SIGKILL)

        pub._hook = hook
    tip = Run(open_store(store), "k").tip()
    version = tip.version if tip is not None else 0
    while version < last:
        version += 1
        assert pub.publish(state(rank, version)) == version
    pub.close()
    dist.destroy_process_group()
    return 0


def job(folder: Path, name: str, last: int, kill: tuple[str, int, int] | None) -> tuple[bool, list[int]]:
    """Run one job; returns whether a rank was killed and each rank's exit status."""
    init = str(folder / f"init-{name}")
    pids = []
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                code = rank_main(rank, init, str(folder / "store"), last, kill)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)
    statuses: dict[int, int] = {}
    killed = False
    signal.alarm(120)
    while len(statuses) < WORLD:
        pid, status = os.wait()
        statuses[pid] = status
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL and not killed:
            killed = True
            for other in pids:
                if other not in statuses:
                    os.kill(other, signal.SIGKILL)  # the launcher takes the job down
    signal.alarm(0)
    return killed, [statuses[pid] for pid in pids]


def check(store: str, tip_at_least: int, tip_at_most: int) -> tuple[int, list[str]]:
    """The run's tip and every problem found reading it back."""
    problems: list[str] = []
    run = Run(open_store(store), "k")
    tip = run.tip()
    top = tip.version if tip is not None else 0
    if not tip_at_least <= top <= tip_at_most:
        problems.append(f"tip {top} not in [{tip_at_least}, {tip_at_most}]")
    if sorted(run.versions()) != list(range(1, top + 1)):
        problems.append(f"versions {run.versions()} are not 1..{top}")
    if top:
        sub = Subscriber(store, "k")
        for version in range(1, top + 1):
            try:
                sub.sync(version)
            except Exception as exc:
                problems.append(f"version {version} does not sync: {type(exc).__name__}: {exc}")
                break
            held = {n: np.asarray(b).tobytes() for n, b in sub.target.arrays.items()}  # type: ignore[attr-defined]
            if held != expected(version):
                problems.append(f"version {version} holds other bits than were published")
        sub.close()
    return top, problems


def main() -> None:
    out = Path(sys.argv[1])
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else None
    trials: list[dict[str, Any]] = []
    index = 0
    for phase in PHASES:
        for kill_version in (1, 2, 3, 4):
            for victim in range(WORLD):
                if phase in ("manifest", "committed") and victim != 0:
                    continue  # rank 0 alone commits
                if limit is not None and index >= limit:
                    break
                folder = out / f"t{index}"
                folder.mkdir(parents=True)
                store = str(folder / "store")
                killed, statuses = job(folder, "a", 5, (phase, victim, kill_version))
                top, problems = check(store, kill_version - 1, kill_version if killed else 5)
                if not killed:
                    problems.append(f"no rank was killed (exits {statuses})")
                resumed, statuses = job(folder, "b", top + 2, None)
                if resumed or any(statuses):
                    problems.append(f"the restarted job failed (exits {statuses})")
                _, more = check(store, top + 2, top + 2)
                trials.append(
                    {"phase": phase, "victim": victim, "version": kill_version, "tip": top, "problems": problems + more}
                )
                index += 1
    print(json.dumps({"trials": trials}))


if __name__ == "__main__":
    main()
