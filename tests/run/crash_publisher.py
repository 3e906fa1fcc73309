"""A trainer process that SIGKILLs itself at a chosen step of a commit.

Run as ``python -m tests.run.crash_publisher STORE_URL RUN SEED STEPS CRASH_AT``.
It publishes ``STEPS`` versions of a deterministic toy trainer (see helpers) and
dies, without any cleanup, when it reaches ``CRASH_AT`` while committing its last
version:

- ``shard``: after the first patch shard or keyframe file landed;
- ``manifest``: after the shards, just before creating the manifest;
- ``head``: after the manifest was created, before the head moves;
- ``after``: right after the head moved;
- ``base``: after the commit, half way through writing the changes into the
  publisher's cached base (bulletin.base), a patch version;
- ``state``: after the cached base holds the new bits, before its state file names them.

The cached base lives where ``BULLETIN_CACHE_DIR`` says, so that the test's own
publisher, resuming, finds what this one left.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import datetime
from typing import Any

import bulletin.base
from bulletin import Publisher
from bulletin.run import StoredManifest
from bulletin.storage import Store, WriteResult, open_store
from bulletin.storage.wrapper import WrapperStore
from tests.run.helpers import ToyTrainer


class CrashingStore(WrapperStore):
    """Delegates to a real store; kills the process at the armed point."""

    def __init__(self, inner: Store, crash_at: str) -> None:
        super().__init__(inner)
        self.crash_at = crash_at
        self.armed = False

    def _die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        if self.armed and self.crash_at == "shard" and ("/patches/" in key or "/keyframes/" in key):
            super().put_if_absent(key, data)  # one object landed, the rest never will
            self._die()
        if self.armed and self.crash_at == "manifest" and "/manifests/" in key:
            self._die()
        result = super().put_if_absent(key, data)
        if self.armed and self.crash_at == "head" and "/manifests/" in key:
            self._die()
        if self.armed and self.crash_at == "after" and key.endswith("head.json"):
            self._die()
        return result

    def put_file_if_absent(self, key: str, path: str | os.PathLike[str], *, link: bool = False) -> WriteResult:
        result = super().put_file_if_absent(key, path, link=link)  # keyframe files are uploaded from files
        if self.armed and self.crash_at == "shard" and "/keyframes/" in key:
            self._die()
        return result

    def put_if_match(self, key: str, data: bytes, etag: str) -> WriteResult:
        result = super().put_if_match(key, data, etag)
        if self.armed and self.crash_at == "after" and key.endswith("head.json"):
            self._die()
        return result


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def crash_in_base(store: CrashingStore) -> None:
    """Arm the ``base`` and ``state`` points: wrap what the base writes after a commit."""
    real_put = bulletin.base.put_bits
    real_state = bulletin.base.PublishedBase._write_state

    def put_bits(flat: Any, local: Any, now: Any) -> None:
        real_put(flat, local, now)
        if store.armed and store.crash_at == "base" and len(local):  # a tensor's changes written, then killed
            _die()

    def write_state(base: Any, stored: StoredManifest, folder: str, fingerprints: Any) -> None:
        if store.armed and store.crash_at == "state":
            _die()
        real_state(base, stored, folder, fingerprints)

    bulletin.base.put_bits = put_bits  # type: ignore[attr-defined,assignment]
    bulletin.base.PublishedBase._write_state = write_state  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    url, run, seed, steps, crash_at = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4]
    store = CrashingStore(open_store(url), crash_at)
    crash_in_base(store)
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
