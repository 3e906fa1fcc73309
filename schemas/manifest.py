"""The manifest: the document whose creation commits a version (FORMAT.md, "Manifests")."""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from functools import cached_property
from types import MappingProxyType
from typing import Annotated, Final, Literal

from pydantic import AfterValidator, Field, TypeAdapter, ValidationError, model_validator

from patcher.compression import Codec, PatchCodec
from patcher.errors import InvalidInput
from patcher.fingerprint import parse_fingerprint
from patcher.patch import TensorSpec
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

#: Free-form trainer annotations: keys up to 256 characters, values up to 4096.
Metadata = dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=4096)]]
_METADATA: TypeAdapter[dict[str, str]] = TypeAdapter(Annotated[Metadata, Field(max_length=256)])


def check_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """``metadata`` as a manifest will hold it; ``InvalidInput`` (one line, the pydantic
    error as its cause) for what a manifest refuses, so a publisher checks it first."""
    try:
        return _METADATA.validate_python(dict(metadata))
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        raise InvalidInput(f"manifest field metadata{'.' + where if where else ''}: {problem['msg']}") from exc


__all__ = [
    "MAX_FILES",
    "MAX_FILES_BYTES",
    "MAX_FILE_BYTES",
    "FilePath",
    "FileRef",
    "KeyframeRef",
    "Manifest",
    "ManifestV1",
    "ManifestV2",
    "ManifestV3",
    "Metadata",
    "ObjectRef",
    "PatchRef",
    "PatchRefV2",
    "TensorEntry",
    "VersionStats",
    "check_file_path",
    "check_files",
    "check_metadata",
    "manifest_files",
    "parse_manifest",
]

#: Model files of one version (docs/FORMAT.md 5.1): at most this many, ...
MAX_FILES: Final = 256
#: ... each at most this large (a 256k-vocabulary tokenizer.json is about 33 MiB) ...
MAX_FILE_BYTES: Final = 64 << 20
#: ... and all of them together at most this large.
MAX_FILES_BYTES: Final = 256 << 20
_FILE_SEGMENT: Final = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9._+-]{0,127}")
_MAX_FILE_PATH: Final = 255
_MAX_FILE_DEPTH: Final = 8


def _reserved(path: str) -> str | None:
    """Why ``path`` is Bulletin's own in a model folder (its tensor files), or None."""
    name = path.lower()
    if name.endswith(".safetensors") or name.endswith(".safetensors.index.json"):
        return "names a tensor file (Bulletin writes the model folder's safetensors files and their index)"
    return None


def check_file_path(path: str) -> str:
    """A model file's path (FORMAT.md 5.1): relative, ``/``-separated, 1-8 segments of
    ``[A-Za-z0-9._+-]`` (none starting with ``.``), at most 255 bytes, not a tensor file's
    name. ``ValueError`` with the rule broken."""
    if not isinstance(path, str) or not path:
        raise ValueError("a file path is a non-empty string")
    if len(path) > _MAX_FILE_PATH:
        raise ValueError(f"file path {path[:64]!r}... is longer than {_MAX_FILE_PATH} characters")
    segments = path.split("/")
    if len(segments) > _MAX_FILE_DEPTH:
        raise ValueError(f"file path {path!r} is nested deeper than {_MAX_FILE_DEPTH} folders")
    for segment in segments:
        if not _FILE_SEGMENT.fullmatch(segment):
            raise ValueError(
                f"file path {path!r}: each '/'-separated part must be 1-128 of A-Z a-z 0-9 . _ + -, "
                "not starting with '.' (no absolute paths, no '..', no hidden files)"
            )
    reason = _reserved(path)
    if reason is not None:
        raise ValueError(f"file path {path!r} {reason}")
    return path


FilePath = Annotated[str, AfterValidator(check_file_path)]
"""A model file's path relative to the model folder (:func:`check_file_path`)."""


def check_files(paths_and_sizes: Mapping[str, int]) -> None:
    """The rules a version's files obey together (FORMAT.md 5.1): at most ``MAX_FILES``,
    each at most ``MAX_FILE_BYTES`` and all at most ``MAX_FILES_BYTES``, no two paths the
    same but for case (case-insensitive file systems), no path a folder of another.
    ``ValueError`` with the rule broken."""
    if len(paths_and_sizes) > MAX_FILES:
        raise ValueError(f"{len(paths_and_sizes)} files; a version holds at most {MAX_FILES}")
    total = 0
    for path, size in paths_and_sizes.items():
        if size > MAX_FILE_BYTES:
            raise ValueError(f"file {path!r} has {size} bytes; each file is at most {MAX_FILE_BYTES}")
        total += size
    if total > MAX_FILES_BYTES:
        raise ValueError(f"the files hold {total} bytes together; a version's are at most {MAX_FILES_BYTES}")
    folded: dict[str, str] = {}
    for path in paths_and_sizes:
        other = folded.setdefault(path.lower(), path)
        if other != path:
            raise ValueError(f"file paths {other!r} and {path!r} differ only by case")
    for path in paths_and_sizes:
        parts = path.lower().split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if folder in folded:
                raise ValueError(f"file path {folded[folder]!r} is also a folder of {path!r}")


