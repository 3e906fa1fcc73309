"""The head: the one mutable object of a run, pointing at its newest version."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from schemas.common import Document, RunName, Sha256, VersionNumber

__all__ = ["HeadV1"]


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
