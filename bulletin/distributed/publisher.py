"""Publishing from every rank of a sharded trainer: one version per step (docs/SHARDED.md).

>>> pub = ShardedPublisher("s3://bucket/runs", "llama-grpo")   # on every rank, same order
>>> for step in range(steps):
...     train_step()
...     pub.publish_async(model.state_dict())   # DTensors (FSDP2), LocalShard, or whole tensors
>>> pub.close()

Each rank diffs the blocks it owns against its kept bits of the last committed version
(the :class:`~bulletin.base.PublishedBase` the single-process publisher keeps, holding
the rank's blocks: memory-mapped in a cache folder per rank, verified against the run
when the job starts; a CUDA block of a synchronous publish on its device, where only the
change leaves the GPU), sends each change (global indices and deltas, O(changed)) to the
tensor's writer rank, which encodes the tensor's entries;
the shards are renumbered into one patch, each rank uploads its own, rank 0 creates
the manifest (the commit point) and broadcasts the outcome; only then does any rank's
base move. A step that fails on any rank commits nothing anywhere.
"""

from __future__ import annotations

import hashlib
import os
import queue
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

import numpy as np
from numpy.typing import NDArray

from bulletin.base import PublishedBase
from bulletin.blocks import Block, BlockChanges, block_runs, part_fingerprint
from bulletin.checkpoint import INDEX_NAME, Checkpoint, encode_safetensors_header, hf_index, plan_checkpoint
from bulletin.device_kept import on_gpu
from bulletin.distributed.comm import Comm
from bulletin.distributed.parts import Layout, RankLayout, plan_layout
from bulletin.distributed.shards import renumber
from bulletin.errors import (
    AccessDenied,
    ConfigError,
    FingerprintMismatch,
    InternalError,
    InvalidInput,
    RankFailed,
    StorageUnavailable,
    VersionConflict,
)
from bulletin.fileio import pwrite_all
from bulletin.keyframe_stage import StagedKeyframe
from bulletin.keyspace import keyframe_prefix, patch_shard_key
from bulletin.publisher import (
    FilesArg,
    PreparedFiles,
    PublishResult,
    RunPublisher,
    build_manifest,
    prepare_files,
    publish_result,
    upload_files,
)
from bulletin.run import Run, StoredManifest, sha256_hex
from bulletin.signing import Signer, as_signer
from bulletin.snapshot import TensorBits, read_served
from bulletin.snapshot import layout as local_layout
from bulletin.storage import Conflicted, Store, open_store, require_writable
from patcher.compression import check_codec
from patcher.dtypes import SERVED_FLOAT_DTYPES
from patcher.encode import encode
from patcher.format import TensorInfo, compute_patch_id
from patcher.patch import Patch, TensorDelta, TensorSpec
from schemas.manifest import (
    KeyframeRef,
    ManifestV1,
    ObjectRef,
    PatchRef,
    check_metadata,
    parse_manifest,
)

__all__ = ["LocalShard", "ShardedPublisher"]

_MASK64: Final = (1 << 64) - 1
_DEFAULT_SHARD_BYTES: Final = 64 << 20
_DEFAULT_KEYFRAME_FILE_BYTES: Final = 1 << 30
#: A rank's blocks of a keyframe go to one file of its cache, whatever their size.
_ONE_FILE: Final = 1 << 62
#: Phases a test may stop a rank at (``_hook``), in the order a step passes them.
PHASES: Final = ("layout", "diffed", "exchanged", "encoded", "uploaded", "manifest", "committed", "advanced")

Bits = NDArray[np.unsignedinteger]


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


def _sums(parts: list[dict[str, int]]) -> dict[str, int]:
    """Every tensor's fingerprint: the sum of its blocks' parts from every rank."""
    fps: dict[str, int] = {}
    for part in parts:
        for name, fp in part.items():
            fps[name] = (fps.get(name, 0) + fp) & _MASK64
    return fps


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


