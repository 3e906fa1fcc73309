"""Signatures: the detached signature of a manifest, and the signature a signed head carries.

What exactly is signed (the byte strings below) is normative (FORMAT.md, "Signatures"):
a fixed first line names what the message is for, so that a manifest's signature can
never pass for a head's or the other way round, and neither names the store, so that a
mirror's verbatim copies verify too. Producing and checking signatures needs a crypto
library and lives in ``bulletin.signing``; this module only says which bytes.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Final, Literal

from pydantic import Field

from schemas.common import Document, RunName, Sha256, parse_document

__all__ = [
    "HEAD_CONTEXT",
    "MANIFEST_CONTEXT",
    "MAX_SIGNATURE_BYTES",
    "KeyId",
    "Signature",
    "SignatureV1",
    "epoch_microseconds",
    "head_message",
    "manifest_message",
    "parse_signature",
]

#: First line of the message a manifest's signature signs.
MANIFEST_CONTEXT: Final = b"bulletin manifest signature v1\n"
#: First line of the message a head's signature signs.
HEAD_CONTEXT: Final = b"bulletin head signature v1\n"
#: Reader cap for a detached signature document (one is about 300 bytes).
MAX_SIGNATURE_BYTES: Final = 4096

#: First 16 bytes of the SHA-256 of the raw 32-byte Ed25519 public key, in hex.
KeyId = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$", description="32 lowercase hex digits")]

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


class Signature(Document):
    """One Ed25519 signature and the key that made it."""

    algorithm: Literal["ed25519"] = "ed25519"
    """Signature scheme: Ed25519 (RFC 8032, pure, no pre-hash, no context)."""
    key_id: KeyId
    """Which public key verifies it (first 16 bytes of the SHA-256 of its 32 raw bytes)."""
    value: Annotated[str, Field(pattern=r"^[0-9a-f]{128}$")]
    """The 64-byte signature, in hex."""


class SignatureV1(Document):
    """The detached signature of one manifest, at ``signatures/<manifest sha256>.json``.

    Written create-only before the manifest it signs (whose creation stays the commit
    point); Ed25519 is deterministic, so a writer that creates it again writes the same
    bytes.
    """

    format: Literal["bulletin.signature"] = "bulletin.signature"
    """Document type."""
    spec_version: Literal[1] = 1
    """Format version of this document."""
    manifest_digest: Sha256
    """SHA-256 of the exact manifest bytes signed (also the document's key)."""
    signature: Signature
    """Over :func:`manifest_message` of that digest and the key id."""


def parse_signature(data: bytes, *, source: str = "signature") -> SignatureV1:
    """Validate signature document bytes; raises ``FormatError`` / ``UnsupportedFormatVersion``
    (:func:`schemas.common.parse_document`)."""
    return parse_document(SignatureV1, data, source=source)


def manifest_message(key_id: str, manifest_digest: str) -> bytes:
    """The exact bytes a manifest's signature signs (FORMAT.md, "Signatures")."""
    return MANIFEST_CONTEXT + f"key_id={key_id}\nmanifest_sha256={manifest_digest}\n".encode("ascii")


def epoch_microseconds(moment: datetime) -> int:
    """``moment`` as whole microseconds since 1970-01-01T00:00:00Z (exact: integer arithmetic)."""
    if moment.tzinfo is None:
        raise ValueError("a signed time must carry its UTC offset")
    delta = moment - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def head_message(key_id: str, run: RunName, version: int, manifest_digest: str, updated_at: datetime) -> bytes:
    """The exact bytes a head's signature signs (FORMAT.md, "Signatures")."""
    fields = (
        f"key_id={key_id}\nrun={run}\nversion={version}\nmanifest_sha256={manifest_digest}\n"
        f"updated_at_us={epoch_microseconds(updated_at)}\n"
    )
    return HEAD_CONTEXT + fields.encode("ascii")
