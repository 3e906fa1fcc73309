"""The JSON forms the sidecar and an engine's ranks exchange (vLLM's worker extension,
SGLang's custom loader): tensor specs, fingerprints, spool paths, errors by code.

Both engines relay a rank's answer as text, so every value is checked on the way in
and anything malformed is ``InvalidInput``, never a crash inside the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from bulletin import errors
from bulletin.errors import BulletinError, InvalidInput
from patcher.fingerprint import format_fingerprint, parse_fingerprint
from patcher.patch import TensorSpec

__all__ = [
    "ERRORS",
    "SPOOL_SHARD_BYTES",
    "fps_from_json",
    "fps_to_json",
    "request_path",
    "request_paths",
    "specs_from_json",
    "specs_to_json",
]

#: Largest spool shard; the decoder's own limits apply on the worker.
SPOOL_SHARD_BYTES: Final = 64 << 20

#: Every Bulletin error class by its code, to raise again what a rank reported.
ERRORS: Final[dict[str, type[BulletinError]]] = {
    cls.code: cls for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, BulletinError)
}


def specs_to_json(specs: Mapping[str, TensorSpec]) -> list[dict[str, Any]]:
    return [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in specs.values()]


def specs_from_json(value: object) -> dict[str, TensorSpec]:
    if not isinstance(value, list):
        raise InvalidInput("specs must be a list")
    specs: dict[str, TensorSpec] = {}
    for item in value:
        if not isinstance(item, dict) or set(item) != {"name", "dtype", "shape"}:
            raise InvalidInput("each spec is {name, dtype, shape}")
        shape = item["shape"]
        if not isinstance(shape, list) or not all(type(d) is int for d in shape):
            raise InvalidInput(f"{item.get('name')!r}: shape must be a list of ints")
        spec = TensorSpec(item["name"], item["dtype"], tuple(shape))
        if spec.name in specs:
            raise InvalidInput(f"{spec.name!r} listed twice")
        specs[spec.name] = spec
    return specs


def fps_to_json(fps: Mapping[str, int]) -> dict[str, str]:
    return {name: format_fingerprint(fp) for name, fp in fps.items()}


def fps_from_json(value: object) -> dict[str, int]:
    if not isinstance(value, dict):
        raise InvalidInput("fingerprints must be an object")
    try:
        return {str(k): parse_fingerprint(v) for k, v in value.items()}
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"bad fingerprint: {exc}") from None


def request_path(body: Mapping[str, Any], key: str) -> Path:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"{key} must be a path")
    return Path(value)


def request_paths(body: Mapping[str, Any], key: str) -> list[Path]:
    value = body.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise InvalidInput(f"{key} must be a non-empty list of paths")
    return [Path(v) for v in value]
