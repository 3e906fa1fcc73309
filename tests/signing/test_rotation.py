"""Key rotation (docs/SECURITY.md, "Rotating the trainer's key"), as the procedure runs it.

The trainer signs versions 1-3 with key A, then restarts with key B. Nodes that trust
both accept every version; once A is retired, a node takes only what a B-signed version
vouches for: the versions it reads by number must be B's, the ones below them on a
route are tied to them by the hash chain.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

from bulletin import Publisher, Subscriber
from bulletin.cli import main
from bulletin.errors import UntrustedKey, UntrustedVersion
from bulletin.signing import TrustPolicy
from bulletin.storage import open_store
from bulletin.target import ArrayTarget
from tests.run.helpers import ToyTrainer, assert_bits_equal
from tests.signing.conftest import KeyPair, make_key
from tests.signing.helpers import ReadLog, folder_state

RUN = "run"


def publish_rotating(
    url: str, old: KeyPair, new: KeyPair, *, switch_at: int, versions: int = 6
) -> list[dict[str, NDArray[np.unsignedinteger]]]:
    """Versions 1..switch_at-1 signed by ``old``, the rest by ``new`` (a restarted trainer);
    keyframes at 1 and 4. Returns the bits each version serves."""
    trainer = ToyTrainer(seed=11)
    served = []
    for key, span in ((old, range(1, switch_at)), (new, range(switch_at, versions + 1))):
        with Publisher(url, RUN, keyframe_every=3, signing_key=key.private) as pub:
            for version in span:
                if version > 1:
                    trainer.step()
                pub.publish(trainer.state)
                served.append(trainer.served())
    return served


@pytest.fixture
def keys(tmp_path: Path) -> tuple[KeyPair, KeyPair]:
    return make_key(tmp_path, "key-a"), make_key(tmp_path, "key-b")


def test_nodes_trusting_both_keys_accept_every_version(
    store_url: str, keys: tuple[KeyPair, KeyPair], tmp_path: Path
) -> None:
    a, b = keys
    served = publish_rotating(store_url, a, b, switch_at=4)
    both = TrustPolicy.from_files([a.public, b.public])
    node = Subscriber(store_url, RUN, tmp_path / "node", trust=both)
    assert node.sync(2) == 2  # A's
    assert node.sync() == 6  # from A's version 2 through the rotation to B's 6
    node.close()
    fresh = Subscriber(store_url, RUN, target=ArrayTarget(), trust=TrustPolicy.from_files([a.public, b.public]))
    assert fresh.sync() == 6
    assert isinstance(fresh.target, ArrayTarget)
    assert_bits_equal(dict(fresh.target.arrays), served[5])
    assert fresh.sync(3) == 3


def test_once_the_old_key_is_retired_only_what_the_new_key_vouches_for_is_taken(
    store_url: str, keys: tuple[KeyPair, KeyPair]
) -> None:
    a, b = keys
    served = publish_rotating(store_url, a, b, switch_at=4)
    only_b = TrustPolicy.from_files([b.public])
    fresh = Subscriber(store_url, RUN, target=ArrayTarget(), trust=only_b)
    assert fresh.sync() == 6  # 6, 5 and the keyframe of 4: all B's
    assert isinstance(fresh.target, ArrayTarget)
    assert_bits_equal(dict(fresh.target.arrays), served[5])
    assert fresh.sync(5) == 5
    reads = ReadLog(open_store(store_url))
    old = Subscriber(reads, RUN, target=ArrayTarget(), trust=only_b)
    with pytest.raises(UntrustedKey, match=a.key_id):
        old.sync(2)  # a version only A signed, asked for by number
    assert old.current_version is None and reads.data_reads() == []


def test_a_switch_at_a_patch_version_needs_no_new_keyframe(store_url: str, keys: tuple[KeyPair, KeyPair]) -> None:
    # B signs from version 5 on; the keyframe of 4 is A's. A node trusting only B reaches
    # 6 through it: B's signature of 6 fixes the exact bytes of 5 and of 4 (parent digests).
    a, b = keys
    served = publish_rotating(store_url, a, b, switch_at=5)
    fresh = Subscriber(store_url, RUN, target=ArrayTarget(), trust=TrustPolicy.from_files([b.public]))
    assert fresh.sync() == 6
    assert isinstance(fresh.target, ArrayTarget)
    assert_bits_equal(dict(fresh.target.arrays), served[5])
    with pytest.raises(UntrustedKey):
        fresh.sync(4)  # by number, 4 is A's alone


def test_a_node_left_on_a_retired_keys_version_moves_on_to_the_new_keys_tip(
    store_url: str, keys: tuple[KeyPair, KeyPair], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A node still at A's version 2 when A is retired re-reads that manifest to check the
    # run continues it: compared with the digest it recorded, not trusted anew, so it is not
    # stranded; what it moves to is B's tip (B's signature fixes every version below it).
    a, b = keys
    publish_rotating(store_url, a, b, switch_at=4)
    node = tmp_path / "node"
    with Subscriber(store_url, RUN, node, trust=TrustPolicy.from_files([a.public, b.public])) as sub:
        assert sub.sync(2) == 2
    argv = ["sync", "--store", store_url, "--run", RUN, "--to", str(node), "--trusted-key", str(b.public)]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == 6
    with Subscriber(store_url, RUN, node, trust=TrustPolicy.from_files([b.public])) as sub:
        assert sub.current_version == 6
        assert sub.verify(repair=False).ok
    # The held version's manifest replaced in the bucket by other bytes: compared, refused.
    with Subscriber(store_url, RUN, tmp_path / "other", trust=TrustPolicy.from_files([a.public, b.public])) as sub:
        assert sub.sync(2) == 2
    store = open_store(store_url)
    key = f"{RUN}/manifests/{2:020d}.json"
    forged = json.loads(store.get(key).data)
    forged["metadata"] = {"forged": "yes"}
    store.delete(key)
    store.put_if_absent(key, json.dumps(forged).encode())
    reads = ReadLog(open_store(store_url))
    before = folder_state(tmp_path / "other")
    with Subscriber(reads, RUN, tmp_path / "other", trust=TrustPolicy.from_files([b.public])) as sub:
        with pytest.raises(UntrustedVersion):
            sub.sync()
        assert sub.current_version == 2
    assert reads.data_reads() == [] and folder_state(tmp_path / "other") == before


def test_verify_audits_which_key_signed_each_version(
    store_url: str, keys: tuple[KeyPair, KeyPair], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = keys
    publish_rotating(store_url, a, b, switch_at=4)
    base = ["verify", "--store", store_url, "--run", RUN, "--json"]
    assert main([*base, "--trusted-key", str(a.public), "--trusted-key", str(b.public)]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert main([*base, "--trusted-key", str(b.public)]) == 5
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert [p.split(":")[0] for p in problems] == ["version 1", "version 2", "version 3"]
    assert all("untrusted_key" in p for p in problems)
