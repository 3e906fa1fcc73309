"""Publishing from a sharded trainer: every rank publishes its own part (docs/SHARDED.md)."""

from bulletin.distributed.publisher import PHASES, LocalShard, ShardedPublisher

__all__ = ["PHASES", "LocalShard", "ShardedPublisher"]
