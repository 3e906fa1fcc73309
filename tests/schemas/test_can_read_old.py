"""Documents written by every format version stay readable (committed golden files).

``tests/golden/documents/v1`` holds manifests (a keyframe, a patch, a keyframe with a
patch) and a head written by a real publish with spec_version 1, and a rollout node's
``state.json`` as written before it recorded the manifest digest (``local-state.json``);
``tests/golden/documents/signed`` a signed head (spec_version 2) and the detached signature of
``v1/manifest-3.json``, by the golden test key; ``tests/golden/documents/v2`` a keyframe
manifest and its child's, spec_version 2, whose patch is context coded. They are never
regenerated: a reader that stops accepting them, or a writer that would serialise the
same document differently, fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bulletin.errors import FormatError, UnsupportedFormatVersion
from bulletin.run import sha256_hex
from schemas.common import parse_document
from schemas.head import parse_head
from schemas.local_state import LocalStateV1
from schemas.manifest import parse_manifest

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "documents"


def test_v1_manifests_chain_and_round_trip_byte_for_byte() -> None:
    raw = [(GOLDEN / "v1" / f"manifest-{v}.json").read_bytes() for v in (1, 2, 3)]
    manifests = [parse_manifest(data) for data in raw]
    assert [m.version for m in manifests] == [1, 2, 3]
    assert manifests[0].keyframe is not None and manifests[0].patch is None
    assert manifests[1].patch is not None and manifests[1].keyframe is None
    assert manifests[2].patch is not None and manifests[2].keyframe is not None
    assert manifests[1].parent_digest == sha256_hex(raw[0])
    assert manifests[2].parent_digest == sha256_hex(raw[1])
    assert manifests[2].metadata == {"step": "102"}
    for manifest, data in zip(manifests, raw, strict=True):
        assert manifest.model_dump_json().encode() == data


def test_v2_manifest_of_a_context_coded_patch_round_trips_byte_for_byte() -> None:
    # Written by the first publisher of the context codec (docs/FORMAT.md 3.15): a
    # keyframe version (spec_version 1, nothing new to say) and its context-coded child.
    from schemas.manifest import ManifestV1, ManifestV2

    raw = [(GOLDEN / "v2" / f"manifest-{v}.json").read_bytes() for v in (1, 2)]
    first, second = (parse_manifest(data) for data in raw)
    assert type(first) is ManifestV1 and first.keyframe is not None
    assert type(second) is ManifestV2 and second.spec_version == 2
    assert second.patch is not None and (second.patch.codec, second.patch.context) == ("context", "base")
    assert second.parent_digest == sha256_hex(raw[0])
    for manifest, data in zip((first, second), raw, strict=True):
        assert manifest.model_dump_json().encode() == data
    # A version 2 document may not describe what version 1 says differently.
    with pytest.raises(FormatError, match="context"):
        parse_manifest(raw[1].replace(b'"context":"base"', b'"context":null'))
    with pytest.raises(FormatError):
        parse_manifest(raw[1].replace(b'"spec_version":2', b'"spec_version":1'))


def test_v1_head_points_at_the_newest_manifest() -> None:
    data = (GOLDEN / "v1" / "head.json").read_bytes()
    head = parse_head(data)
    assert head.version == 3
    assert head.manifest_digest == sha256_hex((GOLDEN / "v1" / "manifest-3.json").read_bytes())
    assert head.model_dump_json().encode() == data


def test_v1_local_state_without_a_manifest_digest_stays_readable() -> None:
    # Written before state.json recorded the manifest digest: it reads as "unknown", and a
    # Subscriber then checks the chain by the fingerprints it holds instead.
    state = parse_document(LocalStateV1, (GOLDEN / "v1" / "local-state.json").read_bytes(), source="golden")
    assert state.run == "golden-run" and state.version == 1
    assert state.manifest_digest is None
    assert set(state.fingerprints) == {"b", "w"}


def test_unknown_versions_and_other_documents_are_refused() -> None:
    data = (GOLDEN / "v1" / "manifest-1.json").read_bytes()
    with pytest.raises(UnsupportedFormatVersion):
        parse_manifest(data.replace(b'"spec_version":1', b'"spec_version":99'))
    with pytest.raises(FormatError):
        parse_manifest((GOLDEN / "v1" / "head.json").read_bytes())
    with pytest.raises(FormatError):
        parse_manifest(data[:-10])
    with pytest.raises(FormatError):
        parse_manifest(data.replace(b'"version":1', b'"version":-1'))


def test_signed_head_and_detached_signature_stay_readable_and_verify() -> None:
    # Written by the first signing writer (tests/golden/make.py --signed) with the golden
    # test key: a reader must keep parsing them, re-serialising them to the same bytes, and
    # accepting their signatures.
    from bulletin.signing import TrustPolicy, load_public_key
    from schemas.head import HeadV1, HeadV2
    from schemas.signature import parse_signature

    signed = GOLDEN / "signed"
    manifest = (GOLDEN / "v1" / "manifest-3.json").read_bytes()
    head_bytes = (signed / "head.v2.json").read_bytes()
    head = parse_head(head_bytes)
    assert isinstance(head, HeadV2)
    assert head.version == 3 and head.manifest_digest == sha256_hex(manifest)
    assert head.model_dump_json().encode() == head_bytes
    signature_bytes = (signed / "signature.v1.json").read_bytes()
    signature = parse_signature(signature_bytes)
    assert signature.manifest_digest == sha256_hex(manifest)
    assert signature.model_dump_json().encode() == signature_bytes
    trust = TrustPolicy([load_public_key(signed / "TEST-KEY-NOT-SECRET.pub.pem")])
    trust.verify_manifest("golden-run", sha256_hex(manifest), signature_bytes, source="golden")
    trust.verify_head("golden-run", head, source="golden")
    assert isinstance(parse_head((GOLDEN / "v1" / "head.json").read_bytes()), HeadV1)  # both versions read


def test_a_head_of_an_unknown_version_names_the_versions_known() -> None:
    data = (GOLDEN / "signed" / "head.v2.json").read_bytes()
    with pytest.raises(UnsupportedFormatVersion, match=r"knows 1, 2"):
        parse_head(data.replace(b'"spec_version":2', b'"spec_version":3'))
