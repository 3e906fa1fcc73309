"""The documents' models: committed JSON Schemas, strictness, and validation rules."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from schemas.export import DOCUMENTS, SCHEMA_DIR, render
from schemas.head import HeadV1
from schemas.manifest import KeyframeRef, ManifestV1, ObjectRef, PatchRef, TensorEntry, VersionStats


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_committed_schema_matches_model(name: str) -> None:
    committed = (SCHEMA_DIR / name).read_text(encoding="utf-8")
    assert committed == render(DOCUMENTS[name]), (
        f"schemas/json/{name} drifted from its model: run `python -m schemas.export` and review the diff"
    )


def _manifest(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "run": "r",
        "version": 2,
        "parent_version": 1,
        "parent_digest": "a" * 64,
        "created_at": datetime(2026, 12, 1, tzinfo=UTC),
        "writer": "0123abcd",
        "tensors": (TensorEntry(name="w", dtype="BF16", shape=(2, 2), fingerprint="0" * 16),),
        "patch": PatchRef(
            codec="zstd", shards=(ObjectRef(key="patches/x/y.bpatch", size=1, sha256="b" * 64),), changed_elements=1
        ),
        "keyframe": None,
        "stats": VersionStats(total_elements=4, total_bytes=8, patch_bytes=1, keyframe_bytes=0),
    }
    doc.update(overrides)
    return doc


def test_manifest_round_trips_through_json() -> None:
    m = ManifestV1(**_manifest())
    assert ManifestV1.model_validate_json(m.model_dump_json()) == m


def test_manifest_is_frozen() -> None:
    m = ManifestV1(**_manifest())
    with pytest.raises(ValidationError):
        m.version = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"parent_digest": None}, "both set or both null"),
        ({"parent_version": 5}, "version - 1"),
        ({"patch": None}, "patch, a keyframe"),
        ({"version": 1, "parent_version": None, "parent_digest": None}, "patch needs a parent"),
        ({"version": 3, "parent_version": None, "parent_digest": None}, "only version 1"),
    ],
)
def test_manifest_consistency_rules(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ManifestV1(**_manifest(**overrides))


def test_manifest_refuses_unsorted_or_duplicate_tensors() -> None:
    t = TensorEntry(name="w", dtype="BF16", shape=(1,), fingerprint="0" * 16)
    u = TensorEntry(name="a", dtype="BF16", shape=(1,), fingerprint="0" * 16)
    with pytest.raises(ValidationError, match="sorted"):
        ManifestV1(**_manifest(tensors=(t, u)))
    with pytest.raises(ValidationError, match="sorted"):
        ManifestV1(**_manifest(tensors=(t, t)))


@pytest.mark.parametrize("name", ["a/b", "../x", "", "__metadata__", "a\\b", "x\x00"])
def test_tensor_names_that_look_like_paths_are_refused(name: str) -> None:
    with pytest.raises(ValidationError):
        TensorEntry(name=name, dtype="BF16", shape=(1,), fingerprint="0" * 16)


@pytest.mark.parametrize("key", ["../escape", "/abs", "a//b", "a/./b", "a/../b", ".hidden"])
def test_object_keys_cannot_escape_the_run(key: str) -> None:
    with pytest.raises(ValidationError):
        ObjectRef(key=key, size=0, sha256="0" * 64)


def test_unknown_fields_and_versions_are_refused() -> None:
    m = ManifestV1(**_manifest())
    raw = m.model_dump(mode="json")
    with pytest.raises(ValidationError):
        ManifestV1.model_validate({**raw, "surprise": 1})
    with pytest.raises(ValidationError):
        ManifestV1.model_validate({**raw, "spec_version": 2})
    with pytest.raises(ValidationError):
        KeyframeRef.model_validate({"prefix": "k", "files": [], "extra": True})


def test_head_requires_a_digest() -> None:
    with pytest.raises(ValidationError):
        HeadV1(run="r", version=1, manifest_digest="nothex", updated_at=datetime.now(UTC))
