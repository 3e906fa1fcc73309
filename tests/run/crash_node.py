"""A rollout node that dies at a chosen file-system step of a sync, or at a chosen instant.

Run as ``python -m tests.run.crash_node``: a zygote that imports everything once, then,
for each JSON request on stdin, forks a child that opens ``Subscriber(url, "run", node)``
(a LocalDirTarget: the lock, recovery) and syncs it to ``version``, and answers with one
JSON line on stdout. Forking keeps a trial at a few milliseconds, so that every step of
every route can be tried.

Like ``crash_publisher`` (which wraps the store), the production code knows nothing of
this: the child wraps, process-wide, the calls that change files (``os.replace``,
``os.rename``, ``os.symlink``, ``os.unlink``/``os.remove``, ``os.rmdir``, ``os.mkdir``,
``os.open`` and ``open`` for writing, ``os.fsync``, ``os.ftruncate``, ``os.pwrite``, the
flush of a memory-mapped checkpoint) and the in-place apply, and SIGKILLs itself just
before the ``kill_at``-th of them (counting from 0). The apply counts as two steps: its
start, and halfway through its changes (half of them written). Requests::

    {"url": ..., "node": ..., "version": 5, "kill_at": 3}      die before step 3
    {"url": ..., "node": ..., "version": 5, "kill_after": 0.01} the zygote kills it then
    {"url": ..., "node": ..., "version": 5}                   run to the end; lists the steps
    {..., "layout": "log"}                  the same on a LogDirTarget (``compact_share`` 1.0
                                            unless given; compactions in the background)
    {..., "layout": "log", "through": [5]}  sync to each of these first, then to ``version``
    {..., "hold_copies": true}              a compaction's file copies wait until the syncs
                                            are done, so that they run while it does
    {..., "layout": "log", "op": "compact"} open the folder and compact it (no sync)
    {..., "layout": "log", "op": "open"}    open the folder only: its recovery

Answer: ``{"killed": bool, "code": int | null, "steps": [...], "seconds": float}``, where
``steps`` names every step the child reached (a counting run names them all).
"""

from __future__ import annotations

import builtins
import io
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import bulletin.checkpoint
import bulletin.target
from bulletin import Subscriber
from bulletin.replica_log import LogDirTarget
from patcher.patch import Patch

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
#: What differs between two runs of one route: folder ids, process ids, descriptors.
_RANDOM = re.compile(r"(model-)[0-9a-f]{12}|(tmp-)\d+(?:-[0-9a-f]{12})?|(fd)\d+|(log/\.?)[0-9a-f]{12}")


