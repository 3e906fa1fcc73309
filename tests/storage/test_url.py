"""``open_store``: which URL opens which store, and which are refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bulletin.errors import ConfigError
from bulletin.storage import LocalStore, MemoryStore, S3Store, open_store


def test_bare_paths_and_path_objects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert open_store(tmp_path).url == tmp_path.as_uri()
    monkeypatch.chdir(tmp_path)
    relative = open_store("sub/dir")
    assert isinstance(relative, LocalStore)
    assert relative.root == os.path.join(str(tmp_path), "sub", "dir")
    assert open_store("with:colon").url == (tmp_path / "with:colon").as_uri()


def test_file_urls(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}")
    assert isinstance(store, LocalStore)
    assert store.root == str(tmp_path)
    assert open_store(f"file://localhost{tmp_path}").url == tmp_path.as_uri()
    spaced = open_store((tmp_path / "a b").as_uri())
    assert isinstance(spaced, LocalStore)
    assert spaced.root == str(tmp_path / "a b")


def test_memory_urls() -> None:
    store = open_store("memory://unit-url/a/b/")
    assert isinstance(store, MemoryStore)
    assert (store.name, store.prefix, store.url) == ("unit-url", "a/b/", "memory://unit-url/a/b")
    assert open_store("memory://unit-url").url == "memory://unit-url"


def test_s3_urls() -> None:
    store = open_store(
        "s3://my-bucket/runs/x%20y?region=eu-west-1&endpoint_url=http%3A%2F%2F127.0.0.1%3A9"
        "&max_attempts=3&connect_timeout=0.5&read_timeout=30&page_size=10"
        "&addressing_style=path&retry_mode=adaptive&max_pool_connections=32"
    )
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix) == ("my-bucket", "runs/x y/")
    assert store.endpoint_url == "http://127.0.0.1:9"
    # The canonical URL opens an equal store again.
    assert open_store(store.url).url == store.url
    assert store.url.startswith("s3://my-bucket/runs/x%20y?")
    store.close()


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("", "non-empty"),
        ("   ", "non-empty"),
        ("ftp://host/path", "unsupported"),
        ("gs://bucket", "not installed"),  # gcsfs is no dependency
        ("s3:bucket", "malformed"),
        ("memory:name", "malformed"),
        ("file:relative", "malformed"),
        ("file://otherhost/path", "local absolute path"),
        ("file:///tmp/x?y=1", "query"),
        ("memory://", "name"),
        ("memory://name?x=1", "query"),
        ("memory://name#frag", "query or fragment"),
        ("s3://", "bucket"),
        ("s3://key:secret@bucket/p", "credentials"),
        ("s3://AKIA@bucket/p", "credentials"),
        ("s3://bucket?unknown=1", "unknown"),
        ("s3://bucket?region=a&region=b", "twice"),
        ("s3://bucket?region=", "empty"),
        ("s3://bucket?max_attempts=many", "integer"),
        ("s3://bucket?connect_timeout=soon", "number"),
        ("s3://bucket?garbage", "malformed"),
        ("s3://bucket#frag", "fragment"),
        ("s3://bucket:9000/p", "bucket"),
        ("s3://bucket/a/../b", "prefix"),
    ],
)
def test_bad_urls(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        open_store(url)


@pytest.mark.parametrize("value", [None, 5, b"/tmp/x"])
def test_not_a_url(value: object) -> None:
    with pytest.raises(ConfigError):
        open_store(value)  # type: ignore[arg-type]


def test_credentials_never_in_the_canonical_url() -> None:
    store = open_store("s3://bucket/p?endpoint_url=http://127.0.0.1:9&region=us-east-1")
    assert store.url == "s3://bucket/p?endpoint_url=http://127.0.0.1:9&region=us-east-1"
    assert "@" not in store.url
