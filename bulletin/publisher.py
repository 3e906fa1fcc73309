"""Trainer side: publish each new state of the weights as an immutable version.

>>> pub = Publisher("s3://bucket/runs", "llama-grpo", keyframe_every=50)
>>> for step in range(steps):
...     train_step()
...     pub.publish_async(model.state_dict())   # returns once the state is diffed; uploads in the background
>>> pub.close()                                  # waits for the queue; raises the first error

One step publishes a version, from one process (:class:`Publisher`) or from every rank
of a sharded trainer (:class:`~bulletin.distributed.ShardedPublisher`, this publisher
over a group of ranks: docs/SHARDED.md); a Publisher is its one-rank case, the same
code. Each rank diffs the blocks it owns (every tensor whole, for a Publisher) against
its base of the next diff, which one object owns (:class:`~bulletin.base.PublishedBase`):
the bits of the last committed version in memory-mapped files of a local cache
directory (verified against the run when a publisher starts, rebuilt from it when
missing or stale), and for CUDA tensors a copy on their GPU. Each change goes to the
tensor's writer rank (a rank's own, O(changed), never pickled), which encodes the
tensor's patch entries; every rank uploads its shards, rank 0 creates the manifest
(the commit point) and tells every rank the outcome; only then does any base advance
and the head move. Version 1, every ``keyframe_every``-th version after it, and any
change of layout are also stored in full as plain safetensors: a rank that owns every
tensor writes them into its cache and uploads those files, each one as soon as it is
written (a local store on the same file system takes the file itself:
:mod:`bulletin.shared_files`); otherwise every rank writes its share
(:mod:`bulletin.distributed.keyframe_files`). A restarted trainer resumes from the
run's newest version, so the chain continues without a gap.

Memory beyond the caller's tensors is bounded: one tensor's cast at a time and the
changes found (O(changed elements)), never a copy of the model, for :meth:`~Publisher.
publish`, :meth:`~Publisher.publish_checkpoint` (read through memory maps) and a patch
version of a Publisher's :meth:`~Publisher.publish_async`, which diffs each tensor when
it is called, against the last committed version and the versions queued since, and
queues only the changes. A keyframe version of ``publish_async`` (the first, a new
layout, every ``keyframe_every``-th) is stored whole, so it holds one private copy of
each host tensor (its cast to the served dtype, or a plain copy) until it is committed;
a rank of a sharded job copies its blocks at every ``publish_async`` (its layout is
agreed with the other ranks only in the step).

A version may carry the model's non-tensor files (``files=``: config, tokenizer, ...;
:mod:`bulletin.model_files`), which every node folder then holds beside the tensors.
They are sticky: a publish without ``files`` keeps the previous version's, and a file
whose bytes did not change is never uploaded again (the new manifest names the object
its parent named).

A publish that fails leaves the publisher consistent: the base of the next diff is
still the last committed version (the versions queued after it were diffed against it:
they are refused with its error, and the base lets their changes go). One whose commit
failed with its outcome unknown (``StorageUnavailable``: the manifest may have been
created, its response lost) is settled before the next publish by committing the same
manifest again, which finds the manifest if it landed; either way the version is then
committed and the chain continues from it. A version committed meanwhile by another
writer makes that and every later publish of this publisher raise ``VersionConflict``.
A sharded job continues after a failure of a synchronous publish that every rank met
alike; any other failure (a rank lost, a background step) breaks it for good
(:class:`~bulletin.errors.RankFailed`): its ranks' queues are not in step any more.
"""

from __future__ import annotations

import dataclasses
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
from typing import Any, ClassVar, Final, Self

import numpy as np
from numpy.typing import NDArray

from bulletin.base import PublishedBase
from bulletin.blocks import Block, BlockChanges, part_fingerprint
from bulletin.checkpoint import INDEX_NAME, Checkpoint, hf_index, plan_checkpoint
from bulletin.collector import collector_paused
from bulletin.distributed.comm import Comm
from bulletin.distributed.keyframe_files import write_keyframe_files
from bulletin.distributed.parts import Layout, RankLayout, plan_layout, run_parts, tally, totals
from bulletin.distributed.shards import renumber
from bulletin.errors import (
    AccessDenied,
    ChainMismatch,
    ConfigError,
    Conflict,
    DigestMismatch,
    FingerprintMismatch,
    InternalError,
    InvalidInput,
    ObjectTooLarge,
    RankFailed,
    RunRewound,
    StorageUnavailable,
    VersionConflict,
)
from bulletin.keyframe_stage import KeyframeFile, StagedKeyframe
from bulletin.keyframe_upload import KeyframeUpload
from bulletin.keyspace import keyframe_prefix, patch_shard_key
from bulletin.model_files import select_model_files
from bulletin.published import (
    FilesArg,
    PreparedFiles,
    PublishResult,
    build_manifest,
    prepare_files,
    publish_result,
    upload_files,
)
from bulletin.run import Run, StoredManifest, sha256_hex
from bulletin.signing import Signer, as_signer
from bulletin.snapshot import TensorBits, cast_served, take_snapshot
from bulletin.storage import Conflicted, Store, open_store, require_writable
from bulletin.sync import check_chain
from bulletin.target import Held
from patcher.compression import AUTO_CODEC, CONTEXT_CODEC, PUBLISH_CODECS, check_codec, check_patch_codec
from patcher.dtypes import FLOAT_DTYPES, SERVED_FLOAT_DTYPES
from patcher.encode import TensorPart, encode, encode_parts, encode_smallest
from patcher.format import TensorInfo, compute_patch_id
from patcher.patch import Patch, TensorDelta, TensorSpec
from schemas.manifest import KeyframeRef, ManifestV1, ObjectRef, PatchRef, PatchRefV2, check_metadata, parse_manifest

__all__ = [
    "PHASES",
    "FilesArg",
    "PreparedFiles",
    "PublishResult",
    "Publisher",
    "build_manifest",
    "prepare_files",
    "publish_result",
    "upload_files",
]

