"""Fixtures of the mirror tests: the run tests' in-process stores."""

from __future__ import annotations

from tests.run.conftest import store_url

__all__ = ["store_url"]
