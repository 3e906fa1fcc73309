"""Every test here runs twice, as the codec tests do: tests/patcher's autouse fixture."""

from __future__ import annotations

from tests.patcher.conftest import _both_codec_paths

__all__ = ["_both_codec_paths"]
