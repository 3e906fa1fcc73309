"""Subscribers, a mirror's reads and ``verify`` never write to the store they read.

The origin is a store that refuses every write: the package's ``ReadOnlyStore`` around
a local directory or the memory store, and, for S3, LocalStack behind a loopback HTTP
proxy that answers every ``PUT``/``POST``/``DELETE`` with ``403 AccessDenied`` (as a
read-only bucket policy would). Everything a reader does works, and not one write is
attempted; a writer (publish, gc) against the same store is refused, so the refusal
is real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

import bulletin.mirror
import bulletin.storage
import bulletin.subscriber
from bulletin import Publisher, Subscriber
from bulletin.cli import main
from bulletin.errors import AccessDenied
from bulletin.maintenance import collect_garbage, log, verify
from bulletin.mirror import Mirror
from bulletin.run import Run
from bulletin.storage import Store, open_store
from bulletin.storage.wrapper import ReadOnlyStore
from tests.mirror.helpers import objects
from tests.mirror.read_only_proxy import ReadOnlyProxy
from tests.run.helpers import ToyTrainer, assert_bits_equal

ROOT = Path(__file__).resolve().parents[2]


def _publish(url: str, trainer: ToyTrainer, count: int) -> None:
    with Publisher(url, "run", keyframe_every=3) as pub:
        for _ in range(count):
            trainer.step()
            pub.publish(trainer.state)


@pytest.fixture(params=["local", "memory", "s3"])
def origin(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[str, Callable[[], Store], Callable[[], list[str]]]]:
    """(a writable URL of the origin, a reader's store of it that refuses writes, the
    writes refused so far)."""
    if request.param == "s3":
        s3_url: str = request.getfixturevalue("s3_url")
        endpoint: str = request.getfixturevalue("s3_endpoint")
        with ReadOnlyProxy(endpoint) as proxy:
            read_only = s3_url.replace(endpoint, proxy.endpoint)
            yield s3_url, lambda: open_store(read_only), lambda: list(proxy.refused)
        return
    url = str(tmp_path / "origin") if request.param == "local" else f"memory://{uuid.uuid4().hex}"
    opened: list[ReadOnlyStore] = []

    def reader() -> Store:
        opened.append(ReadOnlyStore(open_store(url)))
        return opened[-1]

    yield url, reader, lambda: [refused for store in opened for refused in store.refused]


def test_every_reader_works_on_a_store_that_refuses_writes(
    origin: tuple[str, Callable[[], Store], Callable[[], list[str]]], tmp_path: Path
) -> None:
    url, reader, refused = origin
    trainer = ToyTrainer(seed=41)
    with Publisher(url, "run", keyframe_every=3) as pub:
        pub.publish(trainer.state)
    _publish(url, trainer, 3)

    sub = Subscriber(reader(), "run", tmp_path / "node")
    assert sub.sync() == 4
    assert sub.verify().ok
    stop = threading.Event()
    seen: list[int] = []

    def follow() -> None:
        for version in sub.follow(interval=0.02, stop=stop):
            seen.append(version)
            stop.set()

    thread = threading.Thread(target=follow)
    thread.start()
    _publish(url, trainer, 1)
    thread.join(timeout=30)
    stop.set()
    assert seen == [5]
    sub.close()
    assert_bits_equal(_arrays(tmp_path / "node"), trainer.served())

    assert verify(Run(reader(), "run")).ok
    assert [e.version for e in log(Run(reader(), "run"))] == [5, 4, 3, 2, 1]
    mirror = str(tmp_path / "mirror")
    assert Mirror(reader(), mirror, "run").sync().versions == [1, 2, 3, 4, 5]
    assert Mirror(reader(), mirror, "run", keep=2).sync().versions == []  # prunes the mirror, not the origin
    assert next(Mirror(reader(), str(tmp_path / "mirror2"), "run").follow(interval=0.01)).to_version == 5
    assert refused() == []

    # The refusal is real: writers are turned away.
    with pytest.raises(AccessDenied):
        Publisher(reader(), "run").publish(trainer.state)
    with pytest.raises(AccessDenied):
        collect_garbage(Run(reader(), "run"), keep=1, grace=timedelta(0))
    assert refused()
    assert objects(open_store(url), "run/manifests/").keys() == {f"run/manifests/{v:020d}.json" for v in range(1, 6)}


def _arrays(node: Path) -> dict:
    from bulletin.checkpoint import Checkpoint

    with Checkpoint(node / "current") as ckpt:
        return {name: ckpt.bits(name).copy() for name in ckpt.specs}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "bulletin", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_commands_that_read_never_write_to_s3(s3_url: str, s3_endpoint: str, tmp_path: Path) -> None:
    trainer = ToyTrainer(seed=42)
    with Publisher(s3_url, "run", keyframe_every=3) as pub:
        pub.publish(trainer.state)
    _publish(s3_url, trainer, 4)  # keyframes 1 and 4: gc --keep 1 has versions to delete
    with ReadOnlyProxy(s3_endpoint) as proxy:
        store = s3_url.replace(s3_endpoint, proxy.endpoint)
        node = str(tmp_path / "node")
        for args in (
            ("sync", "--store", store, "--run", "run", "--to", node),
            ("status", "--store", store, "--run", "run", "--local", node, "--verify"),
            ("log", "--store", store, "--run", "run"),
            ("verify", "--store", store, "--run", "run"),
            ("mirror", "--from", store, "--to", str(tmp_path / "mirror"), "--run", "run", "--json"),
        ):
            done = _cli(*args)
            assert done.returncode == 0, (args, done.stdout, done.stderr)
        assert json.loads(done.stdout)["versions"] == [1, 2, 3, 4, 5]
        assert proxy.refused == [] and proxy.relayed > 0
        denied = _cli("gc", "--store", store, "--run", "run", "--keep", "1", "--grace-minutes", "0")
        assert denied.returncode == 7 and "access_denied" in denied.stderr
        assert proxy.refused and all(r.startswith("DELETE ") for r in proxy.refused)
    assert_bits_equal(_arrays(Path(node)), trainer.served())


def test_the_commands_that_read_never_write_to_a_local_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    origin = str(tmp_path / "origin")
    trainer = ToyTrainer(seed=43)
    with Publisher(origin, "run", keyframe_every=3) as pub:
        pub.publish(trainer.state)
    _publish(origin, trainer, 4)
    real = bulletin.storage.open_store
    opened: list[ReadOnlyStore] = []

    def opening(url: str | os.PathLike[str]) -> Store:  # the origin opens read-only, in this process
        store = real(url)
        if store.url == real(origin).url:
            opened.append(ReadOnlyStore(store))
            return opened[-1]
        return store

    for module in (bulletin.storage, bulletin.subscriber, bulletin.mirror):
        monkeypatch.setattr(module, "open_store", opening)
    node = str(tmp_path / "node")
    for args in (
        ["sync", "--store", origin, "--run", "run", "--to", node],
        ["status", "--store", origin, "--run", "run", "--local", node, "--verify"],
        ["log", "--store", origin, "--run", "run"],
        ["verify", "--store", origin, "--run", "run"],
        ["mirror", "--from", origin, "--to", str(tmp_path / "mirror"), "--run", "run"],
    ):
        assert main(args) == 0, (args, capsys.readouterr())
    assert len(opened) >= 5 and [r for store in opened for r in store.refused] == []
    assert main(["gc", "--store", origin, "--run", "run", "--keep", "1", "--grace-minutes", "0"]) == 7
    assert [r for store in opened for r in store.refused]
    assert_bits_equal(_arrays(Path(node)), trainer.served())


def test_a_read_only_store_passes_reads_and_refuses_writes_before_the_store(tmp_path: Path) -> None:
    inner = open_store(str(tmp_path / "bucket"))
    inner.put_if_absent("a", b"1")
    store = ReadOnlyStore(inner)
    assert store.get("a").data == b"1" and [i.key for i in store.list("")] == ["a"] and store.writable
    etag = inner.stat("a").etag
    assert etag is not None
    for write in (
        lambda: store.put_if_absent("b", b"2"),
        lambda: store.put_if_match("a", b"3", etag),
        lambda: store.delete("a"),
    ):
        with pytest.raises(AccessDenied, match="read-only"):
            write()
    assert store.refused == ("put_if_absent b", "put_if_match a", "delete a")
    assert objects(inner) == {"a": b"1"}
