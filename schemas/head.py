"""The head: the one mutable object of a run, pointing at its newest version."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from schemas.common import Document, RunName, Sha256, VersionNumber, parse_document

__all__ = ["HeadV1", "parse_head"]


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


def parse_head(data: bytes, *, source: str = "head") -> HeadV1:
    """Validate head bytes; raises ``FormatError`` / ``UnsupportedFormatVersion``
    (:func:`schemas.common.parse_document`)."""
    return parse_document(HeadV1, data, source=source)
