"""Every attack on a signed run is refused: a typed error, no shard read, nothing changed.

Each test builds a real run (a local directory and a LocalStack bucket), signed by the
trainer's key, with a node at version 2 whose trust policy has already seen the head of
version 5. The attacker then writes the bucket as anyone with write access can (objects
replaced, deleted, copied, forged with its own key) and the node syncs: the library's
Subscriber, through a store that logs every key read, and the CLI (``bulletin sync
--trusted-key``), which must exit 13. Neither may read a patch shard or keyframe file,
nor change the replica folder.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bulletin import Publisher, Subscriber
from bulletin.cli import main
from bulletin.errors import (
    BadSignature,
    FormatError,
    HeadRolledBack,
    NotFound,
    StaleHead,
    Unsigned,
    UntrustedKey,
    UntrustedVersion,
)
from bulletin.keyspace import HEAD, manifest_key, signature_key
from bulletin.run import sha256_hex
from bulletin.signing import TrustPolicy
from bulletin.storage import Store, Updated, open_store
from schemas.head import HeadV2, parse_head
from schemas.signature import SignatureV1, parse_signature
from tests.run.helpers import ToyTrainer
from tests.signing.conftest import KeyPair
from tests.signing.helpers import ReadLog, folder_state

RUN = "run"
HEAD_KEY = f"{RUN}/{HEAD}"


@dataclass
class Scene:
    """A signed run of five versions, a node holding version 2, and what an attacker saw."""

    url: str
    store: Store
    trainer: ToyTrainer
    node: Path
    trainer_key: KeyPair
    attacker_key: KeyPair
    policy: TrustPolicy
    heads: dict[int, bytes]
    """The head's bytes as they were after each version (what an eavesdropper keeps)."""

    def manifest(self, version: int) -> bytes:
        return self.store.get(f"{RUN}/{manifest_key(version)}").data

    def digest(self, version: int) -> str:
        return sha256_hex(self.manifest(version))

    def signature(self, version: int) -> bytes:
        return self.store.get(f"{RUN}/{signature_key(self.digest(version))}").data

    def put(self, key: str, data: bytes) -> None:
        """Write ``key`` as a bucket writer can: replacing whatever is there."""
        with contextlib.suppress(NotFound):  # a store may or may not report a missing key
            self.store.delete(key)
        assert isinstance(self.store.put_if_absent(key, data), Updated)

    def publish(self, *, signing_key: KeyPair | None) -> None:
        """One more version, by another writer (unsigned, or signed by ``signing_key``)."""
        self.trainer.step()
        with Publisher(
            self.url, RUN, keyframe_every=3, signing_key=signing_key.private if signing_key else None
        ) as pub:
            pub.publish(self.trainer.state)


@pytest.fixture
def scene(store_url: str, tmp_path: Path, trainer_key: KeyPair, attacker_key: KeyPair) -> Scene:
    trainer = ToyTrainer(seed=7)
    store = open_store(store_url)
    heads: dict[int, bytes] = {}
    with Publisher(store_url, RUN, keyframe_every=3, signing_key=trainer_key.signer()) as pub:
        for version in range(1, 6):
            if version > 1:
                trainer.step()
            pub.publish(trainer.state)
            heads[version] = store.get(HEAD_KEY).data
    policy = TrustPolicy.from_files([trainer_key.public])
    node = tmp_path / "node"
    with Subscriber(store_url, RUN, node, trust=policy) as sub:
        assert sub.sync(2) == 2
        assert sub.head_version() == 5  # the policy has now seen the head of version 5
    assert policy.newest_head(RUN) == 5
    return Scene(store_url, store, trainer, node, trainer_key, attacker_key, policy, heads)


# -- the attacks: each changes the bucket and returns the error a node must raise ------------------


def unsigned_version_on_top(s: Scene) -> type[UntrustedVersion]:
    s.publish(signing_key=None)  # manifest 6 without a signature, and an unsigned head
    return Unsigned


def unsigned_manifest_past_the_head(s: Scene) -> type[UntrustedVersion]:
    s.publish(signing_key=None)
    s.put(HEAD_KEY, s.heads[5])  # the signed head stays; readers find 6 by probing past it
    return Unsigned


def version_signed_by_an_untrusted_key(s: Scene) -> type[UntrustedVersion]:
    s.publish(signing_key=s.attacker_key)
    return UntrustedKey


def manifest_signed_by_an_untrusted_key_past_the_head(s: Scene) -> type[UntrustedVersion]:
    s.publish(signing_key=s.attacker_key)
    s.put(HEAD_KEY, s.heads[5])
    return UntrustedKey


def signature_copied_from_another_version(s: Scene) -> type[UntrustedVersion]:
    s.publish(signing_key=None)
    s.put(HEAD_KEY, s.heads[5])
    s.put(f"{RUN}/{signature_key(s.digest(6))}", s.signature(5))
    return BadSignature