_MASK64: Final = (1 << 64) - 1
_DEFAULT_SHARD_BYTES: Final = 64 << 20
_DEFAULT_KEYFRAME_FILE_BYTES: Final = 1 << 30
#: A rank's blocks of a keyframe go to one file of its cache, whatever their size.
_ONE_FILE: Final = 1 << 62
#: Phases a test may stop a rank at (``_hook``), in the order a step passes them.
PHASES: Final = ("layout", "diffed", "exchanged", "encoded", "uploaded", "manifest", "committed", "advanced")

Bits = NDArray[np.unsignedinteger]
#: What a tensor's change travels to its writer as: name, global indices, deltas.
_Sent = tuple[str, NDArray[np.int64], Bits]


@dataclass(slots=True)
class _Snap:
    """One step as this rank took it: its layout and each block's bits, or the error
    taking it raised (the step then fails on every rank)."""

    layout: RankLayout | None
    error: BaseException | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    #: The version's model files (rank 0's; None keeps the previous version's).
    files: PreparedFiles = field(default_factory=lambda: PreparedFiles(None))
    #: The blocks' bits: copied or diffed when the snapshot was taken, else read in
    #: place when the step needs them.
    bits: TensorBits = field(default_factory=TensorBits)
    #: GPU blocks of a sharded rank's synchronous publish: diffed (or kept) on their device at the step.
    device: dict[str, Any] = field(default_factory=dict)
    #: Changes found when the snapshot was taken against the base of the next diff (a
    #: Publisher's, which kept or diffed its GPU tensors then too), and the version it
    #: was taken for; None when taken without the base.
    changes: dict[str, TensorDelta] = field(default_factory=dict)
    version: int | None = None


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What rank 0 tells every rank after its commit."""

    manifest: tuple[bytes, str, int] | None  # the committed manifest (_shared), for the other ranks
    error: str
    kind: str  # "" when committed, else the error's class name
    unknown: bool = False  # whether the manifest may have been created anyway


@dataclass(frozen=True, slots=True)
class _Pending:
    """A version whose commit failed with its outcome unknown, and what this rank's base
    advances with once it is settled as committed (the manifest: rank 0's)."""

    manifest: ManifestV1 | None
    owners: dict[str, list[tuple[int, Block]]]
    changes: dict[str, BlockChanges]
    staged: StagedKeyframe | None
    parts: dict[str, int]
    files_uploaded: int
    notes: tuple[str, ...]


def _sums(parts: list[dict[str, int]]) -> dict[str, int]:
    """Every tensor's fingerprint: the sum of its blocks' parts from every rank."""
    fps: dict[str, int] = {}
    for part in parts:
        for name, fp in part.items():
            fps[name] = (fps.get(name, 0) + fp) & _MASK64
    return fps


def _whole_owners(specs: Mapping[str, TensorSpec]) -> dict[str, list[tuple[int, Block]]]:
    """The owners of a one-rank layout of ``specs``: rank 0, each tensor whole."""
    return {name: [(0, Block.whole(spec.shape))] for name, spec in specs.items()}


def _shared(stored: StoredManifest | None) -> tuple[bytes, str, int] | None:
    return None if stored is None else (stored.manifest.model_dump_json().encode(), stored.digest, stored.size)


def _unshared(doc: tuple[bytes, str, int] | None) -> StoredManifest | None:
    return None if doc is None else StoredManifest(parse_manifest(doc[0]), doc[1], doc[2])


class Publisher:
    """Publishes versions of one run, one process. Not thread-safe: one trainer process,
    one Publisher (one per rank: :class:`~bulletin.distributed.ShardedPublisher`)."""

    #: The codecs this publisher encodes with.
    _codecs: ClassVar[tuple[str, ...]] = PUBLISH_CODECS
    #: Where a sharded rank writes its files of a keyframe before they are uploaded.
    _scratch: Path | None = None

    def __init__(
        self,
        store: str | os.PathLike[str] | Store,
        run: str,
        *,
        dtype: str = "BF16",
        keyframe_every: int = 10,
        codec: str = AUTO_CODEC,
        max_shard_bytes: int = _DEFAULT_SHARD_BYTES,
        keyframe_file_bytes: int = _DEFAULT_KEYFRAME_FILE_BYTES,
        max_workers: int = 8,
        queue_size: int = 2,
        on_bytes: Callable[[int], None] | None = None,
        signing_key: Signer | str | os.PathLike[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        """``signing_key``: a :class:`~bulletin.signing.Signer` or a private key file; every
        manifest and head this publisher writes is then signed (docs/SECURITY.md).
        ``cache_dir``: where the last committed version's bits are kept, memory-mapped
        (default: ``$BULLETIN_CACHE_DIR``, else the platform's cache folder, under
        ``bulletin/publisher/<store>/<run>``; a temporary folder for a memory store)."""
        if dtype not in SERVED_FLOAT_DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(SERVED_FLOAT_DTYPES)}, not {dtype!r}")
        if keyframe_every < 1:
            raise ConfigError("keyframe_every must be >= 1")
        if codec not in self._codecs:
            raise ConfigError(f"codec must be one of {', '.join(map(repr, self._codecs))}, not {codec!r}")
        if queue_size < 1 or max_shard_bytes < 1 << 10 or keyframe_file_bytes < 1 << 10:
            raise ConfigError("queue_size >= 1; max_shard_bytes and keyframe_file_bytes >= 1 KiB")
        opened = open_store(store) if isinstance(store, str | os.PathLike) else store
        require_writable(opened, "publishing")  # before a model is cast, diffed or uploaded
        # Rank 0 alone writes manifests and heads: the other ranks may pass no key.
        self._run = Run(opened, run, max_workers=max_workers, signer=as_signer(signing_key))
        self.dtype = dtype
        self.keyframe_every = keyframe_every
        self.codec = codec
        self.max_shard_bytes = max_shard_bytes
        self.keyframe_file_bytes = keyframe_file_bytes
        self._on_bytes = on_bytes
        self._comm = self._connect()
        self.rank, self.world = self._comm.rank, self._comm.world
        self.writer = str(self._comm.broadcast(secrets.token_hex(8)))  # one writer id for the job
        self._base = PublishedBase(self._run, dtype, cache_dir, subfolder=self._cache_subfolder())
        #: The owners of every block when the base's blocks were made: the same on every rank.
        self._owners: dict[str, list[tuple[int, Block]]] = {}
        self._layout: tuple[RankLayout, Layout] | None = None  # this rank's blocks, and the layout agreed
        self._resumed = False
        self._queue: queue.Queue[tuple[_Snap, Future[PublishResult], int] | None] = queue.Queue(maxsize=queue_size)
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None  # the first background error, raised by flush
        self._broken: BaseException | None = None  # what broke a sharded job for good
        # After a failed publish: snapshots taken before it (an older epoch) are refused
        # with its error, and the next step first settles it (_recover).
        self._failed = False
        self._epoch = 0
        self._epoch_error: BaseException | None = None
        self._pending: _Pending | None = None
        self._closed = False
        self.results: list[PublishResult] = []
        self._hook: Callable[[str, int], None] | None = None  # tests: called at each phase
        self._agreed = False  # the current step's failure was met by every rank alike

    def _connect(self) -> Comm:
        """The collectives of this publisher's ranks: none, for one process."""
        return Comm(None, 0, 1)

    def _cache_subfolder(self) -> str | None:
        return None

    # -- public API --------------------------------------------------------------------

    @property
    def run(self) -> str:
        return self._run.name

    @property
    def version(self) -> int | None:
        """The last version committed (on every rank of a sharded job), or resumed from."""
        return self._base.version

    @property
    def cache_dir(self) -> Path:
        """The folder holding the base of the next diff (a rank's own, for a sharded job;
        see ``cache_dir=``)."""
        return self._base.cache_dir

    def publish(
        self, state_dict: Mapping[str, Any], *, metadata: Mapping[str, str] | None = None, files: FilesArg = None
    ) -> int:
        """Publish synchronously (every rank of a sharded job with its own part); returns
        the new version number.

        The tensors are read while this runs, one at a time (a zero-copy view of a tensor
        already in the served dtype, else its cast): do not change them from another
        thread meanwhile. ``files``: the version's model files (:data:`FilesArg`; None
        keeps the previous version's). Floating tensors are served as ``dtype``, and so a
        ``config.json`` among them names ``dtype``
        (:func:`~bulletin.model_files.with_served_dtype`; the result's ``notes`` say what
        changed). ``metadata`` and ``files`` of a sharded job are rank 0's."""
        self._check_open()
        self.flush()
        return self._step(self._snapshot(state_dict, metadata, files, copy=False)).version

    def publish_checkpoint(
        self,
        path: str | os.PathLike[str],
        *,
        metadata: Mapping[str, str] | None = None,
        files: FilesArg = None,
        keep_files: bool = False,
        cast: bool = False,
    ) -> PublishResult:
        """Publish a safetensors checkpoint (file or directory), read through memory maps.

        ``cast``: serve floating tensors as ``dtype``, cast exactly as :meth:`publish`
        casts them (:func:`~bulletin.snapshot.cast_served`), with ``config.json`` naming
        it; without, the checkpoint's dtypes are served as they are. ``files``: the
        version's model files; None takes a directory's own (the default rule of
        :func:`~bulletin.model_files.select_model_files`), or, for a single file or a
        directory without any, keeps the previous version's; ``keep_files`` keeps the
        previous version's whatever the directory holds. The files must not change
        while this runs.
        """
        self._check_open()
        checked = check_metadata(metadata or {})
        if keep_files and files is not None:
            raise ConfigError("give files or keep_files, not both")
        if files is None and not keep_files and Path(path).is_dir():
            selected = select_model_files(path)
            files = selected if len(selected) else None
        given = prepare_files(files, self.dtype, cast=cast)
        self.flush()
        with Checkpoint(path) as ckpt:
            specs: dict[str, TensorSpec] = {}
            snap = _Snap(None, metadata=checked, files=given)
            for name, spec in ckpt.specs.items():
                served = self.dtype if cast and spec.dtype in FLOAT_DTYPES else spec.dtype
                specs[name] = TensorSpec(name, served, spec.shape)
                if spec.dtype in (served, "F32"):
                    # A view of the map: zero copies (an F32 tensor cast inside the diff).
                    snap.bits.reads[name] = (ckpt.bits(name), spec.dtype, served)
                    continue

                def read(name: str = name, dtype: str = spec.dtype) -> Any:
                    return cast_served(ckpt.bits(name), dtype, self.dtype)[1]  # torch's rounding

                snap.bits.later[name] = read
            snap.layout = RankLayout.whole(self.rank, specs, {})
            return self._step(snap)

    def publish_async(
        self, state_dict: Mapping[str, Any], *, metadata: Mapping[str, str] | None = None, files: FilesArg = None
    ) -> Future[PublishResult]:
        """Diff now, encode, upload and commit in the background; blocks only when the
        bounded queue is full. Errors surface from the future and from flush/close.
        ``files`` as for :meth:`publish` (read now).

        Returns once the caller may change its tensors again, having read each one once
        (do not change them from another thread while it runs):

        - a host tensor of a patch version was read (a zero-copy view, or its cast to
          ``dtype``: one tensor's at a time) and diffed against the base of the next
          diff (the last committed version and the versions queued before this one);
          only its change is kept (O(changed elements));
        - a host tensor of a keyframe version (the first, a new layout, every
          ``keyframe_every``-th) was copied once (its cast, or a plain copy when it is
          served as it is), held until the keyframe is committed;
        - a CUDA tensor was read on its device with the device's kernels finished (its
          change since the last snapshot, or for a keyframe its served bits, is on the
          host);
        - on a rank of a sharded job, each block was copied (its cast, or a plain copy).

        Writes to the tensors after that, from any stream or thread, do not reach the
        version published."""
        self._check_open()
        self._raise_background_error()
        epoch = self._epoch  # read before the snapshot: a failure from now on refuses it
        snap = self._snapshot(state_dict, metadata, files, copy=True)
        future: Future[PublishResult] = Future()
        if self._worker is None:
            self._worker = threading.Thread(target=self._drain, name=f"bulletin-publish-{self.run}", daemon=True)
            self._worker.start()
        self._queue.put((snap, future, epoch))
        return future

    def refresh_head(self) -> bool:
        """Sign the head again, now, if it still names this publisher's last version: call it
        more often than readers' ``max_head_age`` while no version is published (a quiet
        trainer's heartbeat; docs/SECURITY.md). Needs ``signing_key`` (rank 0's, which
        alone writes the head); returns whether the head was refreshed."""
        self._check_open()
        self.flush()
        committed = self._base.stored
        return self.rank == 0 and committed is not None and self._run.refresh_head(committed)

    def flush(self) -> None:
        """Wait until every queued publish is committed; raise the first background error
        (or the one that broke a sharded job)."""
        self._queue.join()
        if self._broken is not None:
            raise self._broken
        self._raise_background_error()

    def close(self) -> None:
        """Flush, make sure the head shows the last version (rank 0), then stop the
        background worker and release the cache. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
            committed = self._base.stored
            if self.rank == 0 and committed is not None and not self._failed:
                # A commit only logs a store failure while moving the head; move it now.
                self._run.advance_head(committed)
        finally:
            self._closed = True
            if self._worker is not None:
                self._queue.put(None)
                self._worker.join()
            if self._pending is not None and self._pending.staged is not None:
                self._pending.staged.discard()
            self._base.close()
            self._comm.destroy()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- the snapshot --------------------------------------------------------------------

    @property
    def _ranked(self) -> bool:
        """Whether diffs rank their changes as they go (the codec may be the context one)."""
        return self.codec in (AUTO_CODEC, CONTEXT_CODEC)

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInput(f"this {type(self).__name__} is closed")
        if self._broken is not None:
            raise self._broken

    def _raise_background_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _snapshot(
        self, state_dict: Mapping[str, Any], metadata: Mapping[str, str] | None, files: FilesArg, *, copy: bool
    ) -> _Snap:
        """This rank's part of a step (with ``copy``, all that must happen before the
        caller may touch its tensors). Bad input is refused here, having changed
        nothing; on a rank of a sharded job it is kept instead, for the step to fail on
        every rank."""
        try:
            checked = check_metadata(metadata or {}) if self.rank == 0 else {}
            given = prepare_files(files, self.dtype, cast=True) if self.rank == 0 else PreparedFiles(None)
        except BaseException as exc:
            if self.world == 1:
                raise
            return _Snap(None, error=exc)
        try:
            snap = self._take(state_dict, copy=copy)
        except BaseException as exc:
            if self.world == 1:
                self._failed = True  # tensors diffed before the failure moved the base of the next diff on
                raise
            return _Snap(None, error=exc)
        snap.metadata, snap.files = checked, given
        return snap

    def _take(self, state_dict: Mapping[str, Any], *, copy: bool) -> _Snap:
        """The tensors of one process, taken against the base of the next diff
        (:func:`~bulletin.snapshot.take_snapshot`): with ``copy``, a patch version's host
        tensors diffed now, a keyframe's copied."""
        self._ready(join=True)
        base = self._base
        full = (base.next_version - 1) % self.keyframe_every == 0
        taken = take_snapshot(state_dict, dtype=self.dtype, base=base, full=full, copy=copy, ranked=self._ranked)
        layout = RankLayout.whole(self.rank, taken.specs, taken.aliases)
        return _Snap(layout, bits=taken.bits, changes=taken.changes, version=taken.version)

    # -- the step ------------------------------------------------------------------------

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                snap, future, epoch = item
                if self._broken is not None:
                    future.set_exception(self._broken)
                    continue
                if epoch != self._epoch:  # keep order: nothing taken before a failed version
                    future.set_exception(self._epoch_error or InternalError("a publish failed"))
                    continue
                try:
                    future.set_result(self._step(snap, background=True))
                except BaseException as exc:
                    if self._error is None:
                        self._error = exc
                    future.set_exception(exc)
            finally:
                self._queue.task_done()

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

    def _from_rank0(self, error: BaseException | None, what: str, payload: Any = None) -> Any:
        """Rank 0's ``payload`` on every rank, or its ``error``: raised on rank 0 as it is,
        on the others as a ``VersionConflict`` (when it was one) or ``RankFailed``."""
        kind = "" if error is None else type(error).__name__
        kind, message, payload = self._comm.broadcast((kind, str(error or ""), payload))
        if not kind:
            return payload
        self._agreed = True
        if error is not None:
            raise error
        if kind == "VersionConflict":
            raise VersionConflict(f"{what}: {message}")
        raise RankFailed(f"rank 0 failed while {what} ({kind}: {message}); nothing was committed for this step")

    def _manifest_from_rank0(
        self, error: BaseException | None, what: str, stored: StoredManifest | None
    ) -> StoredManifest | None:
        """Rank 0's ``stored`` on every rank (serialised only between processes), or its
        error as :meth:`_from_rank0` raises it."""
        if self.world == 1:
            if error is not None:
                raise error
            return stored
        return _unshared(self._from_rank0(error, what, _shared(stored)))

    def _step(self, snap: _Snap, *, background: bool = False) -> PublishResult:
        self._agreed = False
        try:
            result = self._step_once(snap)
        except BaseException as exc:
            self._failure(exc)
            # One process, or a failure every rank met at the same agreement in a
            # synchronous publish, leaves every rank at the committed version: the next
            # publish may follow. Anything else (a lost rank, a background step, whose
            # ranks' queues are not in step any more) breaks a sharded job for good.
            if self.world > 1 and (background or not self._agreed):
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

    def _failure(self, exc: BaseException) -> None:
        """A step failed: later snapshots may have been diffed (on the host or a device)
        against bits that were not committed. Refuse those; the next step recovers first."""
        self._failed = True  # before the epoch moves on (publish_async reads them the other way)
        self._epoch_error = exc
        self._epoch += 1

    def _step_once(self, snap: _Snap) -> PublishResult:
        layout = self._agree_layout(snap)
        self._ready(layout)
        base = self._base
        version = (base.version or 0) + 1
        if snap.version is not None and snap.version != version:
            raise InternalError(f"a snapshot taken for version {snap.version} reached the commit of {version}")
        self._at("layout", version)
        # A new placement (blocks moved between ranks) as much as new tensors: no rank's
        # kept blocks are the base of its new ones, so the version is a keyframe.
        same_layout = base.version is not None and self._holds(layout)
        keyframe = not same_layout or (version - 1) % self.keyframe_every == 0
        if keyframe and snap.changes:  # cannot happen: snapshots of keyframes are taken in full
            raise InternalError("a keyframe version was diffed when its snapshot was taken")
        if keyframe:
            return self._keyframe_step(version, layout, snap, same_layout)
        # A patch step is short (O(its blocks)): the collector waits for its end. Not a
        # keyframe's, which may run for minutes while the trainer's threads make garbage.
        with collector_paused():
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

    def _ready(self, layout: Layout | None = None, *, join: bool = False) -> None:
        """Before a step (or a Publisher's snapshot, ``layout`` unknown yet): know the
        run's newest version; settle a failed step (``join``: from the caller's thread,
        after what is queued)."""
        if not self._resumed:
            self._resume(layout)
        elif self._failed:
            self._recover(join=join)

    def _resume(self, layout: Layout | None) -> None:
        """Continue the run from its newest committed version (after a restart): rank 0
        reads the tip (and moves the head to it: a crash may have left it behind a
        commit) and tells every rank; each base then holds it, from the cache when it
        verifies, else rebuilt from the run, whole (``layout`` None) or the rank's blocks."""
        error: BaseException | None = None
        tip: StoredManifest | None = None
        if self.rank == 0:
            try:
                tip = self._run.tip()
                if tip is not None:
                    self._run.advance_head(tip)
            except BaseException as exc:
                error = exc
        tip = self._manifest_from_rank0(error, "reading the run's tip", tip)
        if layout is None:
            self._base.open(tip)
            self._owners = _whole_owners(tip.manifest.specs) if tip is not None else {}
        elif tip is None or dict(tip.manifest.specs) != layout.specs:
            self._base.forget(tip)  # nothing, or a new layout: the next version is a keyframe
            self._owners = {}
        elif not (self._base.stored is not None and self._base.stored.digest == tip.digest and self._holds(layout)):
            parts: dict[str, int] = {}
            try:
                self._base.open(tip, layout.owned(self.rank))  # the cached blocks if they verify, else from the run
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

    def _recover(self, *, join: bool) -> None:
        """Settle a failed step, then make the last committed version the base again.

        A commit whose outcome is unknown is committed again with the same bytes (which
        finds the manifest if it landed). A version newer than this publisher's last
        means another writer took over: this raises ``VersionConflict``, now and at
        every later publish. Rank 0 decides; every rank advances alike.
        """
        if join:
            self._queue.join()  # what is queued publishes (or is refused) before the base is reset
        pending = self._pending
        error: BaseException | None = None
        settled: StoredManifest | None = None
        if self.rank == 0:
            try:
                if pending is not None and pending.manifest is not None:
                    settled = self._run.commit(pending.manifest)
                self._check_tip(settled or self._base.stored)
            except BaseException as exc:
                error = exc
        try:
            settled = self._manifest_from_rank0(error, "settling the step that failed", settled)
        except VersionConflict:
            self._drop_pending()  # another writer's version is there: never ours
            raise
        if settled is not None and pending is not None:
            self._pending = None
            if pending.staged is not None:
                self._base.advance(settled, staged=pending.staged, parts=pending.parts)
            else:
                self._base.advance(settled, changes=pending.changes, parts=pending.parts)
            self._owners = pending.owners
            self.results.append(
                publish_result(settled.manifest, settled, files_uploaded=pending.files_uploaded, notes=pending.notes)
            )
        self._base.reset()  # the snapshots taken since let go: the next diffs against the committed bits
        self._failed = False

    def _drop_pending(self) -> None:
        if self._pending is not None and self._pending.staged is not None:
            self._pending.staged.discard()
        self._pending = None

    def _check_tip(self, committed: StoredManifest | None) -> None:
        """Rank 0, after a failure: the run's newest version is still the one this
        publisher committed. A run rolled back or rewritten under it is for the chain
        check of the next commit (_check_chain)."""
        tip = self._run.tip()
        if tip is not None and (committed is None or tip.version > committed.version):
            ours = f"version {committed.version}" if committed else "nothing yet"
            theirs = f"version {tip.version} by writer {tip.manifest.writer}"
            raise VersionConflict(
                f"{self.run}: the run's newest committed version is {theirs}, but this publisher "
                f"(writer {self.writer}) committed {ours}: another trainer is publishing to the same "
                f"run; this publisher cannot continue (a new {type(self).__name__} resumes from the run's tip)"
            )

    def _holds(self, layout: Layout) -> bool:
        """Whether every rank's base holds the blocks it owns in ``layout``: the same answer
        on every rank (each compares the job's layouts, not only its own blocks), so that
        a change of placement on any rank makes the next version a keyframe everywhere."""
        return bool(self._owners) and dict(self._base.specs) == layout.specs and self._owners == layout.owners

    # -- a patch version -----------------------------------------------------------------

    def _patch_step(self, version: int, layout: Layout, snap: _Snap) -> PublishResult:
        base = self._base
        owned = layout.owned(self.rank)
        changes: dict[str, BlockChanges] = {}
        error: BaseException | None = None
        try:
            if base.blocks != owned:  # pragma: no cover - a keyframe step otherwise
                raise InternalError("the base does not hold this rank's blocks")
            for name in sorted(owned):
                changes[name] = self._changes(name, snap, layout.specs[name].dtype)
            if snap.version is None:
                base.device_only(set(owned) & set(snap.device))
        except BaseException as exc:
            error = exc
        self._agree(error, "diffing its blocks")
        self._at("diffed", version)
        patch_ref, fps = self._send_patch(version, layout, changes)
        self._at("uploaded", version)
        parts = {name: change.delta.target_fingerprint for name, change in changes.items()}
        pending = _Pending(None, layout.owners, changes, None, parts, 0, snap.files.notes)
        stored, uploaded = self._commit(version, layout, fps, patch_ref, None, snap, pending)
        base.advance(stored, changes=changes, parts=parts)
        self._owners = layout.owners
        self._at("advanced", version)
        return self._result(stored, snap, uploaded)

    def _changes(self, name: str, snap: _Snap, served: str) -> BlockChanges:
        """The change of this rank's block of ``name``: found when the snapshot was taken
        (against the base of the next diff, which is the committed version by now), or
        on its device where the device holds the committed bits (only the change crosses
        to the host), else on the host (a GPU block's served bits copied over once, and
        kept on its device from now on)."""
        base = self._base
        delta = snap.changes.get(name)
        if delta is not None:
            if delta.base_fingerprint != base.fingerprints[name]:  # the snapshots' chain is the commits'
                raise InternalError(f"{name}: diffed when taken against bits that are not the base")
            was = base.bits(name).reshape(-1)[delta.indices]
            return BlockChanges(delta, delta.indices, was + delta.delta)  # deltas wrap, as the bits do
        value = snap.device.get(name)
        if value is None:
            src, source = snap.bits.source(name, served)
            return base.diff(name, src, source, ranked=self._ranked)
        found = base.device_changes(name, value)
        return found if found is not None else base.diff(name, base.device_keep(name, value), ranked=self._ranked)

    def _send_patch(
        self,
        version: int,
        layout: Layout,
        changes: Mapping[str, BlockChanges],
    ) -> tuple[PatchRef, dict[str, int]]:
        """The patch's shards, encoded and uploaded by every rank (one rank: all of them,
        as its codec codes them; several: :meth:`_parts`), numbered in rank order as one
        patch. Returns the patch's reference and every tensor's new fingerprint (the same
        on every rank)."""
        shards: list[bytes] = []
        codec = self.codec
        patch_id = ""
        error: BaseException | None = None
        if self.world == 1:
            self._at("exchanged", version)  # nothing to exchange
            deltas = {name: change.delta for name, change in changes.items()}  # as diffed (ranked, maybe)
            infos = {
                name: TensorInfo(td.spec, td.base_fingerprint, td.target_fingerprint, td.changed)
                for name, td in deltas.items()
            }
            try:
                if deltas:
                    codec, shards = self._encode(Patch(deltas))
            except BaseException as exc:
                error = exc
            del deltas
        else:
            infos, parts = self._parts(version, layout, changes)  # collectives: every rank alike
            try:
                patch_id = compute_patch_id(infos)
                codec = check_patch_codec(self.codec)
                if parts:  # a rank with nothing to write writes no shard
                    shards = encode_parts(parts, patch_id, max_shard_bytes=self.max_shard_bytes, codec=codec)
            except BaseException as exc:
                error = exc
            del parts
        counts = self._agree(error, "encoding its tensors", len(shards))
        self._at("encoded", version)
        refs: list[ObjectRef] = []
        try:
            items: dict[str, bytes] = {}
            if self.world > 1:  # one patch of every rank's shards, numbered in rank order
                first, total = sum(counts[: self.rank]), sum(counts)
                shards = [renumber(data, patch_id, first + i, total) for i, data in enumerate(shards)]
            for data in shards:
                digest = sha256_hex(data)
                key = patch_shard_key(version, digest)
                refs.append(ObjectRef(key=key, size=len(data), sha256=digest))
                items[key] = data
            del shards
            self._run.upload(items, self._on_bytes)
        except BaseException as exc:
            error = exc
        all_refs = tuple(r for part in self._agree(error, "uploading its shards", refs) for r in part)
        changed = sum(info.changed for info in infos.values())
        ref: PatchRef
        if codec == CONTEXT_CODEC:
            ref = PatchRefV2(codec="context", shards=all_refs, changed_elements=changed, context="base")
        else:
            ref = PatchRef(codec=check_codec(codec), shards=all_refs, changed_elements=changed)
        return ref, {name: info.target_fingerprint for name, info in infos.items()}

    def _parts(
        self,
        version: int,
        layout: Layout,
        changes: Mapping[str, BlockChanges],
    ) -> tuple[dict[str, TensorInfo], list[TensorPart]]:
        """Several ranks: every tensor's whole change (its parts summed: FORMAT.md's
        fingerprint is a sum over elements), and what this rank encodes of the patch.
        A tensor whose blocks are runs of it (:attr:`Layout.runs`) is encoded by its
        owners, each the entries of its run (:func:`~bulletin.distributed.parts.run_parts`);
        any other's changes go to its writer (one all-to-all, O(changed), only when the
        job has such tensors), which encodes the whole tensor."""
        base_fps = self._base.fingerprints
        said = {name: (c.part, c.delta.changed) for name, c in changes.items()}
        summed, busy = totals(layout, self._comm.add_up(tally(layout, self.rank, said)))
        infos = {
            name: TensorInfo(layout.specs[name], base_fps[name], (base_fps[name] + part) & _MASK64, changed)
            for name, (part, changed) in summed.items()
        }
        parts = run_parts(layout, self.rank, infos, busy, {name: c.delta for name, c in changes.items()})
        if len(layout.runs) < len(layout.specs):
            outgoing: list[list[_Sent]] = [[] for _ in range(self.world)]
            for name, change in changes.items():
                if name not in layout.runs:
                    outgoing[layout.writers[name]].append((name, change.delta.indices, change.delta.delta))
            incoming = self._comm.exchange(outgoing)
            del outgoing
            parts += self._merge(layout, incoming, infos)
            del incoming
        self._at("exchanged", version)
        parts.sort(key=lambda part: (part.info.spec.name, part.start))
        return infos, parts

    def _merge(self, layout: Layout, incoming: list[list[_Sent]], infos: Mapping[str, TensorInfo]) -> list[TensorPart]:
        """The whole change of each tensor this rank writes that is not split by runs, from
        every owner's part (``infos``: every tensor's whole change, summed already)."""
        parts: dict[str, list[tuple[NDArray[np.int64], Bits]]] = {}
        for sent in incoming:
            for name, gidx, delta in sent:
                parts.setdefault(name, []).append((gidx, delta))
        merged: list[TensorPart] = []
        for name in layout.written(self.rank):
            if name in layout.runs:
                continue
            info = infos[name]
            got = parts.get(name, [])
            indices = np.concatenate([g for g, _ in got]) if got else np.empty(0, np.int64)
            delta = np.concatenate([d for _, d in got]) if got else np.empty(0, info.spec.bits_dtype)
            if indices.size > 1 and not bool(np.all(indices[1:] > indices[:-1])):
                order = np.argsort(indices, kind="stable")  # blocks of a Shard(1) interleave
                indices, delta = indices[order], delta[order]
            merged.append(TensorPart(info, 0, info.spec.numel, indices.astype(np.int64, copy=False), delta))
        return merged

    def _encode(self, patch: Patch) -> tuple[str, list[bytes]]:
        """The patch's shards and codec: the context codec codes against the base (a
        tensor's whole committed bits: one rank writing every tensor, by construction)."""
        if self.codec == AUTO_CODEC:
            return encode_smallest(patch, base=self._base.views(), max_shard_bytes=self.max_shard_bytes)
        codec = check_patch_codec(self.codec)
        base = self._base.views() if codec == CONTEXT_CODEC else None
        return codec, encode(patch, max_shard_bytes=self.max_shard_bytes, codec=codec, base=base)

    # -- a keyframe version ----------------------------------------------------------------

    def _keyframe_step(self, version: int, layout: Layout, snap: _Snap, same_layout: bool) -> PublishResult:
        """Each rank first writes its blocks to a new folder of its cache (the base, once
        committed), diffing them too when the layout is the base's (the version then
        carries a patch as well). A rank that owns every tensor whole writes the
        keyframe's own files there and uploads each as soon as it is written; otherwise
        every rank writes its share of the files (:mod:`bulletin.distributed.keyframe_files`)."""
        owned = layout.owned(self.rank)
        single = layout.single_owner()
        error: BaseException | None = None
        staged: StagedKeyframe | None = None
        upload: KeyframeUpload | None = None
        written: Checkpoint | None = None
        kept: dict[str, Bits] = {}
        parts: dict[str, int] = {}
        changes: dict[str, BlockChanges] = {}
        try:
            try:
                if single == self.rank:
                    staged = self._base.stage(layout.specs, self.keyframe_file_bytes)
                    prefix = keyframe_prefix(version, self.writer, secrets.token_hex(4))
                    upload = KeyframeUpload(self._put_file, prefix, max(1, min(4, self._run.max_workers)))
                    staged.on_file = upload.send  # each file goes up while the next is written
                else:
                    specs = {name: TensorSpec(name, layout.specs[name].dtype, b.sizes) for name, b in owned.items()}
                    staged = self._base.stage(specs, _ONE_FILE, blocks=owned, hashed=False)
                for name in sorted(owned):
                    value = snap.device.get(name)  # a GPU block is kept on its device from now on
                    bits = snap.bits.take(name) if value is None else self._base.device_keep(name, value)
                    if same_layout:
                        change = changes[name] = self._base.diff(name, bits, ranked=self._ranked)
                        parts[name] = change.delta.target_fingerprint
                    else:
                        parts[name] = part_fingerprint(owned[name], bits)
                    staged.write(name, bits)
                    del bits
                if snap.version is None:
                    self._base.device_only(set(owned) & set(snap.device))
                if single != self.rank:
                    staged.finish()
                    # Read back through a map: page cache, not this process's memory.
                    written = Checkpoint(staged.folder)
                    kept = {name: written.bits(name) for name in owned}
            except BaseException as exc:
                error = exc
            # Rank 0's attempt token names the keyframe's folder on every rank: a step that
            # failed half-way and runs again with other bits never meets the files it left.
            everyone = self._agree(error, "reading its blocks", (parts, secrets.token_hex(4)))
            self._at("diffed", version)
            fps = _sums([part for part, _ in everyone])
            patch_ref: PatchRef | None = None
            if same_layout:
                patch_ref, _ = self._send_patch(version, layout, changes)
            else:
                self._at("exchanged", version)
                self._at("encoded", version)
            if single is not None:
                keyframe_ref = self._finish_upload(staged, upload)
            else:
                keyframe_ref = self._write_shares(version, layout, kept, everyone[0][1])
            self._at("uploaded", version)
            pending = _Pending(None, layout.owners, changes, staged, parts, 0, snap.files.notes)
            stored, uploaded = self._commit(version, layout, fps, patch_ref, keyframe_ref, snap, pending)
        except BaseException:
            if upload is not None:
                upload.abort()  # before the folder it reads goes
            if staged is not None and (self._pending is None or self._pending.staged is not staged):
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

    def _finish_upload(self, staged: StagedKeyframe | None, upload: KeyframeUpload | None) -> KeyframeRef:
        """The single owner's keyframe, every file uploaded; its reference on every rank."""
        error: BaseException | None = None
        ref: KeyframeRef | None = None
        try:
            if staged is not None and upload is not None:
                ref = upload.finish(staged.finish())
        except BaseException as exc:
            error = exc
        refs: list[KeyframeRef] = [
            r for r in self._agree(error, "uploading the keyframe's files", ref) if r is not None
        ]
        if len(refs) != 1:  # pragma: no cover - the single owner's, alone
            raise InternalError(f"{len(refs)} ranks wrote the keyframe")
        return refs[0]

    def _write_shares(self, version: int, layout: Layout, kept: Mapping[str, Bits], token: str) -> KeyframeRef:
        """Every rank's share of the keyframe's files, written to scratch and uploaded."""
        files = plan_checkpoint(layout.specs, self.keyframe_file_bytes)
        folder = Path(tempfile.mkdtemp(prefix="bulletin-keyframe-", dir=self._scratch))
        refs: list[tuple[int, ObjectRef]] = []
        prefix = keyframe_prefix(version, self.writer, token)
        try:
            error = write_keyframe_files(self._comm, files, layout, kept, folder)
            if error is None:
                try:
                    for index, (file_name, _) in enumerate(files):
                        if index % self.world == self.rank:
                            refs.append((index, self._put_path(f"{prefix}/{file_name}", folder / file_name)))
                    if len(files) > 1 and self.rank == 0:
                        path = folder / INDEX_NAME
                        path.write_bytes(hf_index(files))
                        refs.append((len(files), self._put_path(f"{prefix}/{INDEX_NAME}", path)))
                except BaseException as exc:
                    error = exc
            all_refs = self._agree(error, "writing its keyframe files", refs)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        ordered = tuple(ref for _, ref in sorted((i, r) for part in all_refs for i, r in part))
        return KeyframeRef(prefix=prefix, files=ordered)

    def _put_path(self, key: str, path: Path) -> ObjectRef:
        """Upload one of a rank's keyframe files, hashed first."""
        with open(path, "rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
        file = KeyframeFile(path.name, path, path.stat().st_size, digest)
        self._put_file(key, file)
        return ObjectRef(key=key, size=file.size, sha256=file.sha256)

    def _put_file(self, key: str, file: KeyframeFile) -> None:
        """Create one object from a local file; an existing one is fine only with the same
        bytes (the prefix is this attempt's own: another object there is not ours)."""
        absolute = self._run.key(key)
        store = self._run.store
        # The file is never written again (the cache copies a staged file before writing
        # in place: bulletin/shared_files.py): a local store may take it as it is.
        if isinstance(store.put_file_if_absent(absolute, file.path, link=True), Conflicted):
            with tempfile.TemporaryDirectory(dir=self._base.cache_dir) as scratch:
                try:
                    store.get_to_file(absolute, Path(scratch) / "existing", sha256=file.sha256, max_bytes=file.size)
                except (DigestMismatch, ObjectTooLarge):
                    raise Conflict(f"{absolute}: exists with other content") from None
        if self._on_bytes is not None:
            self._on_bytes(file.size)

    # -- the commit ------------------------------------------------------------------------

    def _commit(
        self,
        version: int,
        layout: Layout,
        fps: Mapping[str, int],
        patch_ref: PatchRef | None,
        keyframe_ref: KeyframeRef | None,
        snap: _Snap,
        pending: _Pending,
    ) -> tuple[StoredManifest, int]:
        """Rank 0 checks the run still holds the parent, uploads the version's new model
        files, creates the manifest (the commit point) and tells every rank the outcome;
        every rank returns the committed manifest and the files' bytes uploaded (rank
        0's), or raises the commit's error. A commit whose outcome is unknown leaves
        ``pending`` (with the manifest, on rank 0) to settle before the next step."""
        outcome = _Outcome(None, "", "")
        failure: BaseException | None = None
        committed: StoredManifest | None = None
        manifest: ManifestV1 | None = None
        uploaded = 0
        if self.rank == 0:
            try:
                parent = self._base.stored
                if parent is not None:
                    self._check_chain(parent)
                files, uploaded = upload_files(self._run, version, self._base.files, snap.files.files, self._on_bytes)
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
                committed = self._run.commit(manifest)  # raises VersionConflict for a stale trainer
                # The other ranks parse what rank 0 committed; rank 0 keeps its own.
                outcome = _Outcome(_shared(committed) if self.world > 1 else None, "", "")
                self._at("committed", version)
            except BaseException as exc:
                # The manifest may exist: settled before anything else.
                unknown = manifest is not None and isinstance(exc, StorageUnavailable)
                failure = exc
                outcome = _Outcome(None, str(exc), type(exc).__name__, unknown and not isinstance(exc, AccessDenied))
        outcome = self._comm.broadcast(outcome)
        if outcome.kind:
            self._agreed = True  # every rank learnt the same outcome
            if outcome.unknown:
                self._pending = dataclasses.replace(
                    pending, manifest=manifest, files_uploaded=uploaded if self.rank == 0 else 0
                )
            if failure is not None:
                raise failure
            if outcome.kind == "VersionConflict":
                raise VersionConflict(f"version {version}: {outcome.error}")
            raise RankFailed(f"the commit of version {version} failed on rank 0 ({outcome.kind}: {outcome.error})")
        if committed is not None:
            return committed, uploaded
        shared = _unshared(outcome.manifest)
        if shared is None:  # pragma: no cover - a committed outcome carries it
            raise InternalError(f"version {version}: committed without a manifest")
        return shared, 0

    def _check_chain(self, committed: StoredManifest) -> None:
        """The run still holds the version this publisher continues, as committed or resumed
        from: a run rolled back or rewritten since is ``RunRewound`` / ``ChainMismatch``
        (never a fork chained to a version the bucket no longer has)."""
        head = self._run.read_head()
        ours = (committed.version, committed.digest)
        if head is not None and (head.head.version, head.head.manifest_digest) == ours:
            return  # the head names what this publisher holds: one small read
        tip = self._run.tip()
        held = Held.at(committed)
        try:
            if tip is None:
                raise RunRewound(f"{self.run}: version {held.version} held here, but the run has no version left")
            check_chain(self._run, held, tip, tip=True)
        except ChainMismatch as exc:
            message = f"{exc}; this publisher cannot continue (a new {type(self).__name__} resumes from the run's tip)"
            raise type(exc)(message) from None

    def _result(self, stored: StoredManifest, snap: _Snap, uploaded: int) -> PublishResult:
        return publish_result(stored.manifest, stored, files_uploaded=uploaded, notes=snap.files.notes)
