"""The writer's side of signing: what a signing publisher writes, in which order, and what
``gc``, ``log``, ``verify``, ``status``, ``keygen`` and ``serve`` do with it."""

from __future__ import annotations

import json
import stat
import threading
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from bulletin import Publisher, Subscriber
from bulletin.cli import main
from bulletin.errors import ConfigError, Conflict, InvalidInput, StorageUnavailable, Unsigned
from bulletin.keyspace import HEAD, manifest_key, signature_key
from bulletin.maintenance import collect_garbage, log
from bulletin.run import Run
from bulletin.sidecar import SidecarSettings, build_sidecar
from bulletin.signing import TrustPolicy
from bulletin.storage import Store, Updated, WriteResult, open_store
from bulletin.storage.wrapper import CountingStore, WrapperStore
from bulletin.target import ArrayTarget
from schemas.head import HeadV1, HeadV2, parse_head
from tests.run.helpers import ToyTrainer
from tests.signing.conftest import KeyPair

RUN = "run"


class WriteLog(WrapperStore):
    """Remembers the keys of create-only writes, in order."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self.created: list[str] = []

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        result = super().put_if_absent(key, data)
        with self._lock:
            self.created.append(key)
        return result


def publish(url: str | Store, versions: int, *, key: KeyPair | None, keyframe_every: int = 3) -> None:
    trainer = ToyTrainer(seed=3)
    with Publisher(url, RUN, keyframe_every=keyframe_every, signing_key=key.signer() if key else None) as pub:
        for i in range(versions):
            if i:
                trainer.step()
            pub.publish(trainer.state)


def test_each_signature_is_created_before_its_manifest_and_every_head_is_signed(
    store_url: str, trainer_key: KeyPair, trust: TrustPolicy
) -> None:
    writes = WriteLog(open_store(store_url))
    publish(writes, 4, key=trainer_key)
    run = Run(open_store(store_url), RUN, trust=trust)
    for version in range(1, 5):
        stored = run.read_manifest(version)  # verified under the policy
        signature_at = writes.created.index(run.key(signature_key(stored.digest)))
        assert signature_at < writes.created.index(run.key(manifest_key(version)))
    head = run.read_head()
    assert head is not None and isinstance(head.head, HeadV2) and head.head.version == 4
    assert head.head.signature.key_id == trainer_key.key_id


def test_an_unsigned_publisher_writes_what_older_readers_read(store_url: str) -> None:
    publish(store_url, 2, key=None)
    store = open_store(store_url)
    assert isinstance(parse_head(store.get(f"{RUN}/{HEAD}").data), HeadV1)
    assert list(store.list(f"{RUN}/signatures/")) == []


def test_a_commit_made_again_writes_the_same_signature(tmp_path: Path, trainer_key: KeyPair) -> None:
    # An ambiguous commit is settled by committing the same manifest again: the signature
    # (Ed25519 is deterministic) finds its own bytes, the manifest its own.
    url = str(tmp_path / "bucket")
    publish(url, 1, key=trainer_key)
    run = Run(open_store(url), RUN, signer=trainer_key.signer())
    stored = run.read_manifest(1)
    assert run.commit(stored.manifest).digest == stored.digest
    key = run.key(signature_key(stored.digest))  # now someone else's bytes sit there
    run.store.delete(key)
    assert isinstance(run.store.put_if_absent(key, b'{"not": "this signature"}'), Updated)
    with pytest.raises(Conflict, match="other content"):
        run.commit(stored.manifest)


def test_gc_removes_the_signatures_of_what_it_removes_and_orphans(store_url: str, trainer_key: KeyPair) -> None:
    publish(store_url, 7, key=trainer_key)  # keyframes at 1, 4, 7
    store = open_store(store_url)
    run = Run(store, RUN)
    digests = {v: run.read_manifest(v).digest for v in range(1, 8)}
    orphan = run.key(signature_key("ab" * 32))  # a losing commit's signature
    assert isinstance(store.put_if_absent(orphan, b"{}"), Updated)
    report = collect_garbage(run, keep=2, grace=timedelta(hours=1))  # keeps 6..7 and the keyframe of 4
    removed = {run.key(signature_key(digests[v])) for v in (1, 2, 3)}
    assert removed <= set(report.deleted_objects) and orphan not in report.deleted_objects
    left = {info.key for info in store.list(f"{RUN}/signatures/")}
    assert left == {run.key(signature_key(digests[v])) for v in (4, 5, 6, 7)} | {orphan}
    collect_garbage(run, keep=2, grace=timedelta(0))  # the orphan is old enough now
    assert {info.key for info in store.list(f"{RUN}/signatures/")} == left - {orphan}
    trust = TrustPolicy.from_files([trainer_key.public])
    assert Subscriber(store_url, RUN, trust=trust).sync() == 7  # what is kept still verifies


def test_log_and_status_under_a_trust_policy(
    tmp_path: Path, trainer_key: KeyPair, trust: TrustPolicy, capsys: pytest.CaptureFixture[str]
) -> None:
    url = str(tmp_path / "bucket")
    publish(url, 3, key=trainer_key)
    assert [e.version for e in log(Run(open_store(url), RUN, trust=trust))] == [3, 2, 1]
    flags = ["--store", url, "--run", RUN, "--trusted-key", str(trainer_key.public), "--json"]
    assert main(["status", *flags]) == 0
    assert json.loads(capsys.readouterr().out)["newest_version"] == 3
    publish(url, 1, key=None)  # an unsigned writer continues the run
    assert main(["log", *flags]) == 13
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "unsigned"
    assert main(["status", *flags]) == 13
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "unsigned"
    assert main(["log", *flags[:4], "--json"]) == 0  # without the policy, everything shows
    capsys.readouterr()


def test_keygen_writes_a_private_key_only_its_owner_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    private = tmp_path / "trainer.key"
    assert main(["keygen", str(private), "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert made["public_key"] == str(tmp_path / "trainer.key.pub")
    assert TrustPolicy.from_files([made["public_key"]]).key_ids == {made["key_id"]}
    again = private.read_bytes()
    assert main(["keygen", str(private)]) == 2  # never over a key
    assert "exists" in capsys.readouterr().err and private.read_bytes() == again


def test_publish_signs_with_a_key_file_or_the_environment(
    tmp_path: Path, trainer_key: KeyPair, trust: TrustPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.numpy import save_file

    url = str(tmp_path / "bucket")
    checkpoint = tmp_path / "step.safetensors"
    save_file({"w": np.arange(16, dtype=np.float32)}, str(checkpoint))
    where = ["publish", str(checkpoint), "--store", url, "--run", RUN]
    assert main([*where, "--signing-key", str(trainer_key.private)]) == 0
    monkeypatch.setenv("BULLETIN_SIGNING_KEY", trainer_key.private.read_text())
    save_file({"w": np.arange(16, dtype=np.float32) + 1}, str(checkpoint))
    assert main(where) == 0
    assert Subscriber(url, RUN, trust=trust).sync() == 2


def test_configuration_mistakes_are_config_errors(
    tmp_path: Path, trainer_key: KeyPair, capsys: pytest.CaptureFixture[str]
) -> None:
    url = str(tmp_path / "bucket")
    publish(url, 1, key=trainer_key)
    base = ["sync", "--store", url, "--run", RUN, "--to", str(tmp_path / "node")]
    assert main([*base, "--max-head-age", "60"]) == 2  # an age without a key cannot be checked
    assert "needs --trusted-key" in capsys.readouterr().err
    assert main([*base, "--trusted-key", str(trainer_key.private)]) == 2  # a private key as trust
    assert "private key" in capsys.readouterr().err
    assert not (tmp_path / "node").exists()
    with pytest.raises(ConfigError, match="at least one"):
        TrustPolicy([])


def test_serve_wires_the_trust_policy_into_its_subscriber(tmp_path: Path, trainer_key: KeyPair) -> None:
    url = str(tmp_path / "bucket")
    publish(url, 1, key=None)
    settings = SidecarSettings(
        store=url,
        run=RUN,
        engine="local",
        upstream="http://127.0.0.1:9",
        local_dir=tmp_path / "node",
        trusted_keys=(trainer_key.public,),
        max_head_age=60.0,
    )
    stack = build_sidecar(settings)
    try:
        subscriber = stack.sidecar.subscriber
        trust = subscriber.source.trust
        assert trust is not None and trust.key_ids == {trainer_key.key_id}
        assert trust.max_head_age == timedelta(seconds=60)
        with pytest.raises(Unsigned):
            subscriber.sync()
        assert subscriber.current_version is None
    finally:
        stack.sidecar.subscriber.close()
    assert not list((tmp_path / "node").glob("model-*"))


def test_a_quiet_trainer_refreshes_its_head_and_never_anyone_elses(tmp_path: Path, trainer_key: KeyPair) -> None:
    url = str(tmp_path / "bucket")
    trainer = ToyTrainer(seed=5)
    store = open_store(url)
    with Publisher(url, RUN, signing_key=trainer_key.signer()) as pub:
        pub.publish(trainer.state)
        first = parse_head(store.get(f"{RUN}/{HEAD}").data)
        assert pub.refresh_head()
        again = parse_head(store.get(f"{RUN}/{HEAD}").data)
        assert isinstance(again, HeadV2) and again.version == first.version == 1
        assert again.updated_at > first.updated_at
        TrustPolicy.from_files([trainer_key.public]).verify_head(RUN, again, source="head")
        publish(url, 1, key=None)  # another writer moved the head on: not this trainer's to sign
        taken = store.get(f"{RUN}/{HEAD}").data
        assert not pub.refresh_head()
        assert store.get(f"{RUN}/{HEAD}").data == taken
    with pytest.raises(InvalidInput, match="signing writer"):
        Run(store, RUN).refresh_head(Run(store, RUN).read_manifest(1))


class LostSignatureResponse(WrapperStore):
    """Lets the next signature's create-only PUT land, then loses its response once armed."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.armed = False

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        fire, self.armed = self.armed and "/signatures/" in key, self.armed and "/signatures/" not in key
        result = super().put_if_absent(key, data)
        if fire:
            raise StorageUnavailable(f"{key}: connection reset by peer (injected)")
        return result


