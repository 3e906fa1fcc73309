"""State files a rollout node keeps beside its local copy of the weights."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from schemas.common import (
    Document,
    Fingerprint,
    RelativeKey,
    RunName,
    Sha256,
    TensorName,
    VersionNumber,
)

__all__ = ["JournalV1", "LocalStateV1"]


class LocalStateV1(Document):
    """``state.json``: the version the node's ``model/`` folder holds, verified."""

    format: Literal["bulletin.local-state"] = "bulletin.local-state"
    """Document type."""
    spec_version: Literal[1] = 1
    """Format version of this document."""
    run: RunName | None
    """Run the weights came from (null for an offline checkpoint)."""
    version: VersionNumber
    model_dir: RelativeKey
    """Folder inside the local directory holding the safetensors files."""
    fingerprints: dict[TensorName, Fingerprint]
    """Fingerprint of every tensor, as verified at activation."""
    manifest_digest: Sha256 | None = None
    """SHA-256 of the exact bytes of the run's manifest of ``version``: the chain a node
    resumes on must still hold it (a run rolled back, rewritten or replaced is refused
    unless the node opts in). Absent (null) in states written before it was recorded,
    or for versions activated without a manifest (an offline checkpoint)."""
    updated_at: datetime


class JournalV1(Document):
    """``journal.json``: an in-place apply is under way; its undo data is ``journal.npz``."""

    format: Literal["bulletin.journal"] = "bulletin.journal"
    """Document type."""
    spec_version: Literal[1] = 1
    """Format version of this document."""
    model_dir: RelativeKey
    """Folder being modified in place."""
    from_version: VersionNumber
    """Version the folder held before the apply. If ``state.json`` still names it after a
    crash, the apply did not commit and the undo data is written back."""
