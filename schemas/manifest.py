"""The manifest: the document whose creation commits a version (FORMAT.md, "Manifests")."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from functools import cached_property
from types import MappingProxyType
from typing import Annotated, Literal

from pydantic import Field, TypeAdapter, ValidationError, model_validator

from patcher.compression import Codec, PatchCodec
from patcher.errors import InvalidInput, UnsupportedFormatVersion
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
    parse_document,
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
    "KeyframeRef",
    "Manifest",
    "ManifestV1",
    "ManifestV2",
    "Metadata",
    "ObjectRef",
    "PatchRef",
    "PatchRefV2",
    "TensorEntry",
    "VersionStats",
    "check_metadata",
    "parse_manifest",
]

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


def parse_manifest(data: bytes, *, source: str = "manifest") -> ManifestV1:
    """Validate manifest bytes of any version this reader knows (1 or 2); raises
    ``FormatError`` / ``UnsupportedFormatVersion`` (:func:`schemas.common.parse_document`)."""
    try:
        return parse_document(ManifestV1, data, source=source)
    except UnsupportedFormatVersion:
        pass
    try:
        return parse_document(ManifestV2, data, source=source)
    except UnsupportedFormatVersion:
        raise UnsupportedFormatVersion(
            f"{source}: this manifest's spec_version is not supported by this reader (knows 1 and 2); upgrade bulletin"
        ) from None


#: Every manifest version a reader understands, by its ``spec_version``.
Manifest = Annotated[ManifestV1 | ManifestV2, Field(discriminator="spec_version")]
