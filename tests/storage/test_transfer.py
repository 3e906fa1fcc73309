"""Parallel bulk transfers: bounded, ordered results, first error wins, nothing half-reported."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from bulletin.errors import InvalidInput, NotFound, StorageUnavailable
from bulletin.storage import (
    Conflicted,
    MemoryStore,
    ObjectData,
    Updated,
    WriteResult,
    get_many,
    put_many_if_absent,
)
from bulletin.storage.wrapper import WrapperStore


class SlowStore(WrapperStore):
    """A real memory store behind a delay, recording how many calls overlap."""

    def __init__(self, delay: float = 0.03, fail_on: str | None = None) -> None:
        super().__init__(MemoryStore(f"transfer-{uuid.uuid4().hex}"))
        self.delay = delay
        self.fail_on = fail_on
        self.calls: list[str] = []
        self._lock = threading.Lock()
        self._active = 0
        self.peak = 0

    def _enter(self, key: str) -> None:
        with self._lock:
            self.calls.append(key)
            self._active += 1
            self.peak = max(self.peak, self._active)
        time.sleep(self.delay)
        with self._lock:
            self._active -= 1
        if key == self.fail_on:
            raise StorageUnavailable(f"injected failure on {key}")

    def get(self, key: str, *, max_bytes: int | None = None) -> ObjectData:
        self._enter(key)
        return super().get(key, max_bytes=max_bytes)

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        self._enter(key)
        return super().put_if_absent(key, data)


def test_workers_are_bounded_and_used() -> None:
    store = SlowStore()
    items = {f"k{i:02d}": b"x" * i for i in range(24)}
    put_many_if_absent(store, items, max_workers=3)
    assert store.peak == 3
    store.peak = 0
    got = get_many(store, list(items), max_workers=5)
    assert store.peak == 5
    assert got == items


def test_results_follow_input_order_and_duplicates_are_read_once() -> None:
    store = SlowStore(delay=0)
    put_many_if_absent(store, {"a": b"1", "b": b"2"})
    store.calls.clear()
    got = get_many(store, ["b", "a", "b"])
    assert list(got) == ["b", "a"]
    assert sorted(store.calls) == ["a", "b"]


def test_progress_runs_on_the_calling_thread() -> None:
    store = SlowStore(delay=0)
    threads: set[int] = set()
    total = 0

    def progress(n: int) -> None:
        nonlocal total
        threads.add(threading.get_ident())
        total += n

    put_many_if_absent(store, {f"k{i}": b"x" * 10 for i in range(10)}, on_bytes=progress)
    get_many(store, [f"k{i}" for i in range(10)], on_bytes=progress)
    assert threads == {threading.get_ident()}
    assert total == 200


def test_first_error_is_raised_and_the_rest_cancelled() -> None:
    store = SlowStore(delay=0.01, fail_on="k03")
    items = {f"k{i:02d}": b"x" for i in range(40)}
    with pytest.raises(StorageUnavailable, match="k03"):
        put_many_if_absent(store, items, max_workers=2)
    # Writes that had not started when the error came were never sent.
    assert len(store.calls) < len(items)


def test_missing_key_is_not_found() -> None:
    store = MemoryStore(f"transfer-{uuid.uuid4().hex}")
    store.put_if_absent("here", b"x")
    with pytest.raises(NotFound):
        get_many(store, ["here", "missing"])


def test_existing_objects_are_conflicts_not_errors() -> None:
    store = MemoryStore(f"transfer-{uuid.uuid4().hex}")
    first = store.put_if_absent("a", b"old")
    assert isinstance(first, Updated)
    results = put_many_if_absent(store, {"a": b"new", "b": b"new"})
    assert results["a"] == Conflicted(first.etag)
    assert isinstance(results["b"], Updated)
    assert store.get("a").data == b"old"


def test_empty_inputs() -> None:
    store = MemoryStore(f"transfer-{uuid.uuid4().hex}")
    assert get_many(store, []) == {}
    assert put_many_if_absent(store, {}) == {}


@pytest.mark.parametrize("workers", [0, -1, 1.5, True, "8"])
def test_bad_worker_counts(workers: object) -> None:
    store = MemoryStore(f"transfer-{uuid.uuid4().hex}")
    with pytest.raises(InvalidInput):
        get_many(store, ["a"], max_workers=workers)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        put_many_if_absent(store, {"a": b""}, max_workers=workers)  # type: ignore[arg-type]


def test_bad_keys_and_data_are_refused_before_anything_is_sent() -> None:
    store = SlowStore(delay=0)
    with pytest.raises(InvalidInput):
        get_many(store, "abc")
    with pytest.raises(InvalidInput):
        get_many(store, ["ok", "../escape"])
    with pytest.raises(InvalidInput):
        put_many_if_absent(store, {"ok": b"x", "bad//key": b"y"})
    with pytest.raises(InvalidInput):
        put_many_if_absent(store, {"ok": b"x", "other": "text"})  # type: ignore[dict-item]
    assert store.calls == []
