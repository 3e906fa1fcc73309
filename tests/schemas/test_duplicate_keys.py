"""A JSON document with a duplicate key is refused, wherever Bulletin reads one.

Pydantic alone keeps the last of several values, another JSON reader may keep the
first: the same bytes would then mean two different versions (or fingerprints) to two
readers. ``schemas.common.parse_document`` refuses such bytes with ``FormatError``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bulletin import Publisher, Subscriber
from bulletin.errors import FormatError
from bulletin.run import Run
from bulletin.storage import open_store
from bulletin.target import ArrayTarget, LocalDirTarget
from schemas.common import parse_document
from schemas.head import parse_head
from schemas.local_state import JournalV1
from schemas.manifest import parse_manifest
from tests.run.helpers import ToyTrainer


def _published(bucket: Path) -> Run:
    trainer = ToyTrainer(seed=41)
    with Publisher(bucket, "run", keyframe_every=10) as pub:
        pub.publish(trainer.state)
        trainer.step()
        pub.publish(trainer.state)
    return Run(open_store(bucket), "run")


def _rewrite(path: Path, data: bytes) -> None:
    path.chmod(0o644)
    path.write_bytes(data)


def _duplicate(data: bytes, field: str) -> bytes:
    """``data`` with the first ``"field":value`` preceded by another value of it."""
    doc = json.loads(data)
    text = data.decode()
    if field == "version":
        original = f'"version":{doc["version"]}'
        forged = f'"version":{doc["version"] + 1},'
    else:
        fingerprint = doc["tensors"][0]["fingerprint"]
        original = f'"fingerprint":"{fingerprint}"'
        forged = f'"fingerprint":"{"0" * 16 if fingerprint != "0" * 16 else "1" * 16}",'
    assert original in text
    forged_text = text.replace(original, forged + original, 1)
    assert json.loads(forged_text) == doc  # what a last-value-wins reader sees: the original
    return forged_text.encode()


@pytest.mark.parametrize("field", ["version", "fingerprint"])
def test_a_manifest_with_a_duplicate_key_is_refused(tmp_path: Path, field: str) -> None:
    bucket = tmp_path / "bucket"
    run = _published(bucket)
    path = bucket / "run" / "manifests" / f"{2:020d}.json"
    _rewrite(path, _duplicate(path.read_bytes(), field))
    with pytest.raises(FormatError, match=f"duplicate key '{field}'"):
        run.read_manifest(2)
    with pytest.raises(FormatError, match="duplicate key"):
        Subscriber(bucket, "run", target=ArrayTarget()).sync(2)
    with pytest.raises(FormatError, match="duplicate key"):
        parse_manifest(path.read_bytes())


def test_a_head_with_a_duplicate_key_is_refused(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    _published(bucket)
    path = bucket / "run" / "head.json"
    _rewrite(path, _duplicate(path.read_bytes(), "version"))
    with pytest.raises(FormatError, match="duplicate key 'version'"):
        parse_head(path.read_bytes())
    with pytest.raises(FormatError, match="duplicate key"):
        Subscriber(bucket, "run", target=ArrayTarget()).sync()


def test_local_state_and_journal_with_a_duplicate_key_are_refused(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    _published(bucket)
    node = tmp_path / "node"
    with Subscriber(bucket, "run", node) as sub:
        sub.sync()
    state = node / LocalDirTarget.STATE
    _rewrite(state, _duplicate(state.read_bytes(), "version"))
    with pytest.raises(FormatError, match="duplicate key 'version'"):
        LocalDirTarget(node)

    journal = JournalV1(model_dir="model-x", from_version=1).model_dump_json()
    again = journal.replace('"from_version":1', '"from_version":2,"from_version":1')
    assert again != journal
    other = tmp_path / "other"
    other.mkdir()
    (other / LocalDirTarget.JOURNAL).write_text(again)
    with pytest.raises(FormatError, match=r"undo journal.*duplicate key 'from_version'"):
        LocalDirTarget(other)


def test_duplicates_are_found_at_any_depth_and_named() -> None:
    doc = '{"format":"bulletin.journal","spec_version":1,"model_dir":"m","from_version":1,"x":{"a":1,"a":2}}'
    with pytest.raises(FormatError, match=r"^journal\.json: duplicate key 'a'$"):
        parse_document(JournalV1, doc.encode(), source="journal.json")
    nested = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(FormatError, match="nested too deeply"):
        parse_document(JournalV1, nested, source="deep.json")