DtypeName = Literal[
    "BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2", "U16", "I16", "F16", "BF16",
    "U32", "I32", "F32", "U64", "I64", "F64",
]  # fmt: skip


class TensorEntry(Document):
    """One served tensor of the version."""

    name: TensorName
    """Tensor name as in the state dict and the safetensors files."""
    dtype: DtypeName
    """safetensors dtype name."""
    shape: tuple[Annotated[int, Field(ge=0)], ...]
    """Dimensions, outermost first."""
    fingerprint: Fingerprint
    """Fingerprint of the tensor's bits in this version."""


class ObjectRef(Document):
    """An immutable object in the bucket and what its bytes must hash to."""

    key: RelativeKey
    """Key relative to the run's root."""
    size: Annotated[int, Field(ge=0)]
    """Exact size in bytes."""
    sha256: Sha256
    """SHA-256 of the object's bytes."""


class FileRef(ObjectRef):
    """One model file of the version (config, tokenizer, ...): where it goes in the model
    folder, and the immutable object holding its bytes (FORMAT.md 5.1)."""

    path: FilePath
    """Path relative to the model folder, ``/``-separated."""
    size: Annotated[int, Field(ge=0, le=MAX_FILE_BYTES)]
    """Exact size in bytes."""


class PatchRef(Document):
    """The transition from the parent version to this one."""

    codec: Codec
    """Entropy coder of the shards' streams (also recorded in each shard's header)."""
    shards: tuple[ObjectRef, ...]
    """Every shard of the patch, in shard order."""
    changed_elements: Annotated[int, Field(ge=0)]
    """Elements whose bits differ from the parent version."""


class KeyframeRef(Document):
    """The whole version as a plain safetensors checkpoint (HF-style when split)."""

    prefix: RelativeKey
    """Folder (relative to the run's root) holding the files; loadable as a checkpoint."""
    files: tuple[ObjectRef, ...]
    """The safetensors files and, when split, ``model.safetensors.index.json``."""


class VersionStats(Document):
    """Figures for logs and dashboards; not needed to reconstruct anything."""

    total_elements: Annotated[int, Field(ge=0)]
    total_bytes: Annotated[int, Field(ge=0)]
    """Dense size of the served tensors."""
    patch_bytes: Annotated[int, Field(ge=0)]
    """Bytes of all patch shards (0 without a patch)."""
    keyframe_bytes: Annotated[int, Field(ge=0)]
    """Bytes of all keyframe files (0 without a keyframe)."""


class ManifestV1(Document):
    """Commits version ``version`` of run ``run``. Immutable once created."""

    format: Literal["bulletin.manifest"] = "bulletin.manifest"
    """Document type."""
    spec_version: Literal[1] = 1
    """Format version of this document."""
    run: RunName
    version: VersionNumber
    parent_version: VersionNumber | None
    """``version - 1``, or null for the first version of the run."""
    parent_digest: Sha256 | None
    """SHA-256 of the parent manifest's exact bytes: the hash chain. Null iff no parent."""
    created_at: datetime
    """UTC time the trainer committed the version."""
    writer: Annotated[str, Field(pattern=r"^[0-9a-f]{8,64}$")]
    """Random id of the trainer process that wrote it."""
    tensors: tuple[TensorEntry, ...]
    """Every served tensor, sorted by name."""
    patch: PatchRef | None
    """Transition from the parent; null for the first version or a layout change."""
    keyframe: KeyframeRef | None
    """Full copy of this version; required when there is no patch."""
    stats: VersionStats
    metadata: Metadata = Field(default_factory=dict, max_length=256)
    """Free-form trainer annotations (step, loss, ...)."""

    @model_validator(mode="after")
    def _consistent(self) -> ManifestV1:
        if (self.parent_version is None) != (self.parent_digest is None):
            raise ValueError("parent_version and parent_digest are both set or both null")
        if self.parent_version is None and self.version != 1:
            raise ValueError("only version 1 may lack a parent")
        if self.parent_version is not None and self.parent_version != self.version - 1:
            raise ValueError("parent_version must be version - 1")
        if self.patch is None and self.keyframe is None:
            raise ValueError("a version needs a patch, a keyframe, or both")
        if self.patch is not None and self.parent_version is None:
            raise ValueError("a patch needs a parent version")
        names = [t.name for t in self.tensors]
        if names != sorted(names) or len(set(names)) != len(names):
            raise ValueError("tensors must be sorted by name and unique")
        return self

    # The codec's view of the tensors, computed once per manifest (on first use) and
    # handed out read-only. The cached dicts are plain, so a manifest still pickles;
    # ``model_copy(update=...)``, which pydantic does not validate, would carry them over
    # stale: build a new manifest instead.

    @cached_property
    def _specs(self) -> dict[str, TensorSpec]:
        return {t.name: TensorSpec(t.name, t.dtype, tuple(t.shape)) for t in self.tensors}

    @cached_property
    def _fingerprints(self) -> dict[str, int]:
        return {t.name: parse_fingerprint(t.fingerprint) for t in self.tensors}

    @property
    def specs(self) -> Mapping[str, TensorSpec]:
        """Every tensor's codec spec (name, dtype, shape), by name, in name order."""
        return MappingProxyType(self._specs)

    @property
    def fingerprints(self) -> Mapping[str, int]:
        """Every tensor's fingerprint in this version, as an int, by name."""
        return MappingProxyType(self._fingerprints)