@pytest.mark.parametrize("lost", ["manifest", "signature"])
def test_a_signed_commit_in_doubt_is_settled_with_the_same_signature(
    store_url: str, trainer_key: KeyPair, trust: TrustPolicy, lost: str
) -> None:
    from tests.run.test_ambiguous_commit import LostCommitResponse

    store: LostCommitResponse | LostSignatureResponse = (
        LostCommitResponse(open_store(store_url))
        if lost == "manifest"
        else LostSignatureResponse(open_store(store_url))
    )
    trainer = ToyTrainer(seed=21)
    with Publisher(store, RUN, keyframe_every=4, signing_key=trainer_key.signer()) as pub:
        pub.publish(trainer.state)
        trainer.step()
        if isinstance(store, LostCommitResponse):
            store.arm(reads=1)  # the read-back fails too: the outcome stays unknown
        else:
            store.armed = True
        with pytest.raises(StorageUnavailable):
            pub.publish(trainer.state)
        trainer.step()
        assert pub.publish(trainer.state) == 3  # settles 2 first: committed, with its one signature
    run = Run(open_store(store_url), RUN, trust=trust)
    assert [run.read_manifest(v).version for v in (1, 2, 3)] == [1, 2, 3]
    assert len(list(run.objects("signatures/"))) == 3
    assert Subscriber(store_url, RUN, trust=trust).sync() == 3


def test_a_following_node_pays_one_small_read_per_version_for_signatures(tmp_path: Path, trainer_key: KeyPair) -> None:
    # What FORMAT.md 11.5 tells implementers: the head's signature rides inside the head,
    # and only the manifest read by number (the new version) has its own to fetch.
    costs = {}
    for signed in (False, True):
        url = str(tmp_path / f"bucket-{signed}")
        trainer = ToyTrainer(seed=8)
        with Publisher(url, RUN, keyframe_every=10, signing_key=trainer_key.signer() if signed else None) as pub:
            pub.publish(trainer.state)
            reads = CountingStore(open_store(url))
            trust = TrustPolicy.from_files([trainer_key.public]) if signed else None
            node = Subscriber(reads, RUN, target=ArrayTarget(), trust=trust)
            assert node.sync() == 1
            trainer.step()
            pub.publish(trainer.state)
            reads.reset()
            assert node.sync() == 2
            costs[signed] = reads.reset()
    assert costs[True].requests == costs[False].requests + 1
    assert costs[True].down - costs[False].down < 1024
