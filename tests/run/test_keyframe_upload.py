"""A keyframe's files go to the store while the next ones are still being written."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from bulletin import Publisher, Subscriber
from bulletin.errors import StorageUnavailable
from bulletin.keyspace import keyframe_prefix, version_of_data_key
from bulletin.storage import open_store
from bulletin.storage.base import WriteResult
from bulletin.storage.wrapper import WrapperStore


def _state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"t{i}": rng.integers(0, 1 << 16, size=(64, 256), dtype=np.uint16) for i in range(6)}


class Watching(WrapperStore):
    """Records, at each file upload, the staged files that exist beside the one sent;
    ``fail`` makes the upload of a file of that name raise."""

    def __init__(self, inner: object, fail: str | None = None) -> None:
        super().__init__(inner)  # type: ignore[arg-type]
        self.fail = fail
        self.seen: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def put_file_if_absent(self, key: str, path: str | os.PathLike[str]) -> WriteResult:
        folder = Path(path).parent
        with self.lock:
            self.seen.append((Path(key).name, len(list(folder.glob("*.safetensors")))))
        if self.fail is not None and Path(key).name.startswith(self.fail):
            raise StorageUnavailable(f"{key}: injected")
        return self.inner.put_file_if_absent(key, path)


def test_the_first_file_is_sent_before_the_last_is_written(tmp_path: Path) -> None:
    store = Watching(open_store(str(tmp_path / "store")))
    state = _state()
    # 32 KiB tensors, 40 KiB files: one tensor per file, six files and an index.
    with Publisher(store, "r", keyframe_file_bytes=40 << 10, cache_dir=tmp_path / "cache") as pub:
        pub.publish(state)
    names = sorted(name for name, _ in store.seen)
    assert len(names) == 7 and names[-1] == "model.safetensors.index.json"
    first = min(store.seen, key=lambda seen: seen[0])  # model-00001-of-00006.safetensors
    assert first[1] < 6, "the first file was sent only once every file was written"
    with Subscriber(str(tmp_path / "store"), "r", tmp_path / "node") as sub:
        assert sub.sync() == 1
        assert all(np.array_equal(sub.target.context_bits()[n], state[n]) for n in state)  # type: ignore[index]


def test_a_failed_file_upload_fails_the_publish_and_leaves_no_staged_folder(tmp_path: Path) -> None:
    store = Watching(open_store(str(tmp_path / "store")), fail="model-00002")
    with Publisher(store, "r", keyframe_file_bytes=40 << 10, cache_dir=tmp_path / "cache") as pub:
        with pytest.raises(StorageUnavailable, match="injected"):
            pub.publish(_state())
        assert pub.version is None
        staged = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
        assert staged == [], "the staged keyframe was left behind"
        store.fail = None
        assert pub.publish(_state(1)) == 1  # the next try publishes from scratch


def test_keys_of_a_keyframe_attempt_name_their_version() -> None:
    """Garbage collection and a mirror's lag read a data key's version from its folder:
    an attempt's token after the writer id keeps it readable."""
    assert version_of_data_key(keyframe_prefix(7, "ab12", "cd34") + "/model.safetensors") == 7
    assert version_of_data_key(keyframe_prefix(7, "ab12") + "/model.safetensors") == 7
    assert version_of_data_key("keyframes/00000000000000000007-ab12-cd34-ef56/model.safetensors") is None
