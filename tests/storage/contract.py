"""The contract every store backend passes: inherit :class:`StoreContract`, give ``store``.

Modelled on zarr's ``StoreTests`` and fsspec's pipe tests: one suite, every backend.
A subclass provides a ``store`` fixture (a fresh, empty store) and may set
``race_in_processes`` when its writers can race from separate processes (they
reopen the store from ``store.url``).
"""

from __future__ import annotations

import errno
import hashlib
import multiprocessing
import os
import queue
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import pytest

from bulletin.errors import BulletinError, DigestMismatch, DiskFull, InvalidInput, NotFound, ObjectTooLarge
from bulletin.storage import (
    Conflicted,
    Downloaded,
    ObjectData,
    Store,
    Updated,
    get_many,
    open_store,
    put_many_if_absent,
)
from tests.storage import race_workers

BAD_KEYS: list[object] = [
    "",
    "/abs",
    "a//b",
    "a/",
    "./a",
    "a/./b",
    "a/../b",
    "..",
    "a\\b",
    "a\x00b",
    "a\nb",
    "\ud800",
    "a/.bulletin-tmp-x",
    "x" * 1025,
    "é" * 513,  # 1026 UTF-8 bytes
    b"bytes",
    None,
    7,
]

#: Keys whose order checks lexicographic (code point = UTF-8 byte) listing order:
#: "." (0x2E) < "/" (0x2F) < "-"... and no key is a "directory" of another.
LIST_KEYS = [
    "A",
    "a-b",
    "a.c",
    "a/b",
    "a/c/d",
    "a/c/e",
    "a/cd",
    "ab",
    "b",
    "b0/x",
    "bb/~",
    "z/√",
    "é",
    "日本/語",
]
LIST_PREFIXES = ["", "a", "a/", "a/c", "a/c/", "b", "bb/", "z/√", "日", "nothing", "a/c/d"]
LIST_STARTS: list[str | None] = [None, "", "A", "a", "a/", "a/b", "a/c", "a/c/d", "a0", "b0", "é", "~"]

RACE_WRITERS = 16
RACE_ROUNDS = 4
CAS_WRITERS = 4
CAS_INCREMENTS = 6
RACE_TIMEOUT = 120.0


def _model_list(keys: list[str], prefix: str, start_after: str | None) -> list[str]:
    return [k for k in sorted(keys) if k.startswith(prefix) and (start_after is None or k > start_after)]