def signature_copied_and_relabelled(s: Scene) -> type[UntrustedVersion]:
    s.publish(signing_key=None)
    s.put(HEAD_KEY, s.heads[5])
    copied = parse_signature(s.signature(5)).model_copy(update={"manifest_digest": s.digest(6)})
    s.put(f"{RUN}/{signature_key(s.digest(6))}", copied.model_dump_json().encode())
    return BadSignature


def _flip_value(document: bytes, field: bytes) -> bytes:
    """``document`` with one bit of the first hex digit after ``field`` flipped."""
    at = document.index(field) + len(field)
    digit = document[at : at + 1]
    flipped = b"%x" % (int(digit, 16) ^ 1)
    return document[:at] + flipped + document[at + 1 :]


def bit_flipped_manifest_signature(s: Scene) -> type[UntrustedVersion]:
    s.put(f"{RUN}/{signature_key(s.digest(5))}", _flip_value(s.signature(5), b'"value":"'))
    return BadSignature


def bit_flipped_head_signature(s: Scene) -> type[UntrustedVersion]:
    s.put(HEAD_KEY, _flip_value(s.heads[5], b'"value":"'))
    return BadSignature


def signed_head_with_a_field_changed(s: Scene) -> type[UntrustedVersion]:
    head = parse_head(s.heads[5])
    assert isinstance(head, HeadV2)
    later = head.model_copy(update={"updated_at": head.updated_at + timedelta(seconds=1)})
    s.put(HEAD_KEY, later.model_dump_json().encode())
    return BadSignature


def _rewritten_manifest(s: Scene, version: int) -> bytes:
    document = json.loads(s.manifest(version))
    document["metadata"] = {"note": "rewritten by an attacker"}
    return json.dumps(document).encode()


def manifest_replaced_keeping_its_signature(s: Scene) -> type[UntrustedVersion]:
    s.put(f"{RUN}/{manifest_key(5)}", _rewritten_manifest(s, 5))  # signatures/<old digest> stays
    return Unsigned


def manifest_replaced_and_its_signature_moved(s: Scene) -> type[UntrustedVersion]:
    signature = s.signature(5)
    forged = _rewritten_manifest(s, 5)
    s.put(f"{RUN}/{manifest_key(5)}", forged)
    s.put(f"{RUN}/{signature_key(sha256_hex(forged))}", signature)
    return BadSignature


def head_signature_replayed_as_a_manifest_signature(s: Scene) -> type[UntrustedVersion]:
    s.publish(signing_key=None)
    s.put(HEAD_KEY, s.heads[5])
    head = parse_head(s.heads[5])
    assert isinstance(head, HeadV2)
    replayed = SignatureV1(manifest_digest=s.digest(6), signature=head.signature)
    s.put(f"{RUN}/{signature_key(s.digest(6))}", replayed.model_dump_json().encode())
    return BadSignature


def manifest_signature_replayed_as_a_head_signature(s: Scene) -> type[UntrustedVersion]:
    head = parse_head(s.heads[5])
    assert isinstance(head, HeadV2)
    replayed = head.model_copy(update={"signature": parse_signature(s.signature(5)).signature})
    s.put(HEAD_KEY, replayed.model_dump_json().encode())
    return BadSignature


def head_signed_for_another_run(s: Scene) -> type[UntrustedVersion]:
    with Publisher(s.url, "other", signing_key=s.trainer_key.private) as pub:
        for _ in range(6):
            s.trainer.step()
            pub.publish(s.trainer.state)
    s.put(HEAD_KEY, s.store.get(f"other/{HEAD}").data)  # signed by the trusted key, for run "other"
    return BadSignature


ATTACKS: dict[str, Callable[[Scene], type[UntrustedVersion]]] = {
    attack.__name__: attack
    for attack in (
        unsigned_version_on_top,
        unsigned_manifest_past_the_head,
        version_signed_by_an_untrusted_key,
        manifest_signed_by_an_untrusted_key_past_the_head,
        signature_copied_from_another_version,
        signature_copied_and_relabelled,
        bit_flipped_manifest_signature,
        bit_flipped_head_signature,
        signed_head_with_a_field_changed,
        manifest_replaced_keeping_its_signature,
        manifest_replaced_and_its_signature_moved,
        head_signature_replayed_as_a_manifest_signature,
        manifest_signature_replayed_as_a_head_signature,
        head_signed_for_another_run,
    )
}