@dataclass(slots=True)
class _Snap:
    """One step as this rank took it: its layout and each block's bits, or the error
    taking it raised (the step then fails on every rank)."""

    layout: RankLayout | None
    error: BaseException | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    #: The blocks' bits: copied when the snapshot was taken (``publish_async``), else
    #: read in place when the step needs them.
    bits: TensorBits = field(default_factory=TensorBits)
    #: GPU blocks of a synchronous publish: diffed (or kept) on their device at the step.
    device: dict[str, Any] = field(default_factory=dict)
    #: The version's model files (rank 0's; None keeps the previous version's).
    files: PreparedFiles = field(default_factory=lambda: PreparedFiles(None))


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What rank 0 broadcasts after its commit."""

    manifest: bytes | None
    digest: str
    error: str
    kind: str  # "" when committed, else the error's class name


class ShardedPublisher(RunPublisher):
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
    raised it): restart the job, or make a new ShardedPublisher on every rank; either
    resumes from the run's newest version.
    """

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
    ) -> None:
        if dtype not in SERVED_FLOAT_DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(SERVED_FLOAT_DTYPES)}, not {dtype!r}")
        if keyframe_every < 1:
            raise ConfigError("keyframe_every must be >= 1")
        if codec not in ("zstd", "lz4"):
            raise ConfigError(f"a sharded publisher's codec is 'zstd' or 'lz4', not {codec!r}")
        if queue_size < 1 or max_shard_bytes < 1 << 10 or keyframe_file_bytes < 1 << 10 or timeout_s <= 0:
            raise ConfigError("queue_size >= 1; max_shard_bytes and keyframe_file_bytes >= 1 KiB; timeout_s > 0")
        opened = open_store(store) if isinstance(store, str | os.PathLike) else store
        require_writable(opened, "publishing")
        # Rank 0 alone writes manifests and heads: the other ranks may pass no key.
        self._run = Run(opened, run, max_workers=max_workers, signer=as_signer(signing_key))
        self.dtype = dtype
        self.keyframe_every = keyframe_every
        self.codec = check_codec(codec)
        self.max_shard_bytes = max_shard_bytes
        self.keyframe_file_bytes = keyframe_file_bytes
        self._scratch = Path(scratch_dir) if scratch_dir is not None else None
        self._comm = Comm.create(timeout_s)
        self.rank, self.world = self._comm.rank, self._comm.world
        self.writer = str(self._comm.broadcast(secrets.token_hex(8)))  # one writer id for the job
        # Each rank's own folder under the cache (ranks of a host share its cache root).
        self._base = PublishedBase(self._run, dtype, cache_dir, subfolder=f"rank-{self.rank}")
        #: The owners of every block when the base's blocks were made: the same on every rank.
        self._owners: dict[str, list[tuple[int, Block]]] = {}
        self._layout: tuple[RankLayout, Layout] | None = None  # this rank's blocks, and the layout agreed
        self._resumed = False
        self._pending: ManifestV1 | None = None  # rank 0: a commit whose outcome is unknown
        self._broken: BaseException | None = None
        self._queue: queue.Queue[tuple[_Snap, Future[PublishResult]] | None] = queue.Queue(maxsize=queue_size)
        self._worker: threading.Thread | None = None
        self._closed = False
        self.results: list[PublishResult] = []
        self._hook: Callable[[str, int], None] | None = None  # tests: called at each phase
        self._agreed = False  # the current step's failure was met by every rank alike

    # -- public API --------------------------------------------------------------------

    def publish(
        self, state_dict: Mapping[str, Any], *, metadata: Mapping[str, str] | None = None, files: FilesArg = None
    ) -> int:
        """Publish one step synchronously (every rank calls it with its own part); returns
        the version committed. Tensors are read while it runs. ``metadata`` and ``files``
        (the version's model files, as the Publisher's: None keeps the previous version's,
        and ``config.json`` is made to name the served dtype) are rank 0's; the other
        ranks' are ignored."""
        self._check_open()
        self.flush()
        snap = self._snapshot(state_dict, metadata, files, copy=False)
        return self._step(snap).version

    def publish_async(
        self, state_dict: Mapping[str, Any], *, metadata: Mapping[str, str] | None = None, files: FilesArg = None
    ) -> Future[PublishResult]:
        """Copy this rank's blocks now, publish in the background (collectives on the
        publisher's own group, one step after another on every rank); ``metadata`` and
        ``files`` as for :meth:`publish` (read now)."""
        self._check_open()
        snap = self._snapshot(state_dict, metadata, files, copy=True)
        future: Future[PublishResult] = Future()
        if self._worker is None:
            self._worker = threading.Thread(target=self._drain, name=f"bulletin-sharded-{self.run}", daemon=True)
            self._worker.start()
        self._queue.put((snap, future))
        return future

    def flush(self) -> None:
        """Wait for every queued step; raise the error that broke the publisher, if any."""
        self._queue.join()
        if self._broken is not None:
            raise self._broken

    def close(self) -> None:
        """Flush, stop the worker, move the head over the last version (rank 0). Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
            if self.rank == 0 and self._base.stored is not None:
                self._run.advance_head(self._base.stored)
        finally:
            self._closed = True
            if self._worker is not None:
                self._queue.put(None)
                self._worker.join()
            self._base.close()
            self._comm.destroy()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- the step ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInput("this ShardedPublisher is closed")
        if self._broken is not None:
            raise self._broken

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                snap, future = item
                if self._broken is not None:
                    future.set_exception(self._broken)
                    continue
                try:
                    future.set_result(self._step(snap, background=True))
                except BaseException as exc:
                    future.set_exception(exc)
            finally:
                self._queue.task_done()

    def _snapshot(
        self, state_dict: Mapping[str, Any], metadata: Mapping[str, str] | None, files: FilesArg, *, copy: bool
    ) -> _Snap:
        """This rank's part of a step. Errors are kept, not raised: the step must still
        meet the other ranks to fail there too."""
        try:
            checked = check_metadata(metadata or {}) if self.rank == 0 else {}
            given = prepare_files(files, self.dtype, cast=True) if self.rank == 0 else PreparedFiles(None)
            local, blocks = _split(state_dict)
            found = local_layout(local, self.dtype)
            specs = {name: TensorSpec(name, spec.dtype, blocks[name].shape) for name, spec in found.specs.items()}
            snap = _Snap(RankLayout(self.rank, specs, {n: blocks[n] for n in specs}, found.aliases))
            snap.metadata, snap.files = checked, given
            for name, value in found.values.items():
                source, served = found.source_dtypes[name], found.specs[name].dtype
                if copy:  # now: the caller may change its tensors once this returns
                    snap.bits.copies[name] = read_served(value, source, served, True)
                elif on_gpu(value):
                    snap.device[name] = value
                else:
                    snap.bits.reads[name] = (value, source, served)
            return snap
        except BaseException as exc:
            return _Snap(None, error=exc)

    def _at(self, phase: str, version: int) -> None:
        if self._hook is not None:
            self._hook(phase, version)

    def _agree(self, error: BaseException | None, what: str, payload: Any = None) -> list[Any]:
        """Every rank's ``payload``, once every rank says its part succeeded; otherwise
        this rank's own error, or ``RankFailed`` naming the rank that failed."""
        gathered = self._comm.all_gather((None if error is None else f"{type(error).__name__}: {error}", payload))
        failed = [(rank, message) for rank, (message, _) in enumerate(gathered) if message is not None]
        self._agreed = bool(failed)
        if error is not None:
            raise error
        if failed:
            rank, message = failed[0]
            raise RankFailed(f"rank {rank} failed while {what} ({message}); nothing was committed for this step")
        return [payload for _, payload in gathered]

    def _step(self, snap: _Snap, *, background: bool = False) -> PublishResult:
        self._agreed = False
        try:
            result = self._step_once(snap)
        except BaseException as exc:
            self._base.reset()  # a GPU block diffed or kept on its device holds bits not committed
            # A failure every rank met at the same agreement, in a synchronous publish,
            # leaves every rank at the committed version: the next publish may follow.
            # Anything else (a lost rank, a background step, a commit) breaks it for good.
            if background or not self._agreed:
                self._broken = (
                    exc
                    if isinstance(exc, RankFailed | VersionConflict)
                    else RankFailed(
                        f"a step failed ({type(exc).__name__}: {exc}); this publisher cannot continue "
                        "(restart the job, or a new ShardedPublisher on every rank resumes from the run)"
                    )
                )
            raise
        self.results.append(result)
        return result

    def _step_once(self, snap: _Snap) -> PublishResult:
        layout = self._agree_layout(snap)
        if not self._resumed:
            self._resume(layout)
        base = self._base
        version = (base.version or 0) + 1
        self._at("layout", version)
        # A new placement (blocks moved between ranks) as much as new tensors: no rank's
        # kept blocks are the base of its new ones, so the version is a keyframe.
        same_layout = base.version is not None and self._holds(layout)
        keyframe = not same_layout or (version - 1) % self.keyframe_every == 0
        if keyframe:
            return self._keyframe_step(version, layout, snap)
        return self._patch_step(version, layout, snap)

    def _agree_layout(self, snap: _Snap) -> Layout:
        """The step's layout. Each rank first says only whether it holds the blocks of the
        layout agreed last (O(1) per rank, not O(tensors) from every rank); the full
        descriptions are gathered and planned again only when one rank's changed."""
        unchanged = self._layout is not None and snap.layout == self._layout[0]
        if all(self._agree(snap.error, "taking its snapshot", unchanged)) and self._layout is not None:
            return self._layout[1]
        layouts = self._comm.all_gather(snap.layout)
        self._agreed = True  # plan_layout is deterministic: the same result (or error) on every rank
        layout = plan_layout(layouts)
        self._agreed = False
        if snap.layout is not None:  # pragma: no branch - an error was raised above
            self._layout = (snap.layout, layout)
        return layout

    def _resume(self, layout: Layout) -> None:
        """Hold the run's newest version (rank 0 settles an unknown commit first, reads
        the tip, broadcasts it); rebuild the owned blocks from the run when needed."""
        error: BaseException | None = None
        tip_doc: tuple[bytes, str, int] | None = None
        if self.rank == 0:
            try:
                if self._pending is not None:
                    self._run.commit(self._pending)
                    self._pending = None
                tip = self._run.tip()
                if tip is not None:
                    self._run.advance_head(tip)
                    tip_doc = (tip.manifest.model_dump_json().encode(), tip.digest, tip.size)
            except BaseException as exc:
                error = exc
        tip_doc = self._agree(error, "reading the run's tip", tip_doc)[0]
        tip = None
        if tip_doc is not None:
            tip = StoredManifest(parse_manifest(tip_doc[0]), tip_doc[1], tip_doc[2])
        owned = layout.owned(self.rank)
        if tip is None or dict(tip.manifest.specs) != layout.specs:
            self._base.forget(tip)  # nothing, or a new layout: the next version is a keyframe
            self._owners = {}
        elif not (self._base.stored is not None and self._base.stored.digest == tip.digest and self._holds(layout)):
            parts: dict[str, int] = {}
            try:
                self._base.open(tip, owned)  # the rank's cached blocks if they verify, else from the run
                parts = dict(self._base.parts)
            except BaseException as exc:
                error = exc
            sums = _sums(self._agree(error, "rebuilding its base from the run", parts))
            wrong = sorted(name for name in tip.manifest.specs if sums.get(name) != tip.manifest.fingerprints[name])
            if wrong:  # every rank alike: the same sums
                self._base.forget(tip)
                self._owners = {}
                raise FingerprintMismatch(
                    f"version {tip.version} rebuilt from the run misses the fingerprints of {', '.join(wrong[:3])}"
                )
            self._owners = layout.owners
        self._resumed = True

    def _holds(self, layout: Layout) -> bool:
        """Whether every rank's base holds the blocks it owns in ``layout``: the same answer
        on every rank (each compares the job's layouts, not only its own blocks), so that
        a change of placement on any rank makes the next version a keyframe everywhere."""
        return bool(self._owners) and dict(self._base.specs) == layout.specs and self._owners == layout.owners

    # -- a patch version -----------------------------------------------------------------

    def _patch_step(self, version: int, layout: Layout, snap: _Snap) -> PublishResult:
        base = self._base
        owned = layout.owned(self.rank)
        outgoing: list[list[tuple[str, NDArray[np.int64], Bits, int]]] = [[] for _ in range(self.world)]
        changes: dict[str, BlockChanges] = {}
        error: BaseException | None = None
        try:
            if not self._holds(layout) or base.blocks != owned:  # pragma: no cover - a keyframe step otherwise
                raise InternalError("the base does not hold this rank's blocks")
            for name in sorted(owned):
                change = changes[name] = self._changes(name, snap, layout.specs[name].dtype)
                outgoing[layout.writers[name]].append((name, change.delta.indices, change.delta.delta, change.part))
            base.device_only(set(owned) & set(snap.device))
        except BaseException as exc:
            error = exc
        self._agree(error, "diffing its blocks")
        self._at("diffed", version)
        incoming = self._comm.exchange(outgoing)
        del outgoing
        self._at("exchanged", version)
        shards: list[bytes] = []
        infos: dict[str, tuple[int, int]] = {}
        try:
            deltas = self._merge(layout, incoming, base.fingerprints)
            del incoming
            infos = {name: (td.target_fingerprint, td.changed) for name, td in deltas.items()}
            if deltas:
                shards = encode(Patch(deltas), max_shard_bytes=self.max_shard_bytes, codec=self.codec)
            del deltas
        except BaseException as exc:
            error = exc
        everyone = self._agree(error, "encoding its tensors", (infos, len(shards)))
        self._at("encoded", version)
        targets: dict[str, tuple[int, int]] = {}
        for part, _ in everyone:
            targets.update(part)
        tensor_infos = {
            name: TensorInfo(layout.specs[name], base.fingerprints[name], *targets[name]) for name in sorted(targets)
        }
        patch_id = compute_patch_id(tensor_infos)
        first = sum(count for _, count in everyone[: self.rank])
        total = sum(count for _, count in everyone)
        refs: list[ObjectRef] = []
        try:
            items: dict[str, bytes] = {}
            for i, encoded in enumerate(shards):
                data = renumber(encoded, patch_id, first + i, total)
                digest = sha256_hex(data)
                key = patch_shard_key(version, digest)
                refs.append(ObjectRef(key=key, size=len(data), sha256=digest))
                items[key] = data
            del shards
            self._run.upload(items)
        except BaseException as exc:
            error = exc
        all_refs = self._agree(error, "uploading its shards", refs)
        self._at("uploaded", version)
        fps = {name: target for name, (target, _) in targets.items()}
        changed = sum(changed for _, changed in targets.values())
        patch_ref = PatchRef(
            codec=self.codec, shards=tuple(r for part in all_refs for r in part), changed_elements=changed
        )
        stored, uploaded = self._commit(version, layout, fps, patch_ref, None, snap)
        parts = {name: change.delta.target_fingerprint for name, change in changes.items()}
        base.advance(stored, changes=changes, parts=parts)
        self._owners = layout.owners
        self._at("advanced", version)
        return self._result(stored, snap, uploaded)

    def _merge(
        self,
        layout: Layout,
        incoming: list[list[tuple[str, NDArray[np.int64], Bits, int]]],
        base_fps: Mapping[str, int],
    ) -> dict[str, TensorDelta]:
        """The whole change of each tensor this rank writes, from every owner's part."""
        parts: dict[str, list[tuple[NDArray[np.int64], Bits, int]]] = {}
        for sent in incoming:
            for name, gidx, delta, fpd in sent:
                parts.setdefault(name, []).append((gidx, delta, fpd))
        deltas: dict[str, TensorDelta] = {}
        for name in layout.written(self.rank):
            spec = layout.specs[name]
            got = parts.get(name, [])
            indices = np.concatenate([g for g, _, _ in got]) if got else np.empty(0, np.int64)
            delta = np.concatenate([d for _, d, _ in got]) if got else np.empty(0, spec.bits_dtype)
            if indices.size > 1 and not bool(np.all(indices[1:] > indices[:-1])):
                order = np.argsort(indices, kind="stable")  # blocks of a Shard(1) interleave
                indices, delta = indices[order], delta[order]
            target = (base_fps[name] + sum(fpd for _, _, fpd in got)) & _MASK64
            deltas[name] = TensorDelta(spec, indices.astype(np.int64, copy=False), delta, base_fps[name], target)
        return deltas

    def _changes(self, name: str, snap: _Snap, served: str) -> BlockChanges:
        """The change of this rank's block of ``name``: found on its device where the device
        holds the committed bits (only the change crosses to the host), else on the host
        (a GPU block's served bits copied over once, and kept on its device from now on)."""
        base = self._base
        value = snap.device.get(name)
        if value is None:
            src, source = snap.bits.source(name, served)
            return base.diff(name, src, source)
        found = base.device_changes(name, value)
        return found if found is not None else base.diff(name, base.device_keep(name, value))

    # -- a keyframe version ----------------------------------------------------------------

    def _keyframe_step(self, version: int, layout: Layout, snap: _Snap) -> PublishResult:
        """Each file of the keyframe has a writer rank (round-robin); a block its owner
        does not write travels to it (the one place a step moves bits, not changes:
        docs/SHARDED.md), one block at a time, into the file's memory map. Each rank
        first writes its blocks to a new folder of its cache: the base, once committed."""
        owned = layout.owned(self.rank)
        error: BaseException | None = None
        staged: StagedKeyframe | None = None
        written: Checkpoint | None = None
        kept: dict[str, Bits] = {}
        parts: dict[str, int] = {}
        try:
            try:
                specs = {name: TensorSpec(name, layout.specs[name].dtype, b.sizes) for name, b in owned.items()}
                staged = self._base.stage(specs, _ONE_FILE, blocks=owned, hashed=False)
                for name in sorted(owned):
                    value = snap.device.get(name)  # a GPU block is kept on its device from now on
                    bits = snap.bits.take(name) if value is None else self._base.device_keep(name, value)
                    parts[name] = part_fingerprint(owned[name], bits)
                    staged.write(name, bits)
                    del bits
                staged.finish()
                self._base.device_only(set(owned) & set(snap.device))
                written = Checkpoint(staged.folder)  # read back through a map: page cache, not this process's memory
                kept = {name: written.bits(name) for name in owned}
            except BaseException as exc:
                error = exc
            # Rank 0's attempt token names the keyframe's folder on every rank: a step that
            # failed half-way and runs again with other bits never meets the files it left.
            everyone = self._agree(error, "reading its blocks", (parts, secrets.token_hex(4)))
            self._at("diffed", version)
            fps = _sums([part for part, _ in everyone])
            files = plan_checkpoint(layout.specs, self.keyframe_file_bytes)
            folder = Path(tempfile.mkdtemp(prefix="bulletin-keyframe-", dir=self._scratch))
            refs: list[tuple[int, ObjectRef]] = []
            prefix = keyframe_prefix(version, self.writer, everyone[0][1])
            try:
                error = self._write_keyframe_files(files, layout, kept, folder)
                self._at("exchanged", version)
                self._at("encoded", version)
                if error is None:
                    try:
                        refs = self._upload_keyframe_files(files, folder, prefix)
                    except BaseException as exc:
                        error = exc
                all_refs = self._agree(error, "writing its keyframe files", refs)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            self._at("uploaded", version)
            ordered = tuple(ref for _, ref in sorted((i, r) for part in all_refs for i, r in part))
            keyframe_ref = KeyframeRef(prefix=prefix, files=ordered)
            stored, uploaded = self._commit(version, layout, fps, None, keyframe_ref, snap)
        except BaseException:
            if staged is not None:
                staged.discard()
            raise
        finally:
            kept = {}  # views of the map, closed now
            if written is not None:
                written.close()
        self._base.advance(stored, staged=staged, parts=parts)
        self._owners = layout.owners
        self._at("advanced", version)
        return self._result(stored, snap, uploaded)

    def _write_keyframe_files(
        self, files: list[tuple[str, list[TensorSpec]]], layout: Layout, kept: Mapping[str, Bits], folder: Path
    ) -> BaseException | None:
        """Write this rank's files, in the one order every rank walks (file, tensor, block),
        so that each send meets its receive. A local failure is returned, not raised,
        after the walk: the other ranks' sends and receives must still be met. Blocks go
        to their places with ``pwrite`` (a run of the tensor's flat elements at a time), not
        through a memory map: the file's pages then stay in the page cache instead of the
        writer's resident set, which holds one received block at most."""
        error: BaseException | None = None
        for index, (file_name, specs) in enumerate(files):
            mine = index % self.world == self.rank
            fd: int | None = None
            offsets: dict[str, tuple[int, int]] = {}
            data_start = 0
            if mine and error is None:
                try:
                    header, offsets = encode_safetensors_header(specs, {"format": "pt"})
                    data_start = len(header)
                    with open(folder / file_name, "wb") as fh:
                        fh.write(header)
                        fh.truncate(data_start + sum(spec.nbytes for spec in specs))
                    fd = os.open(folder / file_name, os.O_WRONLY)
                except BaseException as exc:
                    error = exc
            try:
                for spec in specs:
                    for owner, block in layout.owners[spec.name]:
                        if block.numel == 0 or (not mine and owner != self.rank):
                            continue
                        if owner == self.rank and not mine:
                            self._comm.send(kept[spec.name], index % self.world)
                            continue
                        bits = (
                            kept[spec.name]
                            if owner == self.rank
                            else self._comm.recv(block.numel * spec.width, owner).view(spec.bits_dtype)
                        )
                        if fd is None or error is not None:
                            continue
                        try:
                            _write_block(fd, data_start + offsets[spec.name][0], spec.width, block, bits)
                        except BaseException as exc:
                            error = exc
            finally:
                if fd is not None:
                    os.close(fd)
        return error

    def _upload_keyframe_files(
        self, files: list[tuple[str, list[TensorSpec]]], folder: Path, prefix: str
    ) -> list[tuple[int, ObjectRef]]:
        refs: list[tuple[int, ObjectRef]] = []
        for index, (file_name, _) in enumerate(files):
            if index % self.world == self.rank:
                refs.append((index, self._put_file(f"{prefix}/{file_name}", folder / file_name)))
        if len(files) > 1 and self.rank == 0:
            path = folder / INDEX_NAME
            path.write_bytes(hf_index(files))
            refs.append((len(files), self._put_file(f"{prefix}/{INDEX_NAME}", path)))
        return refs

    def _put_file(self, key: str, path: Path) -> ObjectRef:
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
        ref = ObjectRef(key=key, size=path.stat().st_size, sha256=digest.hexdigest())
        if isinstance(self._run.store.put_file_if_absent(self._run.key(key), path), Conflicted):
            raise VersionConflict(f"{self._run.key(key)}: exists already (another writer of this version?)")
        return ref

    # -- the commit ------------------------------------------------------------------------

    def _commit(
        self,
        version: int,
        layout: Layout,
        fps: Mapping[str, int],
        patch_ref: PatchRef | None,
        keyframe_ref: KeyframeRef | None,
        snap: _Snap,
    ) -> tuple[StoredManifest, int]:
        """Rank 0 checks the run still ends at the parent, uploads the version's new model
        files, creates the manifest (the commit point) and broadcasts the outcome; every
        rank returns the committed manifest and the files' bytes uploaded (rank 0's), or
        raises the commit's error."""
        outcome = _Outcome(None, "", "", "")
        failure: BaseException | None = None
        committed: StoredManifest | None = None
        uploaded = 0
        if self.rank == 0:
            manifest: ManifestV1 | None = None
            try:
                parent = self._base.stored
                self._check_parent(parent)
                files, uploaded = upload_files(self._run, version, self._base.files, snap.files.files)  # sticky
                manifest = build_manifest(
                    self.run,
                    self.writer,
                    version,
                    parent,
                    layout.specs,
                    fps,
                    patch_ref,
                    keyframe_ref,
                    files,
                    snap.metadata,
                )
                self._at("manifest", version)
                committed = self._run.commit(manifest)
                # The other ranks parse what rank 0 committed; rank 0 keeps its own.
                sent = committed.manifest.model_dump_json().encode() if self.world > 1 else None
                outcome = _Outcome(sent, committed.digest, "", "")
                self._at("committed", version)
            except BaseException as exc:
                if isinstance(exc, StorageUnavailable) and not isinstance(exc, AccessDenied):
                    self._pending = manifest  # the manifest may exist: settled before anything else
                failure = exc
                outcome = _Outcome(None, "", str(exc), type(exc).__name__)
        outcome = self._comm.broadcast(outcome)
        if outcome.kind:
            # Every rank learnt the same outcome: a synchronous publish may follow, and
            # first reads the run again (rank 0 settling a commit left unknown).
            self._agreed = True
            self._resumed = False
            if failure is not None:
                raise failure
            if outcome.kind == "VersionConflict":
                raise VersionConflict(f"version {version}: {outcome.error}")
            raise RankFailed(f"the commit of version {version} failed on rank 0 ({outcome.kind}: {outcome.error})")
        if committed is not None:
            return committed, uploaded
        if outcome.manifest is None:  # pragma: no cover - a committed outcome carries it
            raise InternalError(f"version {version}: committed without a manifest")
        return StoredManifest(parse_manifest(outcome.manifest), outcome.digest, len(outcome.manifest)), 0

    def _check_parent(self, parent: StoredManifest | None) -> None:
        head = self._run.read_head()
        if (
            parent is not None
            and head is not None
            and (head.head.version, head.head.manifest_digest)
            == (
                parent.version,
                parent.digest,
            )
        ):
            return
        tip = self._run.tip()
        found = (tip.version, tip.digest) if tip is not None else None
        if found != ((parent.version, parent.digest) if parent is not None else None):
            raise VersionConflict(
                f"{self.run}: the run's newest version is {tip.version if tip else 'none'}, but this job "
                f"continues {parent.version if parent else 'none'}: another trainer is publishing to it"
            )

    def _result(self, stored: StoredManifest, snap: _Snap, uploaded: int) -> PublishResult:
        return publish_result(stored.manifest, stored, files_uploaded=uploaded, notes=snap.files.notes)


def _write_block(fd: int, tensor_start: int, width: int, block: Block, bits: Bits) -> None:
    """``bits`` (the block's, C order) into their places in the tensor stored from byte
    ``tensor_start`` of the file ``fd``."""
    data = np.ascontiguousarray(bits).reshape(-1).view(np.uint8).data
    starts, run = block_runs(block)
    step = run * width
    for k, start in enumerate(starts.tolist()):
        pwrite_all(fd, data[k * step : (k + 1) * step], tensor_start + start * width)
