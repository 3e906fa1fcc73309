"""The version-aware sidecar: gates and relays requests to an engine, follows a run.

See :mod:`bulletin.sidecar.app` for the Python API, :mod:`bulletin.sidecar.compose`
for building one from settings (what ``bulletin serve`` does), and docs/SIDECAR.md for
the HTTP contract (headers, query parameters, status codes, metrics).

Names are imported on first use, so that ``bulletin.sidecar.cli`` and
``bulletin.sidecar.compose`` load without aiohttp (the ``bulletin`` command lists
``serve`` without starting the server stack).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from bulletin.sidecar.app import INTERNAL_PATHS, Sidecar, SidecarConfig, create_app
    from bulletin.sidecar.compose import (
        ENGINES,
        BuiltEngine,
        SidecarSettings,
        SidecarStack,
        TorchEngineSettings,
        build_sidecar,
    )
    from bulletin.sidecar.gate import ActivationGate, Lease, Refusal
    from bulletin.sidecar.metrics import SidecarMetrics
    from bulletin.sidecar.requirements import VersionRequirement, parse_requirement
    from bulletin.sidecar.worker import GatedTarget, SyncStatus, SyncWorker

__all__ = [
    "ENGINES",
    "INTERNAL_PATHS",
    "ActivationGate",
    "BuiltEngine",
    "GatedTarget",
    "Lease",
    "Refusal",
    "Sidecar",
    "SidecarConfig",
    "SidecarMetrics",
    "SidecarSettings",
    "SidecarStack",
    "SyncStatus",
    "SyncWorker",
    "TorchEngineSettings",
    "VersionRequirement",
    "build_sidecar",
    "create_app",
    "parse_requirement",
]

#: Public name -> the submodule that defines it.
_WHERE: Final[dict[str, str]] = {
    "INTERNAL_PATHS": "app",
    "Sidecar": "app",
    "SidecarConfig": "app",
    "create_app": "app",
    "ENGINES": "compose",
    "BuiltEngine": "compose",
    "SidecarSettings": "compose",
    "SidecarStack": "compose",
    "TorchEngineSettings": "compose",
    "build_sidecar": "compose",
    "ActivationGate": "gate",
    "Lease": "gate",
    "Refusal": "gate",
    "SidecarMetrics": "metrics",
    "VersionRequirement": "requirements",
    "parse_requirement": "requirements",
    "GatedTarget": "worker",
    "SyncStatus": "worker",
    "SyncWorker": "worker",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'bulletin.sidecar' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"bulletin.sidecar.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
