"""A run's bucket served over loopback HTTPS by a real static-file server, as a CDN or a
static site would, and read through fsspec's HTTP filesystem: ``bulletin sync`` (a real
process) and a Subscriber reach the published bits exactly, an idle poll is one
conditional GET answered ``304``, listings come from the directory index, and every write
is refused before a single request."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

from bulletin import Publisher, Subscriber
from bulletin.checkpoint import Checkpoint
from bulletin.errors import (
    AccessDenied,
    DigestMismatch,
    NotFound,
    ObjectTooLarge,
    StorageUnavailable,
    StoreNotWritable,
)
from bulletin.maintenance import collect_garbage
from bulletin.run import Run
from bulletin.storage import HttpStore, LocalStore, Store, open_fsspec, open_store
from bulletin.target import ArrayTarget
from tests.run.helpers import ToyTrainer, assert_bits_equal, publish_versions
from tests.storage.https_static import StaticHttpsServer

RUN = "run"
VERSIONS = 5
Served = list[dict[str, NDArray[np.unsignedinteger]]]


@dataclass(frozen=True)
class Site:
    bucket: Path
    server: StaticHttpsServer
    served: Served


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """Five versions (keyframes at 1 and 4, patches between) published to a local directory,
    then served over HTTPS with ETags and directory indexes."""
    tmp = tmp_path_factory.mktemp("site")
    bucket = tmp / "bucket"
    served = publish_versions(bucket, RUN, VERSIONS, seed=7, keyframe_every=3)
    with StaticHttpsServer(bucket, tmp) as server:
        yield Site(bucket, server, served)


@pytest.fixture
def store(site: Site) -> Iterator[Store]:
    """The site through fsspec's HTTP filesystem, trusting the test certificate."""
    store = open_fsspec(site.server.url, {"ssl": site.server.client_ssl()}, canonical=site.server.url)
    yield store
    store.close()


def _cli(site: Site, *args: str) -> subprocess.CompletedProcess[str]:
    """``bulletin ARGS --store <the site>`` in a process of its own, trusting the certificate
    the way a node with a private CA would (``SSL_CERT_FILE``)."""
    env = {**os.environ, "SSL_CERT_FILE": str(site.server.cert_file)}
    return subprocess.run(
        [sys.executable, "-m", "bulletin", *args, "--store", site.server.url, "--run", RUN],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )


def _dir_bits(path: Path) -> dict[str, NDArray[np.unsignedinteger]]:
    with Checkpoint(path) as ckpt:
        return {name: np.array(ckpt.bits(name)) for name in ckpt.specs}


def test_the_url_opens_a_read_only_http_store(site: Site) -> None:
    store = open_store(site.server.url)
    assert isinstance(store, HttpStore)
    assert store.url == site.server.url
    assert not store.writable
    assert open_store(site.server.url + "/").url == site.server.url
    store.close()


def test_cli_sync_log_and_verify_over_https_are_bit_exact(site: Site, tmp_path: Path) -> None:
    node = tmp_path / "node"
    synced = _cli(site, "sync", "--to", str(node), "--version", "2", "--json")
    assert synced.returncode == 0, synced.stderr
    assert json.loads(synced.stdout)["version"] == 2
    assert_bits_equal(_dir_bits(node / "current"), site.served[1])
    synced = _cli(site, "sync", "--to", str(node), "--json")  # on from 2 (patches and a keyframe)
    assert synced.returncode == 0, synced.stderr
    report = json.loads(synced.stdout)
    assert (report["from_version"], report["version"]) == (2, VERSIONS)
    assert_bits_equal(_dir_bits(node / "current"), site.served[-1])

    log = _cli(site, "log", "--json")
    assert log.returncode == 0, log.stderr
    assert [entry["version"] for entry in json.loads(log.stdout)] == list(range(VERSIONS, 0, -1))
    verify = _cli(site, "verify", "--json")
    assert verify.returncode == 0, verify.stderr
    assert json.loads(verify.stdout)["ok"] and json.loads(verify.stdout)["versions"] == VERSIONS


def test_subscriber_syncs_bit_exact_and_an_idle_poll_is_one_304(site: Site, store: Store) -> None:
    with Subscriber(store, RUN, target=ArrayTarget()) as sub:
        assert sub.sync(3) == 3
        assert_bits_equal(dict(sub.target.arrays), site.served[2])  # type: ignore[attr-defined]
        assert sub.sync() == VERSIONS
        assert_bits_equal(dict(sub.target.arrays), site.served[-1])  # type: ignore[attr-defined]
        assert sub.head_version() == VERSIONS  # learns the head's ETag
        site.server.clear()
        for _ in range(3):
            assert sub.head_version() == VERSIONS
        polls = site.server.requests
    head_path = f"{site.server.prefix}/{RUN}/head.json"
    assert [(r.method, r.path, r.status) for r in polls] == [("GET", head_path, 304)] * 3
    assert all(r.if_none_match for r in polls)


def test_a_changed_head_is_read_again(store: Store) -> None:
    head = store.get(f"{RUN}/head.json")
    assert store.get_if_changed(f"{RUN}/head.json", head.etag) is None
    assert store.get_if_changed(f"{RUN}/head.json", '"another"') == head
    assert store.get_if_changed(f"{RUN}/head.json", None) == head


