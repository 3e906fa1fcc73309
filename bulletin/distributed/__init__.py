"""Publishing from a sharded trainer: every rank publishes its own part (docs/SHARDED.md).

Imported lazily: :mod:`bulletin.publisher` builds on this package's collectives and
layout plan, and :class:`ShardedPublisher` on it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bulletin.distributed.publisher import LocalShard, ShardedPublisher
    from bulletin.publisher import PHASES

__all__ = ["PHASES", "LocalShard", "ShardedPublisher"]


def __getattr__(name: str) -> Any:
    if name == "PHASES":
        from bulletin.publisher import PHASES

        return PHASES
    if name in ("LocalShard", "ShardedPublisher"):
        from bulletin.distributed import publisher

        return getattr(publisher, name)
    raise AttributeError(f"module 'bulletin.distributed' has no attribute {name!r}")
