"""Bulletin: RL policy weights as lossless bit-level patches through an S3-compatible bucket.

Trainer side: :class:`Publisher` (one process) or :class:`ShardedPublisher` (every rank
of a sharded trainer). Rollout side: :class:`Subscriber`. Both are imported
lazily so that ``import bulletin.errors`` (the exception tree, whose root and codec
kinds live in ``patcher.errors``) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Publisher", "ShardedPublisher", "Subscriber", "__version__"]

if TYPE_CHECKING:
    from bulletin.distributed import ShardedPublisher
    from bulletin.publisher import Publisher
    from bulletin.subscriber import Subscriber


def __getattr__(name: str) -> Any:
    if name == "Publisher":
        from bulletin.publisher import Publisher

        return Publisher
    if name == "ShardedPublisher":  # every rank of a torch.distributed job (docs/SHARDED.md)
        from bulletin.distributed import ShardedPublisher

        return ShardedPublisher
    if name == "Subscriber":
        from bulletin.subscriber import Subscriber

        return Subscriber
    raise AttributeError(f"module 'bulletin' has no attribute {name!r}")
