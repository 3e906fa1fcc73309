"""Wrapping stores: a wrapper is still a store (the contract), and the counts are right."""

from __future__ import annotations

import pytest

from bulletin.errors import NotFound, ObjectTooLarge
from bulletin.storage import MemoryStore, Store, Updated
from bulletin.storage.wrapper import CountingStore, Traffic, WrapperStore
from tests.storage.contract import StoreContract


class TestWrapperStore(StoreContract):
    @pytest.fixture
    def store(self, memory_store: MemoryStore) -> Store:
        return WrapperStore(memory_store)


class TestCountingStore(StoreContract):
    @pytest.fixture
    def store(self, memory_store: MemoryStore) -> Store:
        return CountingStore(memory_store)


def test_counts_requests_and_payload_bytes_both_ways(memory_store: MemoryStore) -> None:
    store = CountingStore(memory_store)
    assert store.url == memory_store.url and repr(store) == f"CountingStore({memory_store!r})"
    created = store.put_if_absent("k", b"12345")
    assert isinstance(created, Updated)
    assert store.get("k").data == b"12345"
    assert store.get_if_changed("k", created.etag) is None  # unchanged: a request, no bytes
    store.put_if_match("k", b"abc", created.etag)
    store.stat("k")
    assert [i.key for i in store.list("")] == ["k"]
    store.delete("k")
    with pytest.raises(NotFound):
        store.get("k")  # a failed request still counts
    assert store.reset() == Traffic(requests=8, up=8, down=5)
    assert store.reset() == Traffic(0, 0, 0)
    store.put_if_absent("big", b"x" * 100)
    with pytest.raises(ObjectTooLarge):
        store.get("big", max_bytes=10)  # refused unread: a request, no bytes
    assert store.get("big", max_bytes=100).data == b"x" * 100
    assert store.reset() == Traffic(requests=3, up=100, down=100)
