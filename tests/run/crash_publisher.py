"""A trainer process that SIGKILLs itself at a chosen step of a commit.

Run as ``python -m tests.run.crash_publisher STORE_URL RUN SEED STEPS CRASH_AT``.
It publishes ``STEPS`` versions of a deterministic toy trainer (see helpers) and
dies, without any cleanup, when it reaches ``CRASH_AT`` while committing its last
version:

- ``shard``: after the first patch shard or keyframe file landed;
- ``manifest``: after the shards, just before creating the manifest;
- ``head``: after the manifest was created, before the head moves;
- ``after``: right after the head moved.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from datetime import datetime

from bulletin import Publisher
from bulletin.storage import ObjectData, ObjectInfo, Store, WriteResult, open_store
from tests.run.helpers import ToyTrainer


class CrashingStore:
    """Delegates to a real store; kills the process at the armed point."""

    def __init__(self, inner: Store, crash_at: str) -> None:
        self.inner = inner
        self.crash_at = crash_at
        self.armed = False
        self.url = inner.url

    def _die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def get(self, key: str) -> ObjectData:
        return self.inner.get(key)

    def get_if_changed(self, key: str, etag: str | None) -> ObjectData | None:
        return self.inner.get_if_changed(key, etag)

    def stat(self, key: str) -> ObjectInfo:
        return self.inner.stat(key)

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        if self.armed and self.crash_at == "shard" and ("/patches/" in key or "/keyframes/" in key):
            self.inner.put_if_absent(key, data)  # one object landed, the rest never will
            self._die()
        if self.armed and self.crash_at == "manifest" and "/manifests/" in key:
            self._die()
        result = self.inner.put_if_absent(key, data)
        if self.armed and self.crash_at == "head" and "/manifests/" in key:
            self._die()
        if self.armed and self.crash_at == "after" and key.endswith("head.json"):
            self._die()
        return result

    def put_if_match(self, key: str, data: bytes, etag: str) -> WriteResult:
        result = self.inner.put_if_match(key, data, etag)
        if self.armed and self.crash_at == "after" and key.endswith("head.json"):
            self._die()
        return result

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix, start_after=start_after)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def close(self) -> None:
        self.inner.close()


def main(argv: list[str]) -> int:
    url, run, seed, steps, crash_at = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4]
    store = CrashingStore(open_store(url), crash_at)
    trainer = ToyTrainer(seed=seed)
    pub = Publisher(store, run, keyframe_every=3)
    for i in range(steps):
        if i:
            trainer.step()
        store.armed = i == steps - 1
        pub.publish(trainer.state, metadata={"at": datetime.now().isoformat()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
