"""Documents with model files stay readable (committed golden files; docs/FORMAT.md 5.1, 9).

``tests/golden/documents/v3`` holds the manifests of a real publish with model files
(spec_version 3: a keyframe, a context-coded patch whose files did not change, a zstd
patch from a resumed publisher that adds a file) and the ``state.json`` (spec_version 2)
of a node synced to the last. They are never regenerated: a reader that stops accepting
them, or a writer that would serialise the same document differently, fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bulletin.errors import FormatError, UnsupportedFormatVersion
from bulletin.run import sha256_hex
from schemas.local_state import LocalStateV2, local_state_files, parse_local_state
from schemas.manifest import ManifestV3, PatchRefV2, manifest_files, parse_manifest

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "documents" / "v3"


def test_v3_manifests_chain_and_round_trip_byte_for_byte() -> None:
    raw = [(GOLDEN / f"manifest-{v}.json").read_bytes() for v in (1, 2, 3)]
    first, second, third = manifests = [parse_manifest(data) for data in raw]
    assert all(type(m) is ManifestV3 and m.spec_version == 3 for m in manifests)
    assert first.keyframe is not None and first.patch is None
    assert isinstance(second.patch, PatchRefV2) and (second.patch.codec, second.patch.context) == ("context", "base")
    assert isinstance(third.patch, PatchRefV2) and (third.patch.codec, third.patch.context) == ("zstd", None)
    assert [m.parent_digest for m in manifests[1:]] == [sha256_hex(raw[0]), sha256_hex(raw[1])]
    # Unchanged files name the objects the first version uploaded; a new one its own.
    assert manifest_files(second) == manifest_files(first)
    assert [f.path for f in manifest_files(third)] == ["chat_template.jinja", "config.json", "tokenizer.json"]
    assert manifest_files(third)[0].key.startswith("files/00000000000000000003/")
    assert manifest_files(third)[1:] == manifest_files(first)
    for manifest, data in zip(manifests, raw, strict=True):
        assert manifest.model_dump_json().encode() == data


def test_v2_local_state_lists_the_files_of_its_version() -> None:
    data = (GOLDEN / "local-state.json").read_bytes()
    state = parse_local_state(data, source="golden")
    assert type(state) is LocalStateV2 and state.version == 3
    third = parse_manifest((GOLDEN / "manifest-3.json").read_bytes())
    assert local_state_files(state) == {f.path: f.sha256 for f in manifest_files(third)}
    assert state.manifest_digest == sha256_hex((GOLDEN / "manifest-3.json").read_bytes())
    assert state.model_dump_json().encode() == data
    with pytest.raises(UnsupportedFormatVersion, match="knows 1, 2, 3"):
        parse_local_state(data.replace(b'"spec_version":2', b'"spec_version":4'), source="golden")
    with pytest.raises(FormatError):  # a version 1 state has no files
        parse_local_state(data.replace(b'"spec_version":2', b'"spec_version":1'), source="golden")


def test_a_v3_manifest_needs_its_files_and_a_v2_one_refuses_them() -> None:
    data = (GOLDEN / "manifest-1.json").read_bytes()
    with pytest.raises(FormatError):
        parse_manifest(data.replace(b'"spec_version":3', b'"spec_version":2'))
    with pytest.raises(UnsupportedFormatVersion, match="knows 1, 2, 3"):
        parse_manifest(data.replace(b'"spec_version":3', b'"spec_version":4'))
