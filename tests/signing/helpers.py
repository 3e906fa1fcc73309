"""What the attack tests observe: every key a reader reads, and a replica folder's state."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from bulletin.storage import ObjectData, Store
from bulletin.storage.wrapper import CountingStore


class ReadLog(CountingStore):
    """A :class:`CountingStore` that also remembers which keys were read (``get``)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self._keys_lock = threading.Lock()
        self._keys: list[str] = []

    def get(self, key: str, *, max_bytes: int | None = None) -> ObjectData:
        with self._keys_lock:
            self._keys.append(key)
        return super().get(key, max_bytes=max_bytes)

    @property
    def keys(self) -> list[str]:
        with self._keys_lock:
            return list(self._keys)

    def data_reads(self) -> list[str]:
        """Patch shards and keyframe files read: what "downloading a version" means."""
        return [key for key in self.keys if "/patches/" in key or "/keyframes/" in key]


def folder_state(folder: Path) -> dict[str, str]:
    """Every file and link below ``folder`` (the lock file aside): a SHA-256 of a file's
    bytes, a link's target. Equal before and after means nothing changed there."""
    state: dict[str, str] = {}
    for path in sorted(folder.rglob("*")):
        relative = str(path.relative_to(folder))
        if path.name == ".bulletin-lock":
            continue
        if path.is_symlink():
            state[relative] = "-> " + str(path.readlink())
        elif path.is_file():
            state[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            state[relative] = "dir"
    return state
