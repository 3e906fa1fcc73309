"""The head: the one mutable object of a run, pointing at its newest version.

``HeadV1`` is what an unsigned deployment writes (every reader understands it);
``HeadV2`` is the same pointer signed by the trainer (FORMAT.md, "Signatures"): the head
is replaced in place by compare-and-swap, so its signature travels inside it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import AwareDatetime

from patcher.errors import UnsupportedFormatVersion
from schemas.common import Document, RunName, Sha256, VersionNumber, parse_document
from schemas.signature import Signature, head_message

__all__ = ["Head", "HeadV1", "HeadV2", "parse_head"]


class HeadV1(Document):
    """Moved only forward, by compare-and-swap on its ETag."""

    format: Literal["bulletin.head"] = "bulletin.head"
    """Document type."""
    spec_version: Literal[1] = 1
    """Format version of this document."""
    run: RunName
    version: VersionNumber
    """Newest committed version (a newer manifest may exist while the head catches up)."""
    manifest_digest: Sha256
    """SHA-256 of that version's manifest bytes."""
    updated_at: datetime
    """UTC time of the move."""


class HeadV2(Document):
    """A signed head: ``HeadV1``'s fields and the trainer's signature over them."""

    format: Literal["bulletin.head"] = "bulletin.head"
    """Document type."""
    spec_version: Literal[2] = 2
    """Format version of this document."""
    run: RunName
    version: VersionNumber
    """Newest committed version (a newer manifest may exist while the head catches up)."""
    manifest_digest: Sha256
    """SHA-256 of that version's manifest bytes."""
    updated_at: AwareDatetime
    """Time of the move, with its UTC offset (signed, to the microsecond: readers refuse
    heads older than their staleness bound)."""
    signature: Signature
    """Over :meth:`message` (``schemas.signature.head_message`` of the fields above)."""

    def message(self) -> bytes:
        """The exact bytes :attr:`signature` signs."""
        return head_message(self.signature.key_id, self.run, self.version, self.manifest_digest, self.updated_at)


#: Every head version a reader understands.
Head = HeadV1 | HeadV2


def parse_head(data: bytes, *, source: str = "head") -> Head:
    """Validate head bytes of either version; raises ``FormatError`` /
    ``UnsupportedFormatVersion`` (:func:`schemas.common.parse_document`)."""
    try:
        return parse_document(HeadV1, data, source=source)
    except UnsupportedFormatVersion:
        pass
    try:
        return parse_document(HeadV2, data, source=source)
    except UnsupportedFormatVersion as exc:
        raise UnsupportedFormatVersion(str(exc).replace("(knows 2)", "(knows 1, 2)")) from None
