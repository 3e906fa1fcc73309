"""fsspec filesystems without conditional writes as read-only stores (fsspec's memory and
local filesystems here), and the fsspec store URLs.

A run is published with the local store, copied into the filesystem as any tool would
copy a bucket, and read back through the fsspec store: sync bit-exact, reads and listings
as the protocol says, every write refused with ``StoreNotWritable`` and nothing changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
from numpy.typing import NDArray

from bulletin import Publisher, Subscriber
from bulletin.cli import main
from bulletin.errors import (
    AccessDenied,
    ConfigError,
    DigestMismatch,
    InvalidInput,
    NotFound,
    ObjectTooLarge,
    StorageUnavailable,
    StoreNotWritable,
)
from bulletin.maintenance import collect_garbage
from bulletin.run import Run
from bulletin.storage import FsspecStore, HttpStore, LocalStore, S3fsStore, S3Store, Store, open_fsspec, open_store
from bulletin.storage.fsspec_store import DIGEST_ETAG_PREFIX, fs_error
from bulletin.target import ArrayTarget
from tests.run.helpers import assert_bits_equal, publish_versions
from tests.storage.contract import LIST_KEYS, LIST_PREFIXES, LIST_STARTS, _model_list

RUN = "run"
VERSIONS = 4
KINDS = ["memory", "local"]


def _copy_into(fs: Any, bucket: Path, root: str) -> None:
    """Copy a local bucket's objects (not the local store's own files) into ``fs`` at ``root``."""
    for path in sorted(bucket.rglob("*")):
        relative = path.relative_to(bucket).as_posix()
        if path.is_file() and ".bulletin-" not in relative:
            fs.pipe_file(f"{root}/{relative}", path.read_bytes())


class Filesystem:
    """One filesystem under test: its fsspec object, the root path, and the store URL."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        if kind == "memory":
            self.fs = fsspec.filesystem("memory")
            self.root = f"/test-{uuid.uuid4().hex}"
            self.url = f"fsspec+memory://{self.root.lstrip('/')}"
        else:
            self.fs = fsspec.filesystem("file", auto_mkdir=True)
            self.root = str(tmp_path / "fs-root")
            self.fs.makedirs(self.root, exist_ok=True)
            self.url = f"fsspec+file://{self.root}"

    def put(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(f"{self.root}/{key}", data)

    def snapshot(self) -> dict[str, bytes]:
        return {p: self.fs.cat_file(p) for p in self.fs.find(self.root)}

    def close(self) -> None:
        if self.kind == "memory" and self.fs.exists(self.root):
            self.fs.rm(self.root, recursive=True)


@pytest.fixture(params=KINDS)
def filesystem(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Filesystem]:
    fs = Filesystem(request.param, tmp_path)
    yield fs
    fs.close()


@pytest.fixture
def store(filesystem: Filesystem) -> Iterator[Store]:
    store = open_store(filesystem.url)
    yield store
    store.close()


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, NDArray[np.unsignedinteger]]]]:
    bucket = tmp_path_factory.mktemp("published") / "bucket"
    return bucket, publish_versions(bucket, RUN, VERSIONS, seed=3, keyframe_every=3)


# -- a run through the filesystem ------------------------------------------------------------


def test_sync_is_bit_exact(
    filesystem: Filesystem, store: Store, published: tuple[Path, list[dict[str, NDArray[np.unsignedinteger]]]]
) -> None:
    bucket, served = published
    _copy_into(filesystem.fs, bucket, filesystem.root)
    assert isinstance(store, FsspecStore) and not store.writable
    with Subscriber(store, RUN, target=ArrayTarget()) as sub:
        assert sub.sync(2) == 2
        assert_bits_equal(dict(sub.target.arrays), served[1])  # type: ignore[attr-defined]
        assert sub.sync() == VERSIONS
        assert_bits_equal(dict(sub.target.arrays), served[-1])  # type: ignore[attr-defined]
    assert [i.key for i in store.list(f"{RUN}/manifests/")] == [
        i.key for i in LocalStore(bucket).list(f"{RUN}/manifests/")
    ]


