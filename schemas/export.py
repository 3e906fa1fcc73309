"""The committed JSON Schemas of every document (``schemas/json/``).

``python -m schemas.export`` rewrites them; a test fails when they drift from the
models, so a change to a document's shape is always a visible, reviewed diff.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Final

from pydantic import BaseModel

from schemas.head import HeadV1, HeadV2
from schemas.local_state import JournalV1, LocalStateV1, LocalStateV2, LocalStateV3
from schemas.manifest import ManifestV1, ManifestV2, ManifestV3
from schemas.signature import SignatureV1

__all__ = ["DOCUMENTS", "SCHEMA_DIR", "render", "write"]

SCHEMA_DIR: Final = Path(__file__).parent / "json"

#: File name -> model, one per document type and format version.
DOCUMENTS: Final[dict[str, type[BaseModel]]] = {
    "manifest.v1.schema.json": ManifestV1,
    "manifest.v2.schema.json": ManifestV2,
    "manifest.v3.schema.json": ManifestV3,
    "head.v1.schema.json": HeadV1,
    "head.v2.schema.json": HeadV2,
    "signature.v1.schema.json": SignatureV1,
    "local-state.v1.schema.json": LocalStateV1,
    "local-state.v2.schema.json": LocalStateV2,
    "local-state.v3.schema.json": LocalStateV3,
    "journal.v1.schema.json": JournalV1,
}


def render(model: type[BaseModel]) -> str:
    schema = model.model_json_schema(mode="validation")
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def write(directory: Path = SCHEMA_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, model in DOCUMENTS.items():
        path = directory / name
        path.write_text(render(model), encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write():
        sys.stdout.write(f"wrote {path}\n")
