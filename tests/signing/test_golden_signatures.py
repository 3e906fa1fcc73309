"""The signed bytes, exactly: FORMAT.md "Signatures" against the committed golden files.

``tests/golden/documents/signed`` holds what ``tests/golden/make.py --signed`` wrote with
the golden test key. Today's code must build the same messages, sign them into the same
signatures (Ed25519 is deterministic) and serialise the same documents; the signatures
must also verify with nothing but ``cryptography`` and the message text FORMAT.md gives,
so the specification, not this code, is what a reader implements.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from bulletin.errors import BadSignature
from bulletin.run import sha256_hex
from bulletin.signing import Signer, TrustPolicy, load_public_key, parse_private_key
from schemas.head import HeadV2, parse_head
from schemas.signature import head_message, manifest_message, parse_signature
from tests.golden.make import golden_key

SIGNED = Path(__file__).resolve().parents[1] / "golden" / "documents" / "signed"
EXPECTED = json.loads((SIGNED / "expected.json").read_text())
MANIFEST = (SIGNED.parent / EXPECTED["manifest"]).read_bytes()


def test_the_committed_test_key_is_the_golden_seeds() -> None:
    # Parsed, not loaded: git does not keep the file's mode, so loading would warn about it.
    signer = Signer(parse_private_key((SIGNED / "TEST-KEY-NOT-SECRET.pem").read_bytes(), source="golden"))
    assert signer.key_id == Signer(golden_key()).key_id == EXPECTED["key_id"]
    assert signer.public_key.public_bytes_raw().hex() == EXPECTED["public_key"]
    public = load_public_key(SIGNED / "TEST-KEY-NOT-SECRET.pub.pem")
    assert TrustPolicy([public]).key_ids == {EXPECTED["key_id"]}


def test_the_messages_are_the_specified_bytes() -> None:
    digest = sha256_hex(MANIFEST)
    assert digest == EXPECTED["manifest_sha256"]
    key = EXPECTED["key_id"]
    assert manifest_message(key, digest) == (
        b"bulletin manifest signature v1\n" + f"key_id={key}\nmanifest_sha256={digest}\n".encode()
    )
    assert manifest_message(key, digest).decode() == EXPECTED["manifest_message"]
    updated_at = datetime(2026, 12, 1, 3, 8, 0, 824474, tzinfo=UTC)
    assert head_message(key, "golden-run", 3, digest, updated_at) == (
        b"bulletin head signature v1\n"
        + f"key_id={key}\nrun=golden-run\nversion=3\nmanifest_sha256={digest}\n".encode()
        + b"updated_at_us=1796094480824474\n"
    )
    assert head_message(key, "golden-run", 3, digest, updated_at).decode() == EXPECTED["head_message"]


def test_signing_again_gives_the_golden_bytes() -> None:
    signer = Signer(golden_key())
    digest = sha256_hex(MANIFEST)
    assert signer.sign_manifest(digest).model_dump_json().encode() == (SIGNED / "signature.v1.json").read_bytes()
    head = signer.sign_head("golden-run", 3, digest, datetime(2026, 12, 1, 3, 8, 0, 824474, tzinfo=UTC))
    assert head.model_dump_json().encode() == (SIGNED / "head.v2.json").read_bytes()
    assert head.signature.value == EXPECTED["head_signature"]


def test_the_signatures_verify_from_the_specification_alone() -> None:
    public = Ed25519PublicKey.from_public_bytes(bytes.fromhex(EXPECTED["public_key"]))
    public.verify(bytes.fromhex(EXPECTED["manifest_signature"]), EXPECTED["manifest_message"].encode())
    public.verify(bytes.fromhex(EXPECTED["head_signature"]), EXPECTED["head_message"].encode())
    # Domain separation: neither signature passes for the other document's message.
    with pytest.raises(InvalidSignature):
        public.verify(bytes.fromhex(EXPECTED["manifest_signature"]), EXPECTED["head_message"].encode())
    with pytest.raises(InvalidSignature):
        public.verify(bytes.fromhex(EXPECTED["head_signature"]), EXPECTED["manifest_message"].encode())


def test_the_same_instant_in_another_offset_signs_the_same_message() -> None:
    # The head's time is signed as microseconds since the epoch, not as its text: a writer
    # that writes "+02:00" instead of "Z" signs the same instant.
    head = parse_head((SIGNED / "head.v2.json").read_bytes())
    assert isinstance(head, HeadV2)
    shifted = head.model_dump_json().replace("03:08:00.824474Z", "05:08:00.824474+02:00").encode()
    other = parse_head(shifted)
    assert isinstance(other, HeadV2) and other.message() == head.message()
    trust = TrustPolicy([load_public_key(SIGNED / "TEST-KEY-NOT-SECRET.pub.pem")])
    trust.verify_head("golden-run", other, source="golden")
    later = parse_head(shifted.replace(b"824474", b"824475"))
    assert isinstance(later, HeadV2)
    with pytest.raises(BadSignature):
        trust.verify_head("golden-run", later, source="golden")
    assert parse_signature((SIGNED / "signature.v1.json").read_bytes()).manifest_digest == sha256_hex(MANIFEST)
