"""Field types shared by the documents."""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from patcher.names import check_tensor_name

__all__ = [
    "RUN_NAME_PATTERN",
    "Document",
    "Fingerprint",
    "RelativeKey",
    "RunName",
    "Sha256",
    "TensorName",
    "VersionNumber",
]

RUN_NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


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
