"""Fixtures shared by the run tests."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest


@pytest.fixture(params=["memory", "local"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh store of each in-process kind: the memory store and a local directory."""
    if request.param == "memory":
        return f"memory://{uuid.uuid4().hex}"
    return str(tmp_path / "bucket")