class PatchRefV2(PatchRef):
    """The transition from the parent version to this one, in any codec (ManifestV2)."""

    codec: PatchCodec  # type: ignore[assignment]  # a superset of V1's codecs
    """Codec of the shards (also recorded in each shard's header): ``zstd``, ``lz4``, or
    ``context`` (docs/FORMAT.md 3.15), which decodes against the base."""
    context: Literal["base"] | None
    """What a decoder must hold besides the shards: ``"base"``, the bits of the parent
    version's tensors (every node at the parent version holds them; the shards name
    their fingerprints, which the parent manifest lists), for the ``context`` codec;
    null for the others, which need nothing."""

    @model_validator(mode="after")
    def _context_matches_codec(self) -> PatchRefV2:
        if (self.codec == "context") != (self.context == "base"):
            raise ValueError('context is "base" exactly when the codec is "context"')
        return self


class ManifestV2(ManifestV1):
    """ManifestV1 whose patch may be context coded (docs/FORMAT.md 5): written only for a
    version whose patch uses the ``context`` codec, so that every reader of spec_version
    1 keeps reading the rest. Code typed with ManifestV1 accepts it (a subclass)."""

    spec_version: Literal[2] = 2  # type: ignore[assignment]
    """Format version of this document."""
    patch: PatchRefV2 | None
    """Transition from the parent; null for the first version or a layout change."""


_FILE_KEY: Final = re.compile(r"files/(\d{20})/([0-9a-f]{64})")


class ManifestV3(ManifestV2):
    """ManifestV2 with the version's model files (docs/FORMAT.md 5.1): config, generation
    config, tokenizer files, ... that a node folder holds beside the tensors. Written only
    for a version that has files, so that every reader of spec_version 1 and 2 keeps
    reading the rest. Code typed with ManifestV1 accepts it (a subclass); a V3 patch is a
    :class:`PatchRefV2` whatever its codec (``context`` null unless context coded)."""

    spec_version: Literal[3] = 3  # type: ignore[assignment]
    """Format version of this document."""
    files: tuple[FileRef, ...] = Field(min_length=1, max_length=MAX_FILES)
    """Every model file of the version, sorted by path; each object is
    ``files/<V>/<sha256>``, V the version that first uploaded those bytes (at most this one)."""

    @model_validator(mode="after")
    def _files_consistent(self) -> ManifestV3:
        paths = [f.path for f in self.files]
        if paths != sorted(paths) or len(set(paths)) != len(paths):
            raise ValueError("files must be sorted by path and unique")
        check_files({f.path: f.size for f in self.files})
        for f in self.files:
            match = _FILE_KEY.fullmatch(f.key)
            if match is None or match.group(2) != f.sha256 or int(match.group(1)) > self.version:
                raise ValueError(
                    f"file {f.path!r}: its key must be files/<version, at most {self.version}, 20 digits>/<its sha256>"
                )
        return self


def manifest_files(manifest: ManifestV1) -> tuple[FileRef, ...]:
    """The model files of a manifest's version: a V3 manifest's ``files``, none for the others."""
    return manifest.files if isinstance(manifest, ManifestV3) else ()


#: Manifest models by ``spec_version``, oldest first (the order they are tried in).
_MANIFESTS: Final[tuple[type[ManifestV1], ...]] = (ManifestV1, ManifestV2, ManifestV3)


def parse_manifest(data: bytes, *, source: str = "manifest") -> ManifestV1:
    """Validate manifest bytes of any version this reader knows (1, 2 or 3); raises
    ``FormatError`` / ``UnsupportedFormatVersion`` (:func:`schemas.common.parse_document`)."""
    return parse_versioned(_MANIFESTS, data, source=source)


#: Every manifest version a reader understands, by its ``spec_version``.
Manifest = Annotated[ManifestV1 | ManifestV2 | ManifestV3, Field(discriminator="spec_version")]
