"""What a publish writes besides the tensors' bits: the version's manifest
(:func:`build_manifest`), its model files (:func:`prepare_files`, :func:`upload_files`)
and what the caller is told (:class:`PublishResult`). Every publisher (one process or
every rank of a sharded job: :class:`~bulletin.Publisher`) writes its versions so."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from bulletin.keyspace import file_key
from bulletin.model_files import ModelFiles, select_model_files, with_served_dtype
from bulletin.run import Run, StoredManifest, sha256_hex
from patcher.fingerprint import format_fingerprint
from patcher.patch import TensorSpec
from schemas.manifest import (
    FileRef,
    KeyframeRef,
    ManifestV1,
    ManifestV2,
    ManifestV3,
    PatchRef,
    PatchRefV2,
    TensorEntry,
    VersionStats,
    manifest_files,
)

__all__ = [
    "FilesArg",
    "PreparedFiles",
    "PublishResult",
    "build_manifest",
    "prepare_files",
    "publish_result",
    "upload_files",
]

#: What ``files=`` takes: checked files, a mapping of relative path -> bytes, a checkpoint
#: folder (its files by the default rule of :func:`~bulletin.model_files.select_model_files`),
#: or None: the previous version's files.
FilesArg = ModelFiles | Mapping[str, bytes] | str | os.PathLike[str] | None


@dataclass(frozen=True, slots=True)
class PublishResult:
    """What one publish wrote."""

    version: int
    keyframe: bool
    changed_elements: int
    total_elements: int
    patch_bytes: int
    keyframe_bytes: int
    manifest_digest: str
    files: tuple[str, ...] = ()
    """Paths of the version's model files (the previous version's when none were given)."""
    files_uploaded: int = 0
    """Bytes of model files uploaded for it: 0 when they did not change."""
    notes: tuple[str, ...] = ()
    """What was changed on the way, to tell the user (``config.json``'s dtype rewritten)."""


@dataclass(frozen=True, slots=True)
class PreparedFiles:
    """The model files a publish was given (None: the previous version's) and the notes
    their preparation left."""

    files: ModelFiles | None
    notes: tuple[str, ...] = ()


def build_manifest(
    run: str,
    writer: str,
    version: int,
    parent: StoredManifest | None,
    specs: Mapping[str, TensorSpec],
    fps: Mapping[str, int],
    patch_ref: PatchRef | None,
    keyframe_ref: KeyframeRef | None,
    file_refs: tuple[FileRef, ...],
    metadata: dict[str, str],
) -> ManifestV1:
    """The manifest of ``version`` (tensors ``specs`` with fingerprints ``fps``), chained to
    ``parent``; every publisher writes its manifests so (the sharded one too)."""
    # Write the oldest spec_version that says it all: 3 for files, 2 for a context-coded
    # patch, else 1, so that readers that predate them keep reading the rest.
    extra: dict[str, Any] = {}
    manifest_type: type[ManifestV1] = ManifestV1
    if file_refs:
        manifest_type, extra = ManifestV3, {"files": file_refs}
        if patch_ref is not None and not isinstance(patch_ref, PatchRefV2):
            patch_ref = PatchRefV2(
                codec=patch_ref.codec,
                shards=patch_ref.shards,
                changed_elements=patch_ref.changed_elements,
                context=None,
            )
    elif isinstance(patch_ref, PatchRefV2):
        manifest_type = ManifestV2
    ordered = [specs[n] for n in sorted(specs)]
    return manifest_type(
        run=run,
        version=version,
        parent_version=parent.version if parent else None,
        parent_digest=parent.digest if parent else None,
        created_at=datetime.now(UTC),
        writer=writer,
        tensors=tuple(
            TensorEntry(name=s.name, dtype=s.dtype, shape=s.shape, fingerprint=format_fingerprint(fps[s.name]))  # type: ignore[arg-type]
            for s in ordered
        ),
        patch=patch_ref,
        keyframe=keyframe_ref,
        stats=VersionStats(
            total_elements=sum(s.numel for s in ordered),
            total_bytes=sum(s.nbytes for s in ordered),
            patch_bytes=sum(r.size for r in patch_ref.shards) if patch_ref else 0,
            keyframe_bytes=sum(r.size for r in keyframe_ref.files) if keyframe_ref else 0,
        ),
        metadata=metadata,
        **extra,
    )


def publish_result(
    manifest: ManifestV1, stored: StoredManifest, *, files_uploaded: int = 0, notes: tuple[str, ...] = ()
) -> PublishResult:
    """What a publish of ``manifest``, committed as ``stored``, wrote."""
    stats = manifest.stats
    return PublishResult(
        version=manifest.version,
        keyframe=manifest.keyframe is not None,
        changed_elements=manifest.patch.changed_elements if manifest.patch else stats.total_elements,
        total_elements=stats.total_elements,
        patch_bytes=stats.patch_bytes,
        keyframe_bytes=stats.keyframe_bytes,
        manifest_digest=stored.digest,
        files=tuple(f.path for f in manifest_files(manifest)),
        files_uploaded=files_uploaded,
        notes=notes,
    )


def _as_model_files(files: FilesArg) -> ModelFiles | None:
    if files is None or isinstance(files, ModelFiles):
        return files
    if isinstance(files, str | os.PathLike):
        return select_model_files(files)
    return ModelFiles.of(files)


def prepare_files(files: FilesArg, dtype: str, *, cast: bool) -> PreparedFiles:
    """A publish's ``files`` checked (before anything is snapshotted or uploaded), with
    ``config.json`` naming the served ``dtype`` when floating tensors are cast to it."""
    given = _as_model_files(files)
    if given is None or not cast:
        return PreparedFiles(given)
    served, notes = with_served_dtype(given, dtype)
    return PreparedFiles(served, notes)


def upload_files(
    run: Run,
    version: int,
    previous: tuple[FileRef, ...],
    files: ModelFiles | None,
    on_bytes: Callable[[int], None] | None = None,
) -> tuple[tuple[FileRef, ...], int]:
    """The file refs of ``version`` of ``run``, and the bytes uploaded for them: the
    parent's refs (``previous``) when no files were given; otherwise one per file, naming
    the object the parent named for the same bytes (nothing uploaded) or a new one,
    uploaded create-only now (before the manifest that names it)."""
    if files is None:
        return previous, 0
    by_digest = {ref.sha256: ref for ref in previous}
    refs: list[FileRef] = []
    items: dict[str, bytes] = {}
    for path, content in files.files.items():
        digest = sha256_hex(content)
        known = by_digest.get(digest)
        key = known.key if known is not None else file_key(version, digest)
        if known is None:
            items[key] = content
        refs.append(FileRef(path=path, key=key, size=len(content), sha256=digest))
    if items:
        run.upload(items, on_bytes)
    return tuple(refs), sum(len(content) for content in items.values())
