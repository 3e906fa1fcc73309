"""Publishing from every rank of a sharded trainer: one version per step (docs/SHARDED.md).

>>> pub = ShardedPublisher("s3://bucket/runs", "llama-grpo")   # on every rank, same order
>>> for step in range(steps):
...     train_step()
...     pub.publish_async(model.state_dict())   # DTensors (FSDP2), LocalShard, or whole tensors
>>> pub.close()

A :class:`ShardedPublisher` is the :class:`~bulletin.Publisher` over the job's ranks: the
same step (:mod:`bulletin.publisher`), with this module's collectives group and its
reading of a rank's part of the state dict. Each rank diffs the blocks it owns against
its kept bits of the last committed version (the :class:`~bulletin.base.PublishedBase`,
holding the rank's blocks: memory-mapped in a cache folder per rank, verified against
the run when the job starts; a CUDA block of a synchronous publish on its device, where
only the change leaves the GPU); the ranks add up their blocks' parts of every tensor's
change (one all-reduce, O(tensors)); each rank encodes the entries of the blocks it owns
that are runs of their tensor (whole tensors, ``Shard(0)``), and sends its other changes
(global indices and deltas, O(changed)) to the tensor's writer rank, which encodes that
tensor's entries; the shards are renumbered into one patch, each rank uploads its own, rank 0 creates the manifest
(the commit point) and broadcasts the outcome; only then does any rank's base move. A
step that fails on any rank commits nothing anywhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from bulletin.blocks import Block
from bulletin.device_kept import on_gpu
from bulletin.distributed.comm import Comm
from bulletin.distributed.parts import RankLayout
from bulletin.errors import ConfigError, InternalError, InvalidInput
from bulletin.publisher import _DEFAULT_KEYFRAME_FILE_BYTES, _DEFAULT_SHARD_BYTES, Publisher, _Snap
from bulletin.signing import Signer
from bulletin.snapshot import layout as local_layout
from bulletin.snapshot import read_served
from bulletin.storage import Store
from patcher.patch import TensorSpec

__all__ = ["LocalShard", "ShardedPublisher"]


@dataclass(frozen=True, slots=True)
class LocalShard:
    """A block of a tensor this rank holds, as Megatron-style code keeps it: ``tensor``
    (the block) of the tensor of ``global_shape``, starting at ``offsets``."""

    tensor: Any
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


def _dtensor_block(value: Any) -> tuple[Any, Block]:
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Partial) for p in value.placements):
        raise InvalidInput("a DTensor with a Partial placement holds no bits of its own: reduce it first")
    local = value.to_local()
    shape = tuple(int(d) for d in value.shape)
    sizes, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    if tuple(sizes) != tuple(local.shape):  # pragma: no cover - torch's own arithmetic
        raise InternalError(f"a DTensor's local shape {list(local.shape)} is not {list(sizes)}")
    return local, Block(shape, tuple(int(o) for o in offsets), tuple(int(s) for s in sizes))


def _split(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Block]]:
    """The rank's local tensors and their blocks."""
    if not isinstance(state_dict, Mapping) or not state_dict:
        raise InvalidInput("state_dict must be a non-empty mapping of tensor names to tensors")
    local: dict[str, Any] = {}
    blocks: dict[str, Block] = {}
    for name, value in state_dict.items():
        if type(value).__name__ == "DTensor" and type(value).__module__.startswith("torch.distributed"):
            local[name], blocks[name] = _dtensor_block(value)
        elif isinstance(value, LocalShard):
            local[name] = value.tensor
            sizes = tuple(int(d) for d in value.tensor.shape)
            blocks[name] = Block(tuple(int(d) for d in value.global_shape), tuple(int(o) for o in value.offsets), sizes)
        elif isinstance(getattr(value, "shape", None), tuple | list) or type(value).__module__.startswith("torch"):
            local[name] = value
            blocks[name] = Block.whole(tuple(int(d) for d in value.shape))
        else:
            raise InvalidInput(f"{name}: expected a tensor, an array or a LocalShard, got {type(value).__name__}")
    return local, blocks


