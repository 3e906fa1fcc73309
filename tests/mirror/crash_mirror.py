"""A mirror that dies at a chosen write of a copy, or at a chosen instant.

Run as ``python -m tests.mirror.crash_mirror``: ``tests/run/crash_node.py``'s zygote, which
imports everything once, then, for each JSON request on stdin, forks a child, here one that runs
``Mirror(origin, destination, "run", keep=keep).sync()`` and answers with one JSON line
on stdout. Like ``tests/run/crash_node.py``, the production code knows nothing of this:
the child wraps the destination store, and every call that changes it
(``put_if_absent``, ``put_if_match``, ``delete``) is a step; the child SIGKILLs itself
just before the ``kill_at``-th (counting from 0). Requests::

    {"origin": ..., "destination": ..., "keep": null, "kill_at": 3}       die before step 3
    {"origin": ..., "destination": ..., "keep": 3, "kill_after": 0.01}    the zygote kills it then
    {"origin": ..., "destination": ..., "keep": null}                     run to the end; lists the steps

Answer: ``{"killed": bool, "code": int | null, "steps": [...], "seconds": float}``.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from bulletin.mirror import Mirror
from bulletin.storage import Store, WriteResult, open_store
from bulletin.storage.wrapper import WrapperStore
from tests.run import crash_node


class DyingStore(WrapperStore):
    """Names each write on ``out_fd`` and dies just before the armed one."""

    def __init__(self, inner: Store, kill_at: int | None, out_fd: int) -> None:
        super().__init__(inner)
        self.kill_at = kill_at
        self.out_fd = out_fd
        self.n = 0

    def _step(self, label: str) -> None:
        os.write(self.out_fd, (label + "\n").encode())
        if self.n == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.n += 1

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        self._step(f"create {key}")
        return super().put_if_absent(key, data)

    def put_if_match(self, key: str, data: bytes, etag: str) -> WriteResult:
        self._step(f"swap {key}")
        return super().put_if_match(key, data, etag)

    def delete(self, key: str) -> None:
        self._step(f"delete {key}")
        super().delete(key)


def _child(request: dict[str, Any], out_fd: int) -> None:
    destination = DyingStore(open_store(request["destination"]), request.get("kill_at"), out_fd)
    # One worker: the steps come in one order, so that step k is the same write in every run.
    Mirror(request["origin"], destination, "run", keep=request.get("keep"), max_workers=1).sync()


def main() -> int:
    # crash_node's zygote (fork a child per request, kill it on time, answer with its steps),
    # with this child instead of a syncing node.
    crash_node._child = _child
    return crash_node.main()


if __name__ == "__main__":
    sys.exit(main())