def test_listings_match_the_local_store(site: Site, store: Store) -> None:
    local = LocalStore(site.bucket)
    for prefix, after in [
        ("", None),
        (f"{RUN}/", None),
        (f"{RUN}/manifests/", None),
        (f"{RUN}/manifests/", f"{RUN}/manifests/{2:020d}.json"),
        (f"{RUN}/manifests/0000000000000000000", None),
        (f"{RUN}/patches/", None),
        (f"{RUN}/nothing/", None),
    ]:
        want = [(i.key, i.size) for i in local.list(prefix, start_after=after)]
        assert [(i.key, i.size) for i in store.list(prefix, start_after=after)] == want, (prefix, after)
    assert not any(".bulletin-" in i.key for i in store.list(""))  # the local store's own files stay hidden


def test_reads_missing_and_bounded(site: Site, store: Store) -> None:
    key = f"{RUN}/manifests/{1:020d}.json"
    size = (site.bucket / key).stat().st_size
    info = store.stat(key)
    assert info.size == size and info.etag and info.last_modified is not None
    assert store.get(key, max_bytes=size).data == (site.bucket / key).read_bytes()
    with pytest.raises(ObjectTooLarge, match=str(size)):  # from Content-Length, refused unread
        store.get(key, max_bytes=size - 1)
    for call in (lambda: store.get(f"{RUN}/missing"), lambda: store.stat(f"{RUN}/missing")):
        with pytest.raises(NotFound):
            call()
    with pytest.raises(NotFound):
        store.get_if_changed(f"{RUN}/missing", '"etag"')
    data = (site.bucket / key).read_bytes()  # ranges, as a rank rebuilding its blocks reads them
    assert store.get_range(key, 3, 40) == data[3:40]
    assert store.get_range(key, size - 5, size + 100) == data[-5:]
    assert store.get_range(key, size, size + 1) == b""
    with pytest.raises(NotFound):
        store.get_range(f"{RUN}/missing", 0, 1)


def test_writes_are_refused_before_any_request(site: Site, store: Store, tmp_path: Path) -> None:
    before = _snapshot(site.bucket)
    site.server.clear()
    for write in (
        lambda: store.put_if_absent(f"{RUN}/x", b"x"),
        lambda: store.put_if_match(f"{RUN}/head.json", b"x", '"etag"'),
        lambda: store.delete(f"{RUN}/head.json"),
        lambda: Publisher(store, RUN),
        lambda: collect_garbage(Run(store, RUN), keep=1),
    ):
        with pytest.raises(StoreNotWritable, match="read-only"):
            write()
    assert site.server.requests == []
    with Publisher(tmp_path / "elsewhere", "scratch") as pub:  # a real checkpoint to offer
        pub.publish(ToyTrainer(seed=9).state)
    checkpoint = next((tmp_path / "elsewhere").rglob("model.safetensors"))
    for args in (("publish", str(checkpoint)), ("gc", "--keep", "1")):
        refused = _cli(site, *args, "--json")
        assert refused.returncode == 2, refused.stderr
        assert json.loads(refused.stdout)["error"]["code"] == "store_not_writable"
    assert site.server.requests == []
    assert _snapshot(site.bucket) == before
    dry = _cli(site, "gc", "--keep", "1", "--dry-run", "--json")  # a plan only reads
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["floor"] == 4
    assert _snapshot(site.bucket) == before


def test_an_untrusted_certificate_is_storage_unavailable(site: Site) -> None:
    store = open_store(site.server.url)  # the default trust store: not the test CA
    with pytest.raises(StorageUnavailable, match="TLS"):
        store.get(f"{RUN}/head.json")
    store.close()


def test_a_server_without_indexes_serves_sync_but_not_listings(site: Site, tmp_path: Path) -> None:
    with StaticHttpsServer(site.bucket, tmp_path, show_index=False) as bare:
        store = open_fsspec(bare.url, {"ssl": bare.client_ssl()})
        with Subscriber(store, RUN, target=ArrayTarget()) as sub:
            assert sub.sync() == VERSIONS
            assert_bits_equal(dict(sub.target.arrays), site.served[-1])  # type: ignore[attr-defined]
        with pytest.raises(AccessDenied, match="listings"):
            list(store.list(f"{RUN}/manifests/"))
        store.close()


def test_an_unreachable_site_is_storage_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = open_store(f"http://127.0.0.1:{port}/bucket")
    for call in (lambda: store.get("k"), lambda: store.stat("k"), lambda: list(store.list(""))):
        with pytest.raises(StorageUnavailable) as info:
            call()
        assert not isinstance(info.value, AccessDenied)
        assert info.value.__cause__ is not None
    store.close()


def test_get_to_file_streams_one_get_and_verifies(site: Site, store: Store, tmp_path: Path) -> None:
    key = next(i.key for i in store.list(f"{RUN}/") if i.size > 1000)
    data = (site.bucket / key).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    site.server.clear()
    got = store.get_to_file(key, tmp_path / "obj", sha256=digest, max_bytes=len(data))
    assert (got.size, got.sha256, got.etag) == (len(data), digest, store.stat(key).etag)
    assert (tmp_path / "obj").read_bytes() == data
    with pytest.raises(DigestMismatch):
        store.get_to_file(key, tmp_path / "bad", sha256="0" * 64)
    with pytest.raises(ObjectTooLarge, match=str(len(data))):  # from Content-Length, before the body
        store.get_to_file(key, tmp_path / "big", max_bytes=len(data) - 1)
    with pytest.raises(NotFound):
        store.get_to_file(f"{RUN}/missing", tmp_path / "missing")
    assert sorted(os.listdir(tmp_path)) == ["obj"]
