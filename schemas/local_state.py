"""State files a rollout node keeps beside its local copy of the weights."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field, model_validator

from schemas.common import (
    Document,
    Fingerprint,
    RelativeKey,
    RunName,
    Sha256,
    TensorName,
    VersionNumber,
    parse_versioned,
)
from schemas.manifest import MAX_FILES, FilePath

__all__ = ["JournalV1", "LocalState", "LocalStateV1", "LocalStateV2", "local_state_files", "parse_local_state"]


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


class LocalStateV2(LocalStateV1):
    """``state.json`` of a version that has model files (docs/FORMAT.md 9): LocalStateV1
    and the files the model folder holds beside the tensors. Written only for such a
    version, so that a reader of spec_version 1 keeps reading the rest."""

    spec_version: Literal[2] = 2  # type: ignore[assignment]
    """Format version of this document."""
    files: dict[FilePath, Sha256] = Field(min_length=1, max_length=MAX_FILES)
    """Path in the model folder -> SHA-256 of its exact bytes, as verified at activation."""

    @model_validator(mode="after")
    def _files_sorted(self) -> LocalStateV2:
        if list(self.files) != sorted(self.files):
            raise ValueError("files must be sorted by path")
        return self


#: A node's state file, of any version this reader knows.
LocalState = LocalStateV1 | LocalStateV2


def local_state_files(state: LocalStateV1) -> dict[str, str]:
    """The model files ``state`` records (path -> sha256): none before spec_version 2."""
    return dict(state.files) if isinstance(state, LocalStateV2) else {}


def parse_local_state(data: bytes, *, source: str) -> LocalStateV1:
    """Validate ``state.json`` bytes of spec_version 1 or 2 (``FormatError`` /
    ``UnsupportedFormatVersion`` as :func:`schemas.common.parse_document`)."""
    return parse_versioned((LocalStateV1, LocalStateV2), data, source=source)


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