def test_cli_reads_and_refuses_writes(
    filesystem: Filesystem,
    published: tuple[Path, list[dict[str, NDArray[np.unsignedinteger]]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bucket, _ = published
    _copy_into(filesystem.fs, bucket, filesystem.root)
    common = ("--store", filesystem.url, "--run", RUN, "--json")
    assert main(["log", *common]) == 0
    assert [e["version"] for e in json.loads(capsys.readouterr().out)] == list(range(VERSIONS, 0, -1))
    assert main(["verify", *common]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    assert main(["sync", *common, "--to", str(tmp_path / "node")]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == VERSIONS
    before = filesystem.snapshot()
    checkpoint = next(bucket.rglob("model.safetensors"))
    for args in (["publish", str(checkpoint), *common], ["gc", "--keep", "1", *common]):
        assert main(args) == 2
        assert json.loads(capsys.readouterr().out)["error"]["code"] == "store_not_writable"
    assert filesystem.snapshot() == before


# -- the read-only protocol ----------------------------------------------------------------


def test_reads_with_content_etags(filesystem: Filesystem, store: Store) -> None:
    filesystem.put("dir/head", b"v1")
    first = store.get("dir/head")
    assert first.data == b"v1" and first.etag.startswith(DIGEST_ETAG_PREFIX)  # these report no ETag
    assert store.get_if_changed("dir/head", first.etag) is None
    filesystem.put("dir/head", b"v2")
    second = store.get_if_changed("dir/head", first.etag)
    assert second is not None and second.data == b"v2" and second.etag != first.etag
    assert store.get_if_changed("dir/head", None) == second
    info = store.stat("dir/head")
    assert (info.key, info.size) == ("dir/head", 2) and info.last_modified is not None


def test_missing_keys_and_directories_are_not_found(filesystem: Filesystem, store: Store) -> None:
    filesystem.put("dir/object", b"x")
    for key in ("missing", "dir", "dir/object/below"):
        with pytest.raises(NotFound):
            store.get(key)
        with pytest.raises(NotFound):
            store.stat(key)
        with pytest.raises(NotFound):
            store.get_if_changed(key, "etag")
    with pytest.raises(InvalidInput):
        store.get("../escape")


def test_bounded_reads(filesystem: Filesystem, store: Store) -> None:
    filesystem.put("big", bytes(1000))
    assert len(store.get("big", max_bytes=1000).data) == 1000
    with pytest.raises(ObjectTooLarge, match="1000 bytes"):
        store.get("big", max_bytes=999)
    with pytest.raises(ObjectTooLarge):
        store.get_if_changed("big", None, max_bytes=10)


@pytest.mark.parametrize("prefix", LIST_PREFIXES)
def test_listing_order_and_bounds(filesystem: Filesystem, store: Store, prefix: str) -> None:
    for key in LIST_KEYS:
        filesystem.put(key, key.encode())
    filesystem.put("a/.bulletin-tmp-x", b"a crashed writer's leftover")
    for start in LIST_STARTS:
        listed = list(store.list(prefix, start_after=start))
        assert [i.key for i in listed] == _model_list(LIST_KEYS, prefix, start), (prefix, start)
        assert all(i.size == len(i.key.encode()) for i in listed)


def test_every_write_is_refused_and_nothing_changes(filesystem: Filesystem, store: Store) -> None:
    filesystem.put("head", b"h")
    before = filesystem.snapshot()
    etag = store.get("head").etag
    for write in (
        lambda: store.put_if_absent("new", b"x"),
        lambda: store.put_if_absent("head", b"x"),
        lambda: store.put_if_match("head", b"x", etag),
        lambda: store.delete("head"),
        lambda: Publisher(store, RUN),
        lambda: collect_garbage(Run(store, RUN), keep=1),
    ):
        with pytest.raises(StoreNotWritable) as info:
            write()
        assert isinstance(info.value, ConfigError)
    assert filesystem.snapshot() == before


def test_a_closed_store_refuses_calls(store: Store) -> None:
    store.close()
    store.close()
    with pytest.raises(InvalidInput, match="closed"):
        store.get("k")


# -- URLs ------------------------------------------------------------------------------------


def test_which_url_opens_which_store() -> None:
    assert isinstance(open_store("fsspec+memory://x/run"), FsspecStore)
    assert isinstance(open_store("https://example.invalid/b"), HttpStore)
    assert isinstance(open_store("fsspec+http://example.invalid/b"), HttpStore)
    s3 = open_store("fsspec+s3://bucket/p?endpoint_url=http://127.0.0.1:9")
    assert isinstance(s3, S3fsStore) and s3.writable and s3.prefix == "p/"
    assert type(open_store("s3://bucket/p")) is S3Store  # s3:// stays boto3


def test_query_options_reach_the_filesystem_and_the_canonical_url() -> None:
    url = 'fsspec+s3://bucket/runs/a/?anon=true&client_kwargs={"region_name":"eu-west-1"}&endpoint_url=http://h:9'
    store = open_store(url)
    assert isinstance(store, S3fsStore)
    fs = store.fs
    assert fs.anon is True and fs.client_kwargs == {"region_name": "eu-west-1"}
    assert fs.endpoint_url == "http://h:9"
    assert store.url.startswith("fsspec+s3://bucket/runs/a?anon=true&client_kwargs=")
    assert open_store(store.url).url == store.url
    quoted = open_store('fsspec+memory://x?default_block_size="5"')
    assert open_store(quoted.url).url == quoted.url == "fsspec+memory://x?default_block_size=%225%22"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("fsspec+s3://bucket?key=AKIA&secret=x", "secrets"),
        ('fsspec+s3://bucket?client_kwargs={"aws_secret_access_key":"x"}', "client_kwargs.aws_secret_access_key"),
        ('https://host/b?headers={"Authorization":"Bearer x"}', "headers.Authorization"),
        ("fsspec+gcs://bucket?token=x", "secrets"),
        ("https://user:pw@host/b", "credentials"),
        ("https://user@host/b", "credentials"),
        ("fsspec+s3://AKIA:x@bucket", "credentials"),
        ("fsspec+s3://bucket?endpoint_url=http://AKIA:x@minio:9000", "endpoint_url"),
        ("fsspec+memory://x?a=1&a=2", "twice"),
        ("fsspec+memory://x?skip_instance_cache=true", "skip_instance_cache"),
        ("fsspec+memory://x#frag", "fragment"),
        ("fsspec+simplecache::s3://bucket", "fsspec"),
        ("fsspec+memory:x", "malformed"),
        ("fsspec+://x", "fsspec"),
        ("fsspec+nope://x", "Protocol not known"),
        ("gs://bucket", "not installed"),
        ("fsspec+s3://bad_bucket!/p", "bucket"),
        ("fsspec+s3://bucket/a/../b", "prefix"),
        ("fsspec+memory://x?block_size", "malformed"),
    ],
)
def test_bad_fsspec_urls(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        open_store(url)


def test_an_azure_account_in_the_authority_is_not_a_credential() -> None:
    try:
        import adlfs  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="not installed"):  # past the credentials check
            open_store("abfs://container@account.dfs.core.windows.net/runs")
    else:  # pragma: no cover - adlfs is not a dependency
        assert isinstance(open_store("abfs://container@account.dfs.core.windows.net/runs"), FsspecStore)


def test_open_fsspec_takes_options_a_url_could_not_carry(tmp_path: Path) -> None:
    store = open_fsspec(tmp_path.as_uri(), {"auto_mkdir": True})
    assert isinstance(store, FsspecStore) and store.fs.auto_mkdir is True
    assert store.url == f"fsspec+{tmp_path.as_uri()}" and store.root == str(tmp_path)


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (FileNotFoundError("x"), NotFound),
        (IsADirectoryError("x"), NotFound),
        (PermissionError("x"), AccessDenied),
        (ConnectionResetError("x"), StorageUnavailable),
        (TimeoutError("x"), StorageUnavailable),
        (RuntimeError("a backend's own error"), StorageUnavailable),
    ],
)
def test_what_a_filesystem_raises_is_translated(exc: BaseException, kind: type[Exception]) -> None:
    error = fs_error(exc, "ctx")
    assert type(error) is kind and str(error).startswith("ctx")


# -- streamed downloads ----------------------------------------------------------------------


def test_get_to_file_streams_verifies_and_refuses(filesystem: Filesystem, store: Store, tmp_path: Path) -> None:
    data = bytes(range(251)) * 20_000  # ~5 MiB: several chunks of the file object
    filesystem.put("run/keyframe.bin", data)
    out = tmp_path / "out"
    out.mkdir()
    digest = hashlib.sha256(data).hexdigest()
    got = store.get_to_file("run/keyframe.bin", out / "k", sha256=digest, max_bytes=len(data))
    assert (got.size, got.sha256) == (len(data), digest)
    assert got.etag == store.get("run/keyframe.bin").etag  # the same ETag a whole read reports
    assert (out / "k").read_bytes() == data
    with pytest.raises(DigestMismatch):
        store.get_to_file("run/keyframe.bin", out / "bad", sha256="0" * 64)
    with pytest.raises(ObjectTooLarge):
        store.get_to_file("run/keyframe.bin", out / "big", max_bytes=len(data) - 1)
    with pytest.raises(NotFound):
        store.get_to_file("run/missing", out / "missing")
    assert sorted(os.listdir(out)) == ["k"]
    with pytest.raises(StoreNotWritable):
        store.put_file_if_absent("run/x", out / "k")
    assert "run/x" not in {i.key for i in store.list("run/")}
