"""A keyframe's files go to the store while the next ones are still being written."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from bulletin import Publisher, Subscriber, shared_files
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

    def put_file_if_absent(self, key: str, path: str | os.PathLike[str], *, link: bool = False) -> WriteResult:
        folder = Path(path).parent
        with self.lock:
            self.seen.append((Path(key).name, len(list(folder.glob("*.safetensors")))))
        if self.fail is not None and Path(key).name.startswith(self.fail):
            raise StorageUnavailable(f"{key}: injected")
        return self.inner.put_file_if_absent(key, path, link=link)


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


@pytest.fixture
def held_copy(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The background private copy waits until the event is set (or it is cancelled)."""
    release = threading.Event()
    real = shared_files.make_private

    def held(path: Path, cancel: threading.Event | None = None) -> bool:
        while not release.wait(0.01):
            if cancel is not None and cancel.is_set():
                return False
        return real(path, cancel)

    monkeypatch.setattr(shared_files, "make_private", held)
    return release


def _keyframe_objects(store_dir: Path) -> dict[Path, str]:
    return {
        p: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in store_dir.rglob("keyframes/*/*")
        if p.is_file() and not p.name.startswith(".")
    }


def _cache_files(cache: Path) -> list[Path]:
    return [p for p in cache.glob("base-*/*.safetensors")]


def test_a_local_store_takes_the_cached_keyframe_and_the_cache_copies_it_before_writing(
    tmp_path: Path, held_copy: threading.Event
) -> None:
    """The keyframe is written once: the local store links the cache's files as its
    objects; the cache is mapped read only until a private copy replaces them, so the
    next versions, written into the cache in place, never change the store's objects."""
    store_dir, cache = tmp_path / "store", tmp_path / "cache"
    state = _state()
    with Publisher(str(store_dir), "r", keyframe_file_bytes=40 << 10, cache_dir=cache) as pub:
        pub.publish(state)
        objects = _keyframe_objects(store_dir)
        assert len(objects) == 7
        inodes = {p.stat().st_ino for p in objects}
        assert {p.stat().st_ino for p in _cache_files(cache)} <= inodes  # linked, not copied
        threading.Timer(0.3, held_copy.set).start()  # the next commit waits for the copy
        for step in range(1, 4):
            for bits in state.values():
                bits.reshape(-1)[step::97] += np.uint16(1)
            assert pub.publish(state) == step + 1
        assert all(p.stat().st_nlink == 1 for p in _cache_files(cache))  # made private
    assert _keyframe_objects(store_dir) == objects  # every object as it was created
    with Subscriber(str(store_dir), "r", tmp_path / "node") as sub:
        assert sub.sync() == 4
        held = sub.target.context_bits()
        assert held is not None and all(np.array_equal(held[n], state[n]) for n in state)


def test_a_publisher_closed_before_its_private_copy_leaves_the_next_one_to_make_it(
    tmp_path: Path, held_copy: threading.Event
) -> None:
    store_dir, cache = tmp_path / "store", tmp_path / "cache"
    state = _state()
    with Publisher(str(store_dir), "r", cache_dir=cache) as pub:
        pub.publish(state)  # close() stops the copy, held back
    held_copy.set()
    objects = _keyframe_objects(store_dir)
    assert any(p.stat().st_nlink > 1 for p in _cache_files(cache))  # still shared
    (_cache_files(cache)[0].parent / ".model.safetensors.private-dead").write_bytes(b"partial")  # a killed copy's
    with Publisher(str(store_dir), "r", cache_dir=cache) as pub:
        for bits in state.values():
            bits.reshape(-1)[::50] += np.uint16(3)
        assert pub.publish(state) == 2
    assert _keyframe_objects(store_dir) == objects
    assert not list(_cache_files(cache)[0].parent.glob(".*private*"))
    with Subscriber(str(store_dir), "r", tmp_path / "node") as sub:
        assert sub.sync() == 2
        held = sub.target.context_bits()
        assert held is not None and all(np.array_equal(held[n], state[n]) for n in state)


def test_a_shared_cache_file_cannot_be_written_through_its_map(tmp_path: Path, held_copy: threading.Event) -> None:
    with Publisher(str(tmp_path / "store"), "r", cache_dir=tmp_path / "cache") as pub:
        pub.publish(_state())
        base = pub._base
        assert base._shared
        with pytest.raises(ValueError, match="read-only"):
            base._ckpt.bits("t0").reshape(-1)[0] = 1  # type: ignore[union-attr]