class FileTransferContract:
    """``put_file_if_absent`` and ``get_to_file``: the streamed pair, for every store.

    ``file_size`` is large enough to cross the store's own boundaries where it has any
    (S3's multipart threshold and part size, set small by its test class).
    """

    file_size: ClassVar[int] = (3 << 20) + 12345
    #: False where the server does not serialise create-only multipart completions
    #: (LocalStack 4.13: concurrent completions with If-None-Match can all succeed).
    atomic_file_create: ClassVar[bool] = True

    @pytest.fixture
    def source(self, tmp_path: Path) -> Path:
        path = tmp_path / "source.bin"
        path.write_bytes(_pattern(self.file_size))
        return path

    def test_file_round_trip(self, store: Store, source: Path, tmp_path: Path) -> None:
        data = source.read_bytes()
        created = store.put_file_if_absent("files/a", source)
        assert isinstance(created, Updated)
        assert store.get("files/a") == ObjectData(data, created.etag)
        target = tmp_path / "out" / "a.bin"
        target.parent.mkdir()
        got = store.get_to_file("files/a", target, sha256=hashlib.sha256(data).hexdigest(), max_bytes=len(data))
        assert got == Downloaded(len(data), created.etag, hashlib.sha256(data).hexdigest())
        assert target.read_bytes() == data
        assert os.listdir(target.parent) == ["a.bin"]  # no temp file left beside it
        # Without a digest the one computed is still reported; a str path works too.
        again = store.get_to_file("files/a", str(target))
        assert again.sha256 == got.sha256 and target.read_bytes() == data

    def test_objects_put_as_bytes_download_to_files(self, store: Store, tmp_path: Path) -> None:
        data = _pattern(self.file_size)
        created = store.put_if_absent("bytes", data)
        assert isinstance(created, Updated)
        got = store.get_to_file("bytes", tmp_path / "b")
        assert (got.size, got.etag) == (len(data), created.etag)
        assert (tmp_path / "b").read_bytes() == data

    def test_put_file_is_create_only(self, store: Store, source: Path, tmp_path: Path) -> None:
        first = store.put_if_absent("once", b"first")
        assert isinstance(first, Updated)
        assert store.put_file_if_absent("once", source) == Conflicted(first.etag)
        assert store.get("once") == ObjectData(b"first", first.etag)
        other = tmp_path / "other.bin"
        other.write_bytes(b"other")
        created = store.put_file_if_absent("twice", other)
        assert isinstance(created, Updated)
        assert store.put_file_if_absent("twice", source) == Conflicted(created.etag)
        assert store.get("twice").data == b"other"

    def test_a_file_given_up_is_stored_as_it_was_and_create_only(self, store: Store, source: Path) -> None:
        data = source.read_bytes()
        created = store.put_file_if_absent("given", source, link=True)
        assert isinstance(created, Updated)
        assert store.get("given") == ObjectData(data, created.etag)
        assert store.put_file_if_absent("given", source, link=True) == Conflicted(created.etag)
        source.unlink()  # the caller drops its name for it: the object stays
        assert store.get("given") == ObjectData(data, created.etag)

    def test_empty_file(self, store: Store, tmp_path: Path) -> None:
        empty = tmp_path / "empty"
        empty.write_bytes(b"")
        created = store.put_file_if_absent("empty", empty)
        assert isinstance(created, Updated)
        assert store.get("empty").data == b""
        got = store.get_to_file("empty", tmp_path / "copy", sha256=hashlib.sha256(b"").hexdigest(), max_bytes=0)
        assert got.size == 0 and (tmp_path / "copy").read_bytes() == b""

    def test_bad_sources_create_nothing(self, store: Store, tmp_path: Path) -> None:
        for path in (tmp_path / "missing", tmp_path):
            with pytest.raises(InvalidInput):
                store.put_file_if_absent("k", path)
        for path in (None, 5, b"/bytes/path", ""):
            with pytest.raises(InvalidInput):
                store.put_file_if_absent("k", path)  # type: ignore[arg-type]
        (tmp_path / "f").write_bytes(b"x")
        for key in ("", "a//b", "../x"):
            with pytest.raises(InvalidInput):
                store.put_file_if_absent(key, tmp_path / "f")
        assert list(store.list("")) == []

    def test_get_to_file_refuses_bad_arguments(self, store: Store, tmp_path: Path) -> None:
        store.put_if_absent("k", b"x")
        out = tmp_path / "out"
        out.mkdir()
        for sha in ("A" * 64, "0" * 63, 5, b"0" * 64):
            with pytest.raises(InvalidInput):
                store.get_to_file("k", out / "t", sha256=sha)  # type: ignore[arg-type]
        for bound in (-1, True, 1.5):
            with pytest.raises(InvalidInput):
                store.get_to_file("k", out / "t", max_bytes=bound)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput):
            store.get_to_file("a//b", out / "t")
        with pytest.raises(NotFound):
            store.get_to_file("missing", out / "t")
        assert os.listdir(out) == []

    def test_digest_mismatch_leaves_nothing(self, store: Store, source: Path, tmp_path: Path) -> None:
        store.put_file_if_absent("obj", source)
        target = tmp_path / "out" / "obj"
        target.parent.mkdir()
        with pytest.raises(DigestMismatch):
            store.get_to_file("obj", target, sha256="0" * 64)
        assert os.listdir(target.parent) == []
        target.write_bytes(b"held before")  # a file already there stays as it was
        with pytest.raises(DigestMismatch):
            store.get_to_file("obj", target, sha256="0" * 64)
        assert os.listdir(target.parent) == ["obj"] and target.read_bytes() == b"held before"

    def test_object_over_the_bound_is_refused(self, store: Store, source: Path, tmp_path: Path) -> None:
        # A hostile object far larger than the manifest promised: refused, nothing written.
        store.put_file_if_absent("big", source)
        out = tmp_path / "out"
        out.mkdir()
        tracemalloc.start()
        try:
            with pytest.raises(ObjectTooLarge, match="big"):
                store.get_to_file("big", out / "big", max_bytes=self.file_size - 1)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert os.listdir(out) == []
        assert peak < self.file_size // 2  # refused from its size, not read whole

    def test_failing_disk_mid_download_leaves_nothing(
        self, store: Store, source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        store.put_file_if_absent("obj", source)
        target = tmp_path / "out" / "obj"
        target.parent.mkdir()
        real_pwrite = os.pwrite
        written = [0]
        lock = threading.Lock()

        def filling_disk(fd: int, data: Any, offset: int) -> int:
            with lock:
                if written[0] > 1 << 20:
                    raise OSError(errno.ENOSPC, "No space left on device")
            n = real_pwrite(fd, memoryview(data)[: 256 << 10], offset)  # short writes: resumed
            with lock:
                written[0] += n
            return n

        real_copy = os.copy_file_range

        def filling_disk_in_the_kernel(src: int, dst: int, count: int, *offsets: Any) -> int:
            with lock:
                if written[0] > 1 << 20:
                    raise OSError(errno.ENOSPC, "No space left on device")
            n = real_copy(src, dst, min(count, 256 << 10), *offsets)
            with lock:
                written[0] += n
            return n

        monkeypatch.setattr(os, "pwrite", filling_disk)
        monkeypatch.setattr(os, "copy_file_range", filling_disk_in_the_kernel)  # the local store's copy
        with pytest.raises(DiskFull):
            store.get_to_file("obj", target)
        monkeypatch.undo()
        assert written[0] > 0  # it failed mid-transfer, not before
        assert os.listdir(target.parent) == []

    def test_failing_source_mid_upload_creates_nothing(
        self, store: Store, source: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        calls = [0]
        lock = threading.Lock()
        real_pread = os.pread

        def failing_read(fd: int, n: int, offset: int) -> bytes:
            with lock:
                calls[0] += 1
                if calls[0] > 1:
                    raise OSError(errno.EIO, "Input/output error")
            return real_pread(fd, min(n, 1 << 20), offset)  # short reads: the file is read in pieces

        def failing_copy(*args: Any) -> int:
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "pread", failing_read)
        monkeypatch.setattr(os, "copy_file_range", failing_copy)
        with pytest.raises(BulletinError):
            store.put_file_if_absent("obj", source)
        monkeypatch.undo()
        with pytest.raises(NotFound):
            store.get("obj")
        assert list(store.list("")) == []
        assert isinstance(store.put_file_if_absent("obj", source), Updated)  # nothing in the way

    def test_parallel_file_writers_have_one_winner(self, store: Store, tmp_path: Path) -> None:
        sources = []
        for n in range(4):
            path = tmp_path / f"s{n}"
            path.write_bytes(bytes([n]) * 1000 + _pattern(self.file_size - 1000))
            sources.append(path)
        barrier = threading.Barrier(len(sources), timeout=RACE_TIMEOUT)

        def write(path: Path) -> Any:
            barrier.wait()
            return store.put_file_if_absent("raced", path)

        with ThreadPoolExecutor(len(sources)) as pool:
            outcomes = list(pool.map(write, sources))
        winners = [n for n, o in enumerate(outcomes) if isinstance(o, Updated)]
        stored = store.get("raced")
        if not self.atomic_file_create:  # still: one writer's whole file, never a mix
            assert winners and stored.data in {sources[n].read_bytes() for n in winners}, outcomes
            return
        assert len(winners) == 1, outcomes
        assert stored.data == sources[winners[0]].read_bytes()
        assert {o.etag if isinstance(o, Updated) else o.current_etag for o in outcomes} == {stored.etag}


def _pattern(size: int) -> bytes:
    """``size`` bytes that differ at every offset mod 251 (a misplaced part shows)."""
    block = bytes(range(251))
    return (block * (size // 251 + 1))[:size]


class StoreContract(FileTransferContract):
    """Behaviour every :class:`~bulletin.storage.Store` implementation must show."""

    race_in_processes: ClassVar[bool] = False

    @pytest.fixture
    def store(self) -> Iterator[Store]:
        raise NotImplementedError("subclasses provide a fresh, empty store")

    # -- round trips ------------------------------------------------------------------

    def test_is_a_store(self, store: Store) -> None:
        assert isinstance(store, Store)
        assert "@" not in store.url
        assert store.writable  # the suite writes: read-only stores have their own tests

    def test_round_trip(self, store: Store) -> None:
        created = store.put_if_absent("dir/sub/object.bin", b"hello")
        assert isinstance(created, Updated)
        got = store.get("dir/sub/object.bin")
        assert got == ObjectData(b"hello", created.etag)
        info = store.stat("dir/sub/object.bin")
        assert (info.key, info.size, info.etag) == ("dir/sub/object.bin", 5, created.etag)
        assert isinstance(info.last_modified, datetime)
        assert info.last_modified.utcoffset() is not None

    def test_binary_data(self, store: Store) -> None:
        data = bytes(range(256)) * 33 + b"\x00\r\n\xff"
        store.put_if_absent("bin", data)
        assert store.get("bin").data == data

    def test_empty_object(self, store: Store) -> None:
        created = store.put_if_absent("empty", b"")
        assert isinstance(created, Updated)
        assert store.get("empty") == ObjectData(b"", created.etag)
        assert store.stat("empty").size == 0
        assert [i.size for i in store.list("empty")] == [0]

    def test_large_object(self, store: Store) -> None:
        data = bytes(range(251)) * (3 * 1024 * 1024 // 251)  # ~3 MiB, not a power of two
        created = store.put_if_absent("large", data)
        assert isinstance(created, Updated)
        assert store.get("large") == ObjectData(data, created.etag)

    def test_bytes_like_data(self, store: Store) -> None:
        buffer = bytearray(b"mutable")
        store.put_if_absent("ba", buffer)  # type: ignore[arg-type]
        buffer[:] = b"changed"  # the store kept its own copy
        store.put_if_absent("mv", memoryview(b"view"))  # type: ignore[arg-type]
        assert store.get("ba").data == b"mutable"
        assert store.get("mv").data == b"view"

    @pytest.mark.parametrize("data", ["text", 5, None, [1, 2]])
    def test_non_bytes_data_rejected(self, store: Store, data: object) -> None:
        with pytest.raises(InvalidInput):
            store.put_if_absent("k", data)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput):
            store.put_if_match("k", data, "etag")  # type: ignore[arg-type]
        assert list(store.list("")) == []

    def test_unicode_and_odd_keys(self, store: Store) -> None:
        keys = ["日本/語.bin", "sp ace/x y", "a+b=c&d?e#f", "percent%2Fslash", "~tilde", "-dash", "..dots"]
        for key in keys:
            assert isinstance(store.put_if_absent(key, key.encode()), Updated)
        for key in keys:
            assert store.get(key).data == key.encode()
        assert [i.key for i in store.list("")] == sorted(keys)

    def test_longest_key(self, store: Store) -> None:
        # 1024 bytes minus the store's own prefix, in segments a file system accepts.
        budget = 1024 - len(getattr(store, "prefix", "").encode())
        segments = ["s" * 200] * (budget // 201)
        key = "/".join([*segments, "k" * (budget - 201 * len(segments))])
        assert len(key.encode()) == budget
        store.put_if_absent(key, b"long")
        assert store.get(key).data == b"long"
        with pytest.raises(InvalidInput):
            store.put_if_absent(key + "x", b"too long")

    def test_get_range(self, store: Store) -> None:
        data = bytes(range(256)) * 40
        store.put_if_absent("r", data)
        assert store.get_range("r", 0, 10) == data[:10]
        assert store.get_range("r", 100, 5000) == data[100:5000]
        assert store.get_range("r", len(data) - 1, len(data)) == data[-1:]
        assert store.get_range("r", 10000, 20000) == data[10000:]  # cut at the end, as HTTP's
        assert store.get_range("r", len(data), len(data) + 5) == b""
        store.put_if_absent("empty", b"")
        assert store.get_range("empty", 0, 1) == b""
        for start, stop in [(-1, 2), (5, 5), (6, 5), (True, 3), (0, 2.0)]:
            with pytest.raises(InvalidInput):
                store.get_range("r", start, stop)  # type: ignore[arg-type]
        with pytest.raises(NotFound):
            store.get_range("missing", 0, 1)
        store.put_if_absent("dir/object", b"x")
        with pytest.raises(NotFound):
            store.get_range("dir", 0, 1)

    # -- not found --------------------------------------------------------------------

    def test_missing_key(self, store: Store) -> None:
        with pytest.raises(NotFound) as excinfo:
            store.get("missing/key")
        assert isinstance(excinfo.value, KeyError)
        with pytest.raises(NotFound):
            store.stat("missing/key")
        with pytest.raises(NotFound):
            store.get_if_changed("missing/key", None)
        with pytest.raises(NotFound):
            store.get_if_changed("missing/key", "some-etag")

    def test_prefix_of_a_key_is_not_an_object(self, store: Store) -> None:
        store.put_if_absent("dir/object", b"x")
        with pytest.raises(NotFound):
            store.get("dir")
        with pytest.raises(NotFound):
            store.stat("dir")

    # -- conditional reads ------------------------------------------------------------

    def test_get_if_changed(self, store: Store) -> None:
        first = store.put_if_absent("head", b"v1")
        assert isinstance(first, Updated)
        assert store.get_if_changed("head", first.etag) is None
        assert store.get_if_changed("head", None) == ObjectData(b"v1", first.etag)
        second = store.put_if_match("head", b"v2", first.etag)
        assert isinstance(second, Updated)
        assert store.get_if_changed("head", first.etag) == ObjectData(b"v2", second.etag)
        assert store.get_if_changed("head", second.etag) is None
        assert store.get_if_changed("head", "not-an-etag-of-ours") == ObjectData(b"v2", second.etag)

    # -- bounded reads ----------------------------------------------------------------

    def test_bounded_reads(self, store: Store) -> None:
        created = store.put_if_absent("obj", b"x" * 100)
        assert isinstance(created, Updated)
        for bound in (100, 101, 1 << 40):
            assert store.get("obj", max_bytes=bound) == ObjectData(b"x" * 100, created.etag)
            assert store.get_if_changed("obj", None, max_bytes=bound) == ObjectData(b"x" * 100, created.etag)
        for bound in (99, 0):
            with pytest.raises(ObjectTooLarge, match="obj"):
                store.get("obj", max_bytes=bound)
            with pytest.raises(ObjectTooLarge):
                store.get_if_changed("obj", "another-etag", max_bytes=bound)
        # Unchanged is None whatever the size: nothing would be read.
        assert store.get_if_changed("obj", created.etag, max_bytes=0) is None
        store.put_if_absent("empty", b"")
        assert store.get("empty", max_bytes=0).data == b""
        with pytest.raises(NotFound):
            store.get("missing", max_bytes=10)
        with pytest.raises(NotFound):
            store.get_if_changed("missing", None, max_bytes=10)

    @pytest.mark.parametrize("bound", [-1, True, 1.5, "10"])
    def test_bad_bounds_rejected(self, store: Store, bound: object) -> None:
        store.put_if_absent("obj", b"x")
        with pytest.raises(InvalidInput):
            store.get("obj", max_bytes=bound)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput):
            store.get_if_changed("obj", None, max_bytes=bound)  # type: ignore[arg-type]

    def test_an_object_over_its_bound_is_refused_unread(self, store: Store) -> None:
        store.put_if_absent("big", bytes(8 << 20))
        bound = 4 << 20
        # Once before measuring: a client's first request of a kind may load its own
        # tables (botocore's service model, say), which is not reading the object.
        with pytest.raises(ObjectTooLarge):
            store.get("big", max_bytes=bound)
        tracemalloc.start()
        try:
            with pytest.raises(ObjectTooLarge, match=str(8 << 20)):
                store.get("big", max_bytes=bound)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # Not even the bound's worth was read. (An asynchronous transport may have taken
        # a few socket reads of the body before it was dropped: aiohttp under s3fs held
        # 0.35-0.94 MiB here, whatever the object's size.)
        assert peak < bound

    # -- conditional writes -----------------------------------------------------------

    def test_create_only_conflict(self, store: Store) -> None:
        first = store.put_if_absent("once", b"first")
        assert isinstance(first, Updated)
        second = store.put_if_absent("once", b"second")
        assert second == Conflicted(first.etag)
        assert store.get("once") == ObjectData(b"first", first.etag)

    def test_cas_success(self, store: Store) -> None:
        first = store.put_if_absent("head", b"1")
        assert isinstance(first, Updated)
        second = store.put_if_match("head", b"2", first.etag)
        assert isinstance(second, Updated)
        assert second.etag != first.etag
        assert store.get("head") == ObjectData(b"2", second.etag)

    def test_cas_stale(self, store: Store) -> None:
        first = store.put_if_absent("head", b"1")
        assert isinstance(first, Updated)
        second = store.put_if_match("head", b"2", first.etag)
        assert isinstance(second, Updated)
        stale = store.put_if_match("head", b"3", first.etag)
        assert stale == Conflicted(second.etag)
        assert store.get("head") == ObjectData(b"2", second.etag)

    def test_cas_absent(self, store: Store) -> None:
        assert store.put_if_match("nothing", b"x", "whatever") == Conflicted(None)
        with pytest.raises(NotFound):
            store.get("nothing")

    def test_cas_after_delete(self, store: Store) -> None:
        first = store.put_if_absent("head", b"1")
        assert isinstance(first, Updated)
        store.delete("head")
        assert store.put_if_match("head", b"2", first.etag) == Conflicted(None)
        assert list(store.list("")) == []

    @pytest.mark.parametrize("etag", ["", None, 5])
    def test_cas_bad_etag(self, store: Store, etag: object) -> None:
        store.put_if_absent("head", b"1")
        with pytest.raises(InvalidInput):
            store.put_if_match("head", b"2", etag)  # type: ignore[arg-type]
        assert store.get("head").data == b"1"

    # -- delete -----------------------------------------------------------------------

    def test_delete_is_idempotent(self, store: Store) -> None:
        store.delete("never/existed")
        store.put_if_absent("dir/gone", b"x")
        store.put_if_absent("dir/kept", b"y")
        store.delete("dir/gone")
        store.delete("dir/gone")
        with pytest.raises(NotFound):
            store.get("dir/gone")
        assert [i.key for i in store.list("")] == ["dir/kept"]
        recreated = store.put_if_absent("dir/gone", b"again")
        assert isinstance(recreated, Updated)
        assert store.get("dir/gone").data == b"again"

    # -- listing ----------------------------------------------------------------------

    def test_list_order_prefix_start_after(self, store: Store) -> None:
        for key in LIST_KEYS:
            store.put_if_absent(key, key.encode())
        for prefix in LIST_PREFIXES:
            for start in LIST_STARTS:
                got = [i.key for i in store.list(prefix, start_after=start)]
                assert got == _model_list(LIST_KEYS, prefix, start), (prefix, start)

    def test_list_infos_match_stat(self, store: Store) -> None:
        store.put_if_absent("x/one", b"1")
        store.put_if_absent("x/three", b"333")
        infos = list(store.list("x/"))
        assert [(i.key, i.size) for i in infos] == [("x/one", 1), ("x/three", 3)]
        for info in infos:
            stat = store.stat(info.key)
            assert info.etag == stat.etag
            assert info.last_modified is not None
            assert info.last_modified.utcoffset() is not None

    def test_list_many_keys_crosses_pages(self, store: Store) -> None:
        keys = {f"many/{d}/{i:03d}": b"" for d in ("p", "q") for i in range(23)}
        put_many_if_absent(store, keys)
        assert [i.key for i in store.list("many/")] == sorted(keys)
        assert [i.key for i in store.list("many/", start_after="many/p/010")] == [
            k for k in sorted(keys) if k > "many/p/010"
        ]

    def test_list_validates_before_iterating(self, store: Store) -> None:
        for prefix in ["/abs", "a//", "../x", "a\\", "x\x00", 5]:
            with pytest.raises(InvalidInput):
                store.list(prefix)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput):
            store.list("", start_after=5)  # type: ignore[arg-type]

    def test_list_empty(self, store: Store) -> None:
        assert list(store.list("")) == []
        assert list(store.list("nothing/here/")) == []

    # -- keys -------------------------------------------------------------------------

    @pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
    def test_bad_keys_rejected(self, store: Store, key: Any) -> None:
        calls: list[Callable[[], object]] = [
            lambda: store.get(key),
            lambda: store.get_if_changed(key, None),
            lambda: store.stat(key),
            lambda: store.put_if_absent(key, b"x"),
            lambda: store.put_if_match(key, b"x", "etag"),
            lambda: store.delete(key),
        ]
        for call in calls:
            with pytest.raises(InvalidInput):
                call()
        assert list(store.list("")) == []

    # -- lifecycle --------------------------------------------------------------------

    def test_url_reopens_the_same_store(self, store: Store) -> None:
        store.put_if_absent("shared", b"seen")
        other = open_store(store.url)
        try:
            assert other.url == store.url
            assert other.get("shared").data == b"seen"
        finally:
            other.close()

    def test_closed_store_refuses_calls(self, store: Store) -> None:
        store.put_if_absent("k", b"v")
        store.close()
        store.close()  # idempotent
        with pytest.raises(InvalidInput, match="closed"):
            store.get("k")
        with pytest.raises(InvalidInput, match="closed"):
            store.list("")

    # -- bulk transfers ---------------------------------------------------------------

    def test_put_many_and_get_many(self, store: Store) -> None:
        items = {f"shards/{i:02d}": bytes([i]) * (i + 1) for i in range(20)}
        sent: list[int] = []
        results = put_many_if_absent(store, items, max_workers=4, on_bytes=sent.append)
        assert list(results) == list(items)
        assert all(isinstance(r, Updated) for r in results.values())
        assert sorted(sent) == sorted(len(v) for v in items.values())
        again = put_many_if_absent(store, items)
        assert all(isinstance(r, Conflicted) for r in again.values())
        received: list[int] = []
        keys = list(reversed(items))
        got = get_many(store, keys, max_workers=3, on_bytes=received.append)
        assert list(got) == keys
        assert got == items
        assert sum(received) == sum(len(v) for v in items.values())
        with pytest.raises(NotFound):
            get_many(store, [*keys, "shards/missing"])

    def test_get_many_bounds_each_read(self, store: Store) -> None:
        items = {f"b/{i}": bytes(i + 1) for i in range(6)}
        put_many_if_absent(store, items)
        assert get_many(store, list(items), max_bytes=6) == items
        assert get_many(store, list(items), max_bytes={k: len(v) for k, v in items.items()}) == items
        with pytest.raises(ObjectTooLarge, match="b/5"):
            get_many(store, list(items), max_bytes=5)
        with pytest.raises(ObjectTooLarge, match="b/2"):
            get_many(store, list(items), max_bytes={**{k: 10 for k in items}, "b/2": 2})
        with pytest.raises(InvalidInput, match="no bound"):
            get_many(store, list(items), max_bytes={"b/0": 1})
        with pytest.raises(InvalidInput):
            get_many(store, list(items), max_bytes=-1)

    # -- races ------------------------------------------------------------------------

    def test_create_only_race_has_one_winner(self, store: Store) -> None:
        if self.race_in_processes:
            outcomes = self._race_create_in_processes(store.url)
        else:
            outcomes = self._race_create_in_threads(store)
        assert len(outcomes) == RACE_WRITERS * RACE_ROUNDS
        for round_no in range(RACE_ROUNDS):
            this_round = [o for o in outcomes if o[0] == round_no]
            winners = [o for o in this_round if o[2]]
            assert len(winners) == 1, f"round {round_no}: {len(winners)} winners"
            _, writer, _, etag = winners[0]
            assert etag is not None
            stored = store.get(f"race/{round_no}")
            assert stored == ObjectData(race_workers.payload(writer, round_no), etag)
            # Every loser saw the winner's object, never a half-written one.
            assert {o[3] for o in this_round} == {etag}

    def _race_create_in_threads(self, store: Store) -> list[tuple[int, int, bool, str | None]]:
        barrier = threading.Barrier(RACE_WRITERS, timeout=RACE_TIMEOUT)
        results: queue.Queue[tuple[int, int, bool, str | None]] = queue.Queue()
        errors: list[BaseException] = []

        def writer(number: int) -> None:
            try:
                for round_no in range(RACE_ROUNDS):
                    barrier.wait()
                    outcome = store.put_if_absent(f"race/{round_no}", race_workers.payload(number, round_no))
                    won = isinstance(outcome, Updated)
                    etag = outcome.etag if isinstance(outcome, Updated) else outcome.current_etag
                    results.put((round_no, number, won, etag))
            except BaseException as exc:  # reported below, in the test's thread
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=writer, args=(n,)) for n in range(RACE_WRITERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(RACE_TIMEOUT)
        assert not errors, errors
        return [results.get_nowait() for _ in range(results.qsize())]

    def _race_create_in_processes(self, url: str) -> list[tuple[int, int, bool, str | None]]:
        ctx = multiprocessing.get_context("spawn")
        barrier = ctx.Barrier(RACE_WRITERS, timeout=RACE_TIMEOUT)
        results = ctx.Queue()
        procs = [
            ctx.Process(
                target=race_workers.create_only_writer,
                args=(url, n, RACE_ROUNDS, barrier, results, "race/"),
            )
            for n in range(RACE_WRITERS)
        ]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=RACE_TIMEOUT) for _ in range(RACE_WRITERS * RACE_ROUNDS)]
        for p in procs:
            p.join(RACE_TIMEOUT)
            assert p.exitcode == 0
        results.close()
        results.join_thread()
        return outcomes

    def test_cas_race_never_loses_an_update_nor_moves_back(self, store: Store) -> None:
        first = store.put_if_absent("head", b"0")
        assert isinstance(first, Updated)
        stop = threading.Event()
        seen: list[int] = []
        reader_errors: list[BaseException] = []

        def reader() -> None:
            # Polls like a rollout node; records every value it sees, in order.
            try:
                while not stop.is_set():
                    seen.append(int(store.get("head").data))
            except BaseException as exc:
                reader_errors.append(exc)

        watcher = threading.Thread(target=reader)
        watcher.start()
        try:
            if self.race_in_processes:
                written = self._race_cas_in_processes(store.url)
            else:
                written = self._race_cas_in_threads(store)
        finally:
            stop.set()
            watcher.join(RACE_TIMEOUT)
        assert not reader_errors, reader_errors
        total = CAS_WRITERS * CAS_INCREMENTS
        # Each value was written by exactly one successful CAS: no two writers ever
        # both won from the same base, and no success was lost.
        assert sorted(written) == list(range(1, total + 1))
        assert int(store.get("head").data) == total
        assert seen == sorted(seen), "the head moved backwards"

    def _race_cas_in_threads(self, store: Store) -> list[int]:
        barrier = threading.Barrier(CAS_WRITERS, timeout=RACE_TIMEOUT)
        written: queue.Queue[int] = queue.Queue()
        errors: list[BaseException] = []

        def writer() -> None:
            try:
                barrier.wait()
                done = 0
                while done < CAS_INCREMENTS:
                    current = store.get("head")
                    value = int(current.data) + 1
                    outcome = store.put_if_match("head", str(value).encode(), current.etag)
                    if isinstance(outcome, Updated):
                        written.put(value)
                        done += 1
            except BaseException as exc:
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=writer) for _ in range(CAS_WRITERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(RACE_TIMEOUT)
        assert not errors, errors
        return [written.get_nowait() for _ in range(written.qsize())]

    def _race_cas_in_processes(self, url: str) -> list[int]:
        ctx = multiprocessing.get_context("spawn")
        barrier = ctx.Barrier(CAS_WRITERS, timeout=RACE_TIMEOUT)
        results = ctx.Queue()
        procs = [
            ctx.Process(
                target=race_workers.cas_writer,
                args=(url, "head", CAS_INCREMENTS, barrier, results),
            )
            for _ in range(CAS_WRITERS)
        ]
        for p in procs:
            p.start()
        written = [int(results.get(timeout=RACE_TIMEOUT)) for _ in range(CAS_WRITERS * CAS_INCREMENTS)]
        for p in procs:
            p.join(RACE_TIMEOUT)
            assert p.exitcode == 0
        results.close()
        results.join_thread()
        return written