class Steps:
    """Counts the changing calls of the child and kills it before the armed one."""

    def __init__(self, node: str, kill_at: int | None, out_fd: int) -> None:
        self.node = os.path.realpath(node)
        self.kill_at = kill_at
        self.out_fd = out_fd
        self.n = 0

    def _name(self, path: Any) -> str:
        if isinstance(path, int):
            return f"fd{path}"
        text = os.fsdecode(path)
        if not os.path.isabs(text):
            return text
        real = os.path.join(os.path.realpath(os.path.dirname(text)), os.path.basename(text))  # links unresolved
        return os.path.relpath(real, self.node) if real.startswith(self.node) else text

    def tick(self, label: str, before_death: Callable[[], None] | None = None) -> None:
        label = _RANDOM.sub(lambda m: f"{m.group(m.lastindex or 0)}*", label)  # the same name in every run
        os.write(self.out_fd, (label + "\n").encode())
        if self.n == self.kill_at:
            if before_death is not None:
                before_death()
            os.kill(os.getpid(), signal.SIGKILL)
        self.n += 1

    def wrap(self, owner: Any, name: str, label: Callable[..., str | None]) -> None:
        real = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            what = label(*args, **kwargs)
            if what is not None:
                self.tick(what)
            return real(*args, **kwargs)

        setattr(owner, name, wrapper)

    def install(self) -> None:
        one = self._name
        for fn in ("replace", "rename"):
            self.wrap(os, fn, lambda src, dst, *a, fn=fn, **k: f"{fn} {one(src)} -> {one(dst)}")
        self.wrap(os, "symlink", lambda src, dst, *a, **k: f"symlink {one(dst)} -> {os.fsdecode(src)}")
        for fn in ("unlink", "remove", "rmdir", "mkdir"):
            self.wrap(os, fn, lambda path, *a, fn=fn, **k: f"{fn} {one(path)}")
        self.wrap(os, "fsync", lambda fd: f"fsync fd{fd if isinstance(fd, int) else fd.fileno()}")
        self.wrap(os, "ftruncate", lambda fd, size: f"ftruncate fd{fd}")
        self.wrap(os, "pwrite", lambda fd, data, offset: f"pwrite fd{fd}")
        self.wrap(
            os,
            "open",
            lambda path, flags, *a, **k: f"open {one(path)}" if flags & _WRITE_FLAGS else None,
        )

        def open_label(file: Any, mode: str = "r", *a: Any, **k: Any) -> str | None:
            return f"open {one(file)} {mode}" if any(c in mode for c in "wax+") else None

        self.wrap(builtins, "open", open_label)
        self.wrap(io, "open", open_label)
        self.wrap(bulletin.checkpoint._MappedFile, "flush", lambda mapped: f"flush {one(mapped.path)}")

        real_apply = bulletin.target.apply_patch

        def apply(patch: Patch, arrays: dict[str, Any], fingerprints: Any) -> dict[str, int]:
            self.tick("apply: start")

            def half() -> None:  # write half of the changes, as a process killed mid-apply would
                changed = [td for td in patch if td.changed]
                for td in changed[: max(1, len(changed) // 2)]:
                    flat = arrays[td.spec.name].reshape(-1)
                    flat[td.indices[: td.changed // 2 + 1]] += td.delta[: td.changed // 2 + 1]

            self.tick("apply: half the changes written", before_death=half)
            return real_apply(patch, arrays, fingerprints)

        bulletin.target.apply_patch = apply  # type: ignore[assignment]


def _child(request: dict[str, Any], out_fd: int) -> None:
    synced = threading.Event()
    steps = Steps(request["node"], request.get("kill_at"), out_fd)
    steps.install()
    op, node = request.get("op", "sync"), request["node"]
    if request.get("layout", "dense") == "dense":
        sub = Subscriber(request["url"], "run", node)
    else:  # the log layout; compaction only where asked for (a share of 1.0 never triggers it)
        if request.get("hold_copies"):
            copy = shutil.copyfile

            def held_copy(*args: Any, **kwargs: Any) -> Any:
                synced.wait()
                return copy(*args, **kwargs)

            shutil.copyfile = held_copy
        target = LogDirTarget(node, run="run", compact_share=request.get("compact_share", 1.0))
        if op == "compact":
            target.compact()
        if op != "sync":
            target.close()
            return
        sub = Subscriber(request["url"], "run", target=target)
    for version in request.get("through", []):
        sub.sync(version)
    sub.sync(request["version"])
    synced.set()
    sub.close()  # a background compaction ends first


def trial(request: dict[str, Any]) -> dict[str, Any]:
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_fd)
        code = 0
        try:
            _child(request, write_fd)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            code = 1
        os._exit(code)
    os.close(write_fd)
    kill_after = request.get("kill_after")
    if kill_after is not None:
        time.sleep(kill_after)
        os.kill(pid, signal.SIGKILL)  # a zombie until waited for, so the pid is still its
    chunks = []
    while chunk := os.read(read_fd, 1 << 16):
        chunks.append(chunk)
    os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    seconds = time.perf_counter() - t0
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return {
        "killed": killed,
        "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "steps": b"".join(chunks).decode().splitlines(),
        "seconds": seconds,
    }


def main() -> int:
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(trial(json.loads(line))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
