"""Fixtures of the storage tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from bulletin.storage import MemoryStore, drop_memory_bucket


@pytest.fixture
def memory_store() -> Iterator[MemoryStore]:
    """A fresh, empty in-process store, closed and its bucket dropped afterwards."""
    name = f"test-{uuid.uuid4().hex}"
    store = MemoryStore(name)
    yield store
    store.close()
    drop_memory_bucket(name)
