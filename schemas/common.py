"""Field types shared by the documents, and the one way document bytes are parsed."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Final, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from patcher.errors import FormatError, UnsupportedFormatVersion
from patcher.names import check_tensor_name

__all__ = [
    "MAX_DOCUMENT_BYTES",
    "RUN_NAME_PATTERN",
    "Document",
    "Fingerprint",
    "RelativeKey",
    "RunName",
    "Sha256",
    "TensorName",
    "VersionNumber",
    "parse_document",
    "parse_versioned",
]

#: Run names are one path segment: letters, digits, ``.``, ``_``, ``-``; 1-128 long.
RUN_NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
#: Reader cap for JSON documents (FORMAT.md, "Manifests"): a manifest of 100 000 tensors
#: with 40-byte names is 11.5 MiB, and its metadata can add at most 6.4 MiB.
MAX_DOCUMENT_BYTES: Final = 32 << 20


def _tensor_name(name: str) -> str:
    # Same rule as the codec's, so a manifest can never name a tensor a shard cannot.
    try:
        return check_tensor_name(name)
    except ValueError as exc:
        raise ValueError(str(exc)) from None


class Document(BaseModel):
    """Base of every JSON document: frozen, unknown fields refused, wire names explicit."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        strict=True,
        use_attribute_docstrings=True,
        populate_by_name=False,
        ser_json_inf_nan="strings",
    )


Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="lowercase hex SHA-256")]
Fingerprint = Annotated[
    str,
    Field(pattern=r"^[0-9a-f]{16}$", description="patcher.fingerprint, 16 lowercase hex digits"),
]
RunName = Annotated[str, Field(pattern=RUN_NAME_PATTERN)]
VersionNumber = Annotated[int, Field(ge=1, le=(1 << 53) - 1)]
TensorName = Annotated[str, AfterValidator(_tensor_name)]

#: A key relative to the run's root: plain segments, no "." or ".." tricks.
RelativeKey = Annotated[
    str,
    Field(pattern=r"^[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*$", max_length=512),
]

_D = TypeVar("_D", bound=Document)


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``json.loads`` hook: one value per key. Pydantic alone keeps the last of several,
    so two readers of the same bytes could disagree on what they say."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise FormatError(f"duplicate key {key!r}")
        out[key] = value
    return out


def parse_document(model: type[_D], data: bytes, *, source: str) -> _D:
    """Validate the JSON bytes of one document of ``model``'s type and format version.

    Oversized bytes, bytes that are not JSON, and another type of document are
    ``FormatError``, and a ``spec_version`` other than ``model``'s is
    ``UnsupportedFormatVersion``, all before full validation; so is an object (at any
    depth) with a duplicate key, which pydantic alone would resolve silently to the
    last value. A document the model refuses is ``FormatError`` with pydantic's first
    message. ``source`` (a key or a path) begins every message.
    """
    kind: str = model.model_fields["format"].default
    version: int = model.model_fields["spec_version"].default
    if len(data) > MAX_DOCUMENT_BYTES:
        raise FormatError(f"{source}: {len(data)} bytes exceeds the {MAX_DOCUMENT_BYTES} cap")
    try:
        raw = json.loads(data, object_pairs_hook=_no_duplicate_keys)
    except FormatError as exc:
        raise FormatError(f"{source}: {exc}") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, ints past the digit limit
        raise FormatError(f"{source}: not JSON: {exc}") from None
    except RecursionError:
        raise FormatError(f"{source}: JSON nested too deeply") from None
    if not isinstance(raw, dict) or raw.get("format") != kind:
        raise FormatError(f"{source}: not a {kind} document")
    if raw.get("spec_version") != version:
        raise UnsupportedFormatVersion(
            f"{source}: {kind} spec_version {raw.get('spec_version')!r} is not supported "
            f"by this reader (knows {version}); upgrade bulletin"
        )
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        raise FormatError(f"{source}: invalid {kind.removeprefix('bulletin.')}: {exc.errors()[0]['msg']}") from exc


def parse_versioned(models: Sequence[type[_D]], data: bytes, *, source: str) -> _D:
    """:func:`parse_document` for a document of any of ``models`` (one per format version,
    oldest first): the one whose ``spec_version`` it carries. A version none of them has
    is ``UnsupportedFormatVersion`` naming the versions known."""
    for model in models:
        try:
            return parse_document(model, data, source=source)
        except UnsupportedFormatVersion:
            continue
    kind: str = models[0].model_fields["format"].default
    known = ", ".join(str(m.model_fields["spec_version"].default) for m in models)
    raise UnsupportedFormatVersion(
        f"{source}: this {kind.removeprefix('bulletin.')}'s spec_version is not supported by this reader "
        f"(knows {known}); upgrade bulletin"
    )
