"""The local directory store: the contract (racing processes), plus its file-level duties."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bulletin.errors import ConfigError, InvalidInput, NotFound, ObjectTooLarge
from bulletin.storage import LocalStore, Store, Updated, open_store
from tests.storage.contract import StoreContract


class TestLocalStore(StoreContract):
    race_in_processes = True

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        store = LocalStore(tmp_path / "bucket")
        yield store
        store.close()


def test_a_file_given_up_on_the_same_file_system_is_linked_not_copied(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "bucket")
    source = tmp_path / "keyframe.safetensors"
    source.write_bytes(b"x" * 4096)
    before = source.stat()
    created = store.put_file_if_absent("runs/a/keyframes/1/model.safetensors", source, link=True)
    assert isinstance(created, Updated)
    stored = tmp_path / "bucket" / "runs/a/keyframes/1/model.safetensors"
    assert stored.stat().st_ino == before.st_ino and source.stat().st_nlink == 2
    # Without link, a copy: a new inode, the caller's file untouched.
    copied = store.put_file_if_absent("runs/a/keyframes/1/copy.safetensors", source)
    assert isinstance(copied, Updated) and created.etag != copied.etag
    assert (tmp_path / "bucket" / "runs/a/keyframes/1/copy.safetensors").stat().st_ino != before.st_ino
    assert source.stat().st_nlink == 2


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_layout_mirrors_keys_and_hides_internals(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    first = store.put_if_absent("runs/a/head.json", b"1")
    assert isinstance(first, Updated)
    store.put_if_match("runs/a/head.json", b"2", first.etag)
    assert (tmp_path / "runs" / "a" / "head.json").read_bytes() == b"2"
    # Only the object and lock files: temporaries were linked or renamed away.
    files = _files(tmp_path)
    assert "runs/a/head.json" in files
    assert all(f == "runs/a/head.json" or f.startswith(".bulletin-locks/") for f in files)
    # Leftovers of a crashed writer stay invisible.
    (tmp_path / "runs" / "a" / ".bulletin-tmp-deadbeef").write_bytes(b"partial")
    assert [i.key for i in store.list("")] == ["runs/a/head.json"]
    assert [i.key for i in store.list("runs/a/.bulletin")] == []


def test_foreign_entries_are_not_listed(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_if_absent("ok", b"")
    (tmp_path / "back\\slash").write_bytes(b"")
    (tmp_path / "ctrl\x01").write_bytes(b"")
    os.symlink(tmp_path / "ok", tmp_path / "link")
    os.mkdir(tmp_path / "empty-dir")
    assert [i.key for i in store.list("")] == ["ok"]
    with pytest.raises(NotFound):
        store.get("link")


def test_undecodable_file_names_are_not_listed(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_if_absent("ok", b"")
    with open(os.path.join(os.fsencode(tmp_path), b"bad-\xff"), "wb"):
        pass
    assert [i.key for i in store.list("")] == ["ok"]


def test_etag_changes_on_every_write_even_for_same_bytes(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    etags = []
    created = store.put_if_absent("k", b"same")
    assert isinstance(created, Updated)
    etags.append(created.etag)
    for _ in range(20):
        outcome = store.put_if_match("k", b"same", etags[-1])
        assert isinstance(outcome, Updated)
        etags.append(outcome.etag)
    store.delete("k")
    recreated = store.put_if_absent("k", b"same")
    assert isinstance(recreated, Updated)
    etags.append(recreated.etag)
    assert len(set(etags)) == len(etags)
    for stale in etags[:-1]:
        assert not isinstance(store.put_if_match("k", b"x", stale), Updated)


def test_delete_prunes_empty_directories(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_if_absent("a/b/c/d", b"x")
    store.put_if_absent("a/keep", b"y")
    store.delete("a/b/c/d")
    assert not (tmp_path / "a" / "b").exists()
    assert (tmp_path / "a" / "keep").exists()
    store.put_if_absent("a/b/c/d", b"again")
    assert store.get("a/b/c/d").data == b"again"


def test_root_created_on_first_write(tmp_path: Path) -> None:
    root = tmp_path / "not" / "yet"
    store = open_store(str(root))
    assert store.url == root.as_uri()
    with pytest.raises(NotFound):
        store.get("k")
    assert list(store.list("")) == []
    assert not root.exists()  # reads create nothing
    store.put_if_absent("k", b"v")
    assert (root / "k").read_bytes() == b"v"


def test_root_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError):
        LocalStore(tmp_path / "file")


def test_object_and_directory_of_one_name(tmp_path: Path) -> None:
    # S3 can hold both "a" and "a/b"; a directory tree cannot. The clash is a typed
    # error that changes nothing, never a false conflict.
    store = LocalStore(tmp_path)
    store.put_if_absent("a", b"file")
    with pytest.raises(InvalidInput):
        store.put_if_absent("a/b", b"x")
    store.put_if_absent("d/e", b"x")
    with pytest.raises(InvalidInput):
        store.put_if_absent("d", b"x")
    assert [i.key for i in store.list("")] == ["a", "d/e"]
    assert not isinstance(store.put_if_match("d", b"x", "etag"), Updated)


def test_symlink_escaping_the_root_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside, root / "escape")
    store = LocalStore(root)
    for call in (
        lambda: store.get("escape/secret"),
        lambda: store.put_if_absent("escape/new", b"x"),
        lambda: store.delete("escape/secret"),
        lambda: store.list("escape/"),
    ):
        with pytest.raises(InvalidInput, match="outside"):
            call()
    assert (outside / "secret").exists()
    assert not (outside / "new").exists()


def test_segment_longer_than_the_file_system_allows(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    with pytest.raises(InvalidInput):
        store.put_if_absent("x" * 300, b"v")
    assert list(store.list("")) == []


def test_file_url(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "with space")
    assert store.url == (tmp_path / "with space").as_uri()
    assert "%20" in store.url
    store.put_if_absent("k", b"v")
    assert open_store(store.url).get("k").data == b"v"
    assert open_store(tmp_path / "with space").get("k").data == b"v"


# -- what is not a regular file, and objects over a read's bound ----------------------------


def _get_within(store: LocalStore, key: str, seconds: float = 5.0, **kwargs: int) -> BaseException | bytes:
    """``store.get(key)`` on a daemon thread: what it returned or raised, or a failure if it
    still blocks after ``seconds`` (a FIFO opened for reading waits for a writer)."""
    outcome: list[BaseException | bytes] = []

    def read() -> None:
        try:
            outcome.append(store.get(key, **kwargs).data)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"get({key!r}) still blocks after {seconds} s")
    return outcome[0]


def test_a_fifo_where_an_object_was_is_not_found_and_never_blocks(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "bucket")
    store.put_if_absent("dir/obj", b"x")
    os.unlink(tmp_path / "bucket" / "dir" / "obj")
    os.mkfifo(tmp_path / "bucket" / "dir" / "obj")
    assert isinstance(_get_within(store, "dir/obj"), NotFound)
    assert isinstance(_get_within(store, "dir/obj", max_bytes=10), NotFound)
    with pytest.raises(NotFound):
        store.get_if_changed("dir/obj", None)
    with pytest.raises(NotFound):
        store.stat("dir/obj")
    assert [i.key for i in store.list("")] == []


def test_sockets_and_symlinks_to_fifos_are_not_objects(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "bucket")
    store.put_if_absent("keep", b"x")
    root = tmp_path / "bucket"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(root / "sock"))
        assert isinstance(_get_within(store, "sock"), NotFound)
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "fifo", root / "link")
    assert isinstance(_get_within(store, "link"), NotFound)
    assert store.get("keep").data == b"x"  # regular files read as before (blocking again)


def test_a_huge_sparse_file_is_refused_from_its_size(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "bucket")
    store.put_if_absent("big", b"")
    with open(tmp_path / "bucket" / "big", "r+b") as f:
        f.truncate(64 << 30)  # 64 GiB that reading would have to allocate
    with pytest.raises(ObjectTooLarge, match=str(64 << 30)):
        store.get("big", max_bytes=1 << 20)
    with pytest.raises(ObjectTooLarge):
        store.get_if_changed("big", None, max_bytes=1 << 20)
    assert store.stat("big").size == 64 << 30
