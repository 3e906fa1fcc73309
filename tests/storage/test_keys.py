"""Key and prefix validation, and the promise behind it: a valid key is safe everywhere."""

from __future__ import annotations

import os
import tempfile
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bulletin.errors import ConfigError, InvalidInput
from bulletin.storage import LocalStore, MemoryStore, Store
from bulletin.storage.keys import (
    MAX_KEY_BYTES,
    check_data,
    check_etag,
    check_key,
    check_prefix,
    check_start_after,
    check_store_prefix,
    join_key,
)
from tests.storage.contract import BAD_KEYS


@pytest.mark.parametrize(
    "key",
    ["a", "a/b/c", "..a", "a..", ".hidden", "a/.b", "日本/語", "x" * MAX_KEY_BYTES, "a b/c+d", ".bulletin"],
)
def test_good_keys(key: str) -> None:
    assert check_key(key) == key


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_bad_keys(key: object) -> None:
    with pytest.raises(InvalidInput):
        check_key(key)


@pytest.mark.parametrize("prefix", ["", "a", "a/", "a/b", "a/.", "a/..", "a/.bulletin-", ".", "é"])
def test_good_prefixes(prefix: str) -> None:
    # The last segment may be partial: "a/." is the start of "a/.hidden".
    assert check_prefix(prefix) == prefix


@pytest.mark.parametrize("prefix", ["/a", "a//", "../a", "a/./b", "a\\b", "a\x00", "x" * 1025, None, 3])
def test_bad_prefixes(prefix: object) -> None:
    with pytest.raises(InvalidInput):
        check_prefix(prefix)


def test_start_after() -> None:
    assert check_start_after(None) is None
    assert check_start_after("") == ""
    assert check_start_after("a//b") == "a//b"  # any string sorts somewhere
    for bad in (5, "a\x00", "x" * 1025, "\udc80"):
        with pytest.raises(InvalidInput):
            check_start_after(bad)


def test_store_prefix() -> None:
    assert check_store_prefix("") == ""
    assert check_store_prefix("/") == ""
    assert check_store_prefix("/runs/a/") == "runs/a/"
    with pytest.raises(ConfigError):
        check_store_prefix("runs//a")


def test_join_key_counts_the_store_prefix() -> None:
    assert join_key("runs/a/", "k") == "runs/a/k"
    key = "k" * (MAX_KEY_BYTES - len("runs/a/"))
    assert len(join_key("runs/a/", key)) == MAX_KEY_BYTES
    with pytest.raises(InvalidInput, match="prefix"):
        join_key("runs/a/", key + "k")


def test_data_and_etags() -> None:
    assert check_data(b"x") == b"x"
    assert check_data(bytearray(b"x")) == b"x"
    assert check_data(memoryview(b"x")) == b"x"
    with pytest.raises(InvalidInput):
        check_data("x")
    assert check_etag('"abc"') == '"abc"'
    for bad in ("", None, 1, "a\nb"):
        with pytest.raises(InvalidInput):
            check_etag(bad)


_segment = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="/"), min_size=0, max_size=12
)
_candidate_keys = st.lists(_segment, min_size=1, max_size=4).map("/".join)


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(_candidate_keys, min_size=1, max_size=6, unique=True))
def test_valid_keys_round_trip_on_disk_and_in_memory(keys: list[str]) -> None:
    # Whatever check_key lets through is stored, read back and listed unchanged,
    # and never lands outside the local store's root.
    accepted = []
    for key in keys:
        try:
            accepted.append(check_key(key))
        except InvalidInput:
            continue
    # A local store cannot hold both "a" and "a/b": keep keys that are not prefixes of others.
    accepted = [k for k in accepted if not any(o.startswith(k + "/") for o in accepted)]
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "root")
        stores: list[Store] = [LocalStore(root), MemoryStore(f"keys-{uuid.uuid4().hex}")]
        for store in stores:
            for key in accepted:
                store.put_if_absent(key, key.encode())
            for key in accepted:
                assert store.get(key).data == key.encode()
            assert [i.key for i in store.list("")] == sorted(accepted)
        assert os.listdir(tmp) == (["root"] if accepted else [])
