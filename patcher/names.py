"""Validation of tensor names, which end up in JSON documents and file listings."""

from __future__ import annotations

import re
from typing import Final

from patcher.errors import InvalidTensorName

__all__ = ["MAX_NAME_BYTES", "check_tensor_name"]

MAX_NAME_BYTES: Final = 1024
_CONTROL: Final = re.compile("[\x00-\x1f\x7f]")
#: Names found safe (only exact ``str`` objects: a subclass could compare equal and differ).
_CHECKED: set[str] = set()
_CHECKED_MAX: Final = 1 << 16


def check_tensor_name(name: object) -> str:
    """Return ``name`` if it is a safe tensor name, else raise ``InvalidTensorName``.

    Names are dotted module paths (``model.layers.0.mlp.up_proj.weight``). Path
    separators, parent references, control characters and NUL are refused because
    tools that materialise tensors as files would otherwise escape their folder.
    """
    if not isinstance(name, str) or not name:
        raise InvalidTensorName(f"tensor name must be a non-empty string, got {name!r}")
    if type(name) is str and name in _CHECKED:  # a run checks the same names at every version, several times each
        return name
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise InvalidTensorName(f"tensor name longer than {MAX_NAME_BYTES} bytes: {name[:64]!r}...")
    if "/" in name or "\\" in name:
        raise InvalidTensorName(f"tensor name must not contain a path separator: {name!r}")
    if name in {".", ".."} or name.startswith("..") or name.startswith("__"):
        raise InvalidTensorName(f"tensor name is reserved or path-like: {name!r}")
    if _CONTROL.search(name):
        raise InvalidTensorName(f"tensor name contains a control character: {name!r}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidTensorName(f"tensor name is not valid UTF-8: {name!r}") from None
    if type(name) is str:
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        _CHECKED.add(name)
    return name