def assert_library_refuses(s: Scene, expected: type[UntrustedVersion], policy: TrustPolicy) -> None:
    before = folder_state(s.node)
    reads = ReadLog(open_store(s.url))
    with Subscriber(reads, RUN, s.node, trust=policy) as sub:
        held = sub.held
        with pytest.raises(expected) as info:
            sub.sync()
        assert type(info.value) is expected, info.value
        assert sub.held == held and sub.current_version == 2
    assert reads.data_reads() == [], "a shard or keyframe file was read"
    assert folder_state(s.node) == before


def assert_cli_refuses(
    s: Scene, expected: type[UntrustedVersion], capsys: pytest.CaptureFixture[str], *extra: str
) -> None:
    before = folder_state(s.node)
    argv = ["sync", "--store", s.url, "--run", RUN, "--to", str(s.node), "--trusted-key", str(s.trainer_key.public)]
    code = main([*argv, *extra, "--json"])
    out, _ = capsys.readouterr()
    assert code == 13, out
    assert json.loads(out)["error"]["code"] == expected.code
    assert folder_state(s.node) == before


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_is_refused(name: str, scene: Scene, capsys: pytest.CaptureFixture[str]) -> None:
    expected = ATTACKS[name](scene)
    assert_library_refuses(scene, expected, scene.policy)
    assert_cli_refuses(scene, expected, capsys)


def test_a_replayed_older_head_is_refused_by_what_the_node_has_seen(scene: Scene) -> None:
    # An attacker serves the head of version 3 (validly signed, captured earlier) and hides
    # versions 4 and 5: the node (at 2) would go to 3 and stay there, were it not for the
    # policy's memory of the head of 5.
    for version in (4, 5):
        scene.store.delete(f"{RUN}/{signature_key(scene.digest(version))}")
        scene.store.delete(f"{RUN}/{manifest_key(version)}")
    scene.put(HEAD_KEY, scene.heads[3])
    assert_library_refuses(scene, HeadRolledBack, scene.policy)
    # A node without that memory (a restart) takes version 3, a real signed version: what
    # withholding newer versions can do. The staleness bound is what limits it (below).
    fresh = TrustPolicy.from_files([scene.trainer_key.public])
    with Subscriber(scene.url, RUN, scene.node, trust=fresh) as sub:
        assert sub.sync() == 3


def test_a_frozen_head_older_than_the_bound_is_refused(scene: Scene, capsys: pytest.CaptureFixture[str]) -> None:
    # The trainer's own head of version 5, as it was two hours ago (kept by an attacker that
    # has withheld every head since): signed, and too old.
    old = scene.trainer_key.signer().sign_head(RUN, 5, scene.digest(5), datetime.now(UTC) - timedelta(hours=2))
    scene.put(HEAD_KEY, old.model_dump_json().encode())
    bounded = TrustPolicy.from_files([scene.trainer_key.public], max_head_age=3600)
    assert_library_refuses(scene, StaleHead, bounded)
    assert_cli_refuses(scene, StaleHead, capsys, "--max-head-age", "3600")
    # Within the bound the same head is fine.
    with Subscriber(scene.url, RUN, scene.node, trust=TrustPolicy.from_files([scene.trainer_key.public])) as sub:
        assert sub.sync() == 5


def test_an_untouched_signed_run_syncs(scene: Scene, capsys: pytest.CaptureFixture[str]) -> None:
    # The control: the scene itself is accepted (so the refusals above are the attacks').
    argv = ["sync", "--store", scene.url, "--run", RUN, "--to", str(scene.node)]
    code = main([*argv, "--trusted-key", str(scene.trainer_key.public), "--max-head-age", "3600", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0, out
    assert json.loads(out)["version"] == 5


def test_without_a_trust_policy_an_unsigned_version_is_taken(scene: Scene) -> None:
    # Why the policy matters: without one, the first attack succeeds.
    unsigned_version_on_top(scene)
    with Subscriber(scene.url, RUN, scene.node) as sub:
        assert sub.sync() == 6


def test_a_signed_manifest_moved_to_another_version_is_refused_by_what_it_says(
    scene: Scene, capsys: pytest.CaptureFixture[str]
) -> None:
    # The signature signs the manifest's bytes, which name their run and version: version
    # 3's manifest (and its signature, found by digest) put in place of 5 is still 3's.
    scene.put(f"{RUN}/{manifest_key(5)}", scene.manifest(3))
    before = folder_state(scene.node)
    reads = ReadLog(open_store(scene.url))
    with Subscriber(reads, RUN, scene.node, trust=scene.policy) as sub:
        with pytest.raises(FormatError, match="holds run version 3"):
            sub.sync()
        assert sub.current_version == 2
    assert reads.data_reads() == [] and folder_state(scene.node) == before
    argv = ["sync", "--store", scene.url, "--run", RUN, "--to", str(scene.node)]
    assert main([*argv, "--trusted-key", str(scene.trainer_key.public), "--json"]) == 5
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "format_error"
