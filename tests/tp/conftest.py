"""The TP tests run vLLM's own code: the kit ``scripts/vllm_source.py`` builds.

``scripts/test.sh`` builds it (or finds it cached) and exports ``BULLETIN_TEST_VLLM_PATH``.
Without it the tests skip, except under ``CI=true``, where a missing kit fails them:
CI must never pass by skipping what it is there to check.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from scripts._vllm_tp import VLLM_PATH_ENV, Cluster, vllm_path

#: Rank processes of the shared cluster: TP 4 is one engine, TP 2 two (data parallel).
WORLD = 4


@pytest.fixture(scope="session")
def vllm_kit() -> str:
    path = vllm_path()
    if path is None:
        why = f"{VLLM_PATH_ENV} is not set (scripts/test.sh sets it from scripts/vllm_source.py)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}; under CI=true the vLLM tests must run")
        pytest.skip(why)
    return path


@pytest.fixture(scope="session")
def cluster(vllm_kit: str) -> Iterator[Cluster]:
    """Four rank processes importing vLLM once, shared by every TP test."""
    with Cluster(WORLD, vllm_kit) as ranks:
        yield ranks
