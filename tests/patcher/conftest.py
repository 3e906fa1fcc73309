"""Every test here runs twice: on the compiled fast path and on the NumPy codec alone."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _both_codec_paths(codec_path: str) -> str:
    return codec_path
