"""State files a rollout node keeps beside its local copy of the weights."""

from __future__ import annotations

from datetime import datetime
from itertools import pairwise
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

__all__ = [
    "MAX_LOG_ENTRIES",
    "JournalV1",
    "LocalState",
    "LocalStateV1",
    "LocalStateV2",
    "LocalStateV3",
    "LogEntryV1",
    "local_state_files",
    "parse_local_state",
]

#: Patches a log-layout replica keeps before it must compact (docs/FORMAT.md 9.1).
MAX_LOG_ENTRIES = 10_000


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


class LogEntryV1(Document):
    """One applied version of a log-layout replica: the file holding its patch."""

    version: VersionNumber
    """Version activated with this entry's patch (the log's last entry may be followed
    by versions that changed no tensor)."""
    file: RelativeKey
    """Path of the log file inside the replica directory (``log/<id>.patch``)."""
    size: int = Field(ge=0)
    """Byte length of the log file."""
    sha256: Sha256
    """SHA-256 of the log file's exact bytes, checked before it is decoded."""


class LocalStateV3(LocalStateV1):
    """``state.json`` of a log-layout replica (docs/FORMAT.md 9.1): an immutable base
    folder (``model_dir``) holding ``base_version``, plus ``log``, the patches that take
    it to ``version``, applied in order. ``fingerprints`` are ``version``'s."""

    spec_version: Literal[3] = 3  # type: ignore[assignment]
    """Format version of this document."""
    layout: Literal["log"] = "log"
    """How the replica keeps its bits: ``log`` (base folder + patch log)."""
    base_version: VersionNumber
    """Version the base folder's tensors hold."""
    base_fingerprints: dict[TensorName, Fingerprint]
    """Fingerprint of every tensor of the base folder, as verified when it was written."""
    log: list[LogEntryV1] = Field(max_length=MAX_LOG_ENTRIES)
    """The patches from ``base_version`` to ``version``, in order (empty: the base
    folder is ``version`` and ``current`` points at it)."""
    files: dict[FilePath, Sha256] = Field(default_factory=dict, max_length=MAX_FILES)
    """Model files of ``version``: path -> SHA-256 of the copy kept under ``files/``."""

    @model_validator(mode="after")
    def _consistent(self) -> LocalStateV3:
        if list(self.files) != sorted(self.files):
            raise ValueError("files must be sorted by path")
        if self.base_fingerprints.keys() != self.fingerprints.keys():
            raise ValueError("base_fingerprints and fingerprints must name the same tensors")
        versions = [self.base_version, *(entry.version for entry in self.log)]
        if any(b <= a for a, b in pairwise(versions)) or versions[-1] > self.version:
            raise ValueError("log versions must increase from base_version, up to version")
        if not self.log and self.base_fingerprints != self.fingerprints:
            raise ValueError("with an empty log the base must hold version's fingerprints")
        if len({entry.file for entry in self.log}) != len(self.log):
            raise ValueError("log entries must name distinct files")
        return self


#: A node's state file, of any version this reader knows.
LocalState = LocalStateV1 | LocalStateV2 | LocalStateV3


def local_state_files(state: LocalStateV1) -> dict[str, str]:
    """The model files ``state`` records (path -> sha256): none before spec_version 2."""
    return dict(state.files) if isinstance(state, LocalStateV2 | LocalStateV3) else {}


def parse_local_state(data: bytes, *, source: str) -> LocalStateV1:
    """Validate ``state.json`` bytes of spec_version 1, 2 or 3 (``FormatError`` /
    ``UnsupportedFormatVersion`` as :func:`schemas.common.parse_document`)."""
    return parse_versioned((LocalStateV1, LocalStateV2, LocalStateV3), data, source=source)


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
