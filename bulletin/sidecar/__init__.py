"""The version-aware sidecar: gates and relays requests to an engine, follows a run.

See :mod:`bulletin.sidecar.app` for the Python API and docs/SIDECAR.md for the HTTP
contract (headers, query parameters, status codes, metrics).
"""

from __future__ import annotations

from bulletin.sidecar.app import INTERNAL_PATHS, Sidecar, SidecarConfig, create_app
from bulletin.sidecar.gate import ActivationGate, Lease, Refusal
from bulletin.sidecar.metrics import SidecarMetrics
from bulletin.sidecar.requirements import VersionRequirement, parse_requirement
from bulletin.sidecar.worker import GatedTarget, SyncStatus, SyncWorker

__all__ = [
    "INTERNAL_PATHS",
    "ActivationGate",
    "GatedTarget",
    "Lease",
    "Refusal",
    "Sidecar",
    "SidecarConfig",
    "SidecarMetrics",
    "SyncStatus",
    "SyncWorker",
    "VersionRequirement",
    "create_app",
    "parse_requirement",
]
