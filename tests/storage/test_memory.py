"""The memory store: the contract, plus what is particular to it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from bulletin.errors import ConfigError
from bulletin.storage import MemoryStore, Store, Updated, drop_memory_bucket, open_store
from tests.storage.contract import StoreContract


def _name() -> str:
    return f"test-{uuid.uuid4().hex}"


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def store(self, memory_store: MemoryStore) -> Store:
        return memory_store


class TestPrefixedMemoryStore(StoreContract):
    @pytest.fixture
    def store(self) -> Iterator[Store]:
        name = _name()
        store = open_store(f"memory://{name}/runs/r1")
        yield store
        store.close()
        drop_memory_bucket(name)


def test_stores_of_one_name_share_objects() -> None:
    name = _name()
    a, b, other = MemoryStore(name), open_store(f"memory://{name}"), MemoryStore(_name())
    a.put_if_absent("k", b"v")
    assert b.get("k").data == b"v"
    assert list(other.list("")) == []
    drop_memory_bucket(name)
    assert list(a.list("")) == []


def test_prefix_is_transparent() -> None:
    name = _name()
    root, run = MemoryStore(name), MemoryStore(name, "runs/a/")
    assert run.url == f"memory://{name}/runs/a"
    assert run.prefix == "runs/a/"
    run.put_if_absent("head", b"h")
    assert root.get("runs/a/head").data == b"h"
    assert [i.key for i in run.list("")] == ["head"]
    assert [i.key for i in root.list("")] == ["runs/a/head"]
    drop_memory_bucket(name)


def test_etags_are_never_reused() -> None:
    store = MemoryStore(_name())
    first = store.put_if_absent("k", b"same")
    assert isinstance(first, Updated)
    store.delete("k")
    second = store.put_if_absent("k", b"same")
    assert isinstance(second, Updated)
    third = store.put_if_match("k", b"same", second.etag)
    assert isinstance(third, Updated)
    assert len({first.etag, second.etag, third.etag}) == 3
    # A writer holding the ETag from before the delete cannot overwrite.
    assert not isinstance(store.put_if_match("k", b"x", first.etag), Updated)


def test_listing_pages_past_one_thousand_keys() -> None:
    store = MemoryStore(_name())
    keys = [f"k/{i:05d}" for i in range(2345)]
    for key in keys:
        store.put_if_absent(key, b"")
    assert [i.key for i in store.list("k/")] == keys
    assert [i.key for i in store.list("k/", start_after="k/01000")] == keys[1001:]


def test_listing_sees_keys_written_after_its_page() -> None:
    store = MemoryStore(_name())
    for i in range(1500):
        store.put_if_absent(f"k/{i:05d}", b"")
    it = store.list("k/")
    assert next(it).key == "k/00000"
    store.put_if_absent("k/99999", b"")  # beyond the first page: the next page sees it
    assert [i.key for i in it][-1] == "k/99999"


@pytest.mark.parametrize("name", ["", "a/b", "tab\there"])
def test_bad_names(name: str) -> None:
    with pytest.raises(ConfigError):
        MemoryStore(name)


def test_bad_prefix() -> None:
    with pytest.raises(ConfigError):
        MemoryStore(_name(), "a/../b")