class ShardedPublisher(Publisher):
    """Publishes one version per step from every rank of a ``torch.distributed`` job.

    Construct it on every rank, in the same order relative to other collectives (it
    makes its own gloo group, with ``timeout_s`` for every collective); without an
    initialised default group it is the one-rank case. Arguments as
    :class:`~bulletin.Publisher`'s; ``codec`` is ``"zstd"`` or ``"lz4"`` (the context
    codec needs a tensor's whole base at its encoder: docs/SHARDED.md). ``cache_dir``:
    where each rank keeps its blocks of the last committed version, in its own folder
    ``rank-<r>`` (default: the Publisher's cache folder for the store and run);
    ``scratch_dir``: where a rank writes its files of a keyframe before they are uploaded
    (default: the system's temporary folder). ``signing_key``: as the Publisher's, needed on
    rank 0 only, which signs every manifest and head of the job (docs/SECURITY.md).

    After a step fails (on any rank), every later call on every rank raises
    :class:`~bulletin.errors.RankFailed` (or the step's own error on the rank that
    raised it), unless it was a synchronous publish that every rank failed alike:
    restart the job, or make a new ShardedPublisher on every rank; either resumes from
    the run's newest version.
    """

    _codecs: ClassVar[tuple[str, ...]] = ("zstd", "lz4")

    def __init__(
        self,
        store: str | os.PathLike[str] | Store,
        run: str,
        *,
        dtype: str = "BF16",
        keyframe_every: int = 10,
        codec: str = "zstd",
        max_shard_bytes: int = _DEFAULT_SHARD_BYTES,
        keyframe_file_bytes: int = _DEFAULT_KEYFRAME_FILE_BYTES,
        max_workers: int = 8,
        queue_size: int = 2,
        timeout_s: float = 300.0,
        scratch_dir: str | os.PathLike[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        signing_key: Signer | str | os.PathLike[str] | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        if codec not in self._codecs:
            raise ConfigError(f"a sharded publisher's codec is 'zstd' or 'lz4', not {codec!r}")
        if timeout_s <= 0:
            raise ConfigError("timeout_s > 0")
        self._timeout_s = timeout_s
        self._scratch = Path(scratch_dir) if scratch_dir is not None else None
        super().__init__(
            store,
            run,
            dtype=dtype,
            keyframe_every=keyframe_every,
            codec=codec,
            max_shard_bytes=max_shard_bytes,
            keyframe_file_bytes=keyframe_file_bytes,
            max_workers=max_workers,
            queue_size=queue_size,
            on_bytes=on_bytes,
            signing_key=signing_key,
            cache_dir=cache_dir,
        )

    def _connect(self) -> Comm:
        return Comm.create(self._timeout_s)

    def _cache_subfolder(self) -> str:
        return f"rank-{self.rank}"  # each rank's own folder (ranks of a host share its cache root)

    def _take(self, state_dict: Mapping[str, Any], *, copy: bool) -> _Snap:
        """This rank's blocks (DTensors, LocalShards, whole tensors): with ``copy``, each
        block's served bits copied now; else read when the step needs them, a GPU block
        diffed on its device there."""
        local, blocks = _split(state_dict)
        found = local_layout(local, self.dtype)
        specs = {name: TensorSpec(name, spec.dtype, blocks[name].shape) for name, spec in found.specs.items()}
        snap = _Snap(RankLayout(self.rank, specs, {n: blocks[n] for n in specs}, found.aliases))
        for name, value in found.values.items():
            source, served = found.source_dtypes[name], found.specs[name].dtype
            if copy:  # now: the caller may change its tensors once this returns
                snap.bits.copies[name] = read_served(value, source, served, True)
            elif on_gpu(value):
                snap.device[name] = value
            else:
                snap.bits.reads[name] = (value, source, served)
        return snap
