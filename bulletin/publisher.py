"""Trainer side: publish each new state of the weights as an immutable version.

>>> pub = Publisher("s3://bucket/runs", "llama-grpo", keyframe_every=50)
>>> for step in range(steps):
...     train_step()
...     pub.publish_async(model.state_dict())   # returns once the state is diffed; uploads in the background
>>> pub.close()                                  # waits for the queue; raises the first error

Each version is diffed, tensor by tensor, against the bits of the last committed one
and of the versions queued since, which one object owns
(:class:`~bulletin.base.PublishedBase`): memory-mapped files in
a local cache directory (verified against the run when a publisher starts, rebuilt
from it when missing or stale), and for CUDA tensors a copy on their GPU. The diff is
encoded into shards, uploaded, and committed by creating its manifest (the commit
point); then the base advances to it and the head moves. Version 1, every
``keyframe_every``-th version after it, and any change of tensor layout are also
stored in full as plain safetensors, written into the cache and uploaded from those
files, each one as soon as it is written (a local store on the same file system takes
the file itself: :mod:`bulletin.shared_files`). A restarted trainer resumes from the run's newest version, so the chain
continues without a gap.

Memory beyond the caller's tensors is bounded: one tensor's cast at a time and the
changes found (O(changed elements)), never a copy of the model, for :meth:`~Publisher.
publish`, :meth:`~Publisher.publish_checkpoint` (read through memory maps) and a patch
version of :meth:`~Publisher.publish_async`, which diffs each tensor when it is called,
against the last committed version and the versions queued since, and queues only the
changes. A keyframe version of ``publish_async`` (the first, a new layout, every
``keyframe_every``-th) is stored whole, so it holds one private copy of each host
tensor (its cast to the served dtype, or a plain copy) until it is committed.

A version may carry the model's non-tensor files (``files=``: config, tokenizer, ...;
:mod:`bulletin.model_files`), which every node folder then holds beside the tensors.
They are sticky: a publish without ``files`` keeps the previous version's, and a file
whose bytes did not change is never uploaded again (the new manifest names the object
its parent named).

A publish that fails leaves the publisher consistent: the base of the next diff is
still the last committed version (the versions queued after it were diffed against it:
they are refused with its error, and the base lets their changes go). One whose commit failed with its outcome unknown
(``StorageUnavailable``: the manifest may have been created, its response lost) is
settled before the next publish by committing the same manifest again, which finds
the manifest if it landed; either way the version is then committed and the chain
continues from it. A version committed meanwhile by another writer makes that and
every later publish of this publisher raise ``VersionConflict``.
"""

from __future__ import annotations

import os
import queue
import secrets
import tempfile
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

from bulletin.base import PublishedBase
from bulletin.checkpoint import Checkpoint
from bulletin.errors import (
    AccessDenied,
    ChainMismatch,
    ConfigError,
    Conflict,
    DigestMismatch,
    InternalError,
    InvalidInput,
    ObjectTooLarge,
    RunRewound,
    StorageUnavailable,
    VersionConflict,
)
from bulletin.keyframe_stage import KeyframeFile, StagedKeyframe
from bulletin.keyframe_upload import KeyframeUpload
from bulletin.keyspace import file_key, keyframe_prefix, patch_shard_key
from bulletin.model_files import ModelFiles, select_model_files, with_served_dtype
from bulletin.run import Run, StoredManifest, sha256_hex
from bulletin.signing import Signer, as_signer
from bulletin.snapshot import Snapshot, cast_served, take_snapshot
from bulletin.storage import Conflicted, Store, open_store, require_writable
from bulletin.sync import check_chain
from bulletin.target import Held
from patcher.compression import AUTO_CODEC, CONTEXT_CODEC, PUBLISH_CODECS, check_codec, check_patch_codec
from patcher.dtypes import FLOAT_DTYPES, SERVED_FLOAT_DTYPES
from patcher.encode import encode, encode_smallest
from patcher.fingerprint import fingerprint, format_fingerprint
from patcher.patch import Patch, TensorDelta, TensorSpec
from schemas.manifest import (
    FileRef,
    KeyframeRef,
    ManifestV1,
    ManifestV2,
    ManifestV3,
    ObjectRef,
    PatchRef,
    PatchRefV2,
    TensorEntry,
    VersionStats,
    check_metadata,
    manifest_files,
)

__all__ = [
    "FilesArg",
    "PreparedFiles",
    "PublishResult",
    "Publisher",
    "RunPublisher",
    "build_manifest",
    "prepare_files",
    "publish_result",
    "upload_files",
]

#: What ``files=`` takes: checked files, a mapping of relative path -> bytes, a checkpoint
#: folder (its files by the default rule of :func:`~bulletin.model_files.select_model_files`),
#: or None: the previous version's files.
FilesArg = ModelFiles | Mapping[str, bytes] | str | os.PathLike[str] | None

_DEFAULT_SHARD_BYTES: Final = 64 << 20
_DEFAULT_KEYFRAME_FILE_BYTES: Final = 1 << 30


@dataclass(frozen=True, slots=True)
class PublishResult:
    """What one publish wrote."""

    version: int
    keyframe: bool
    changed_elements: int
    total_elements: int
    patch_bytes: int
    keyframe_bytes: int
    manifest_digest: str
    files: tuple[str, ...] = ()
    """Paths of the version's model files (the previous version's when none were given)."""
    files_uploaded: int = 0
    """Bytes of model files uploaded for it: 0 when they did not change."""
    notes: tuple[str, ...] = ()
    """What was changed on the way, to tell the user (``config.json``'s dtype rewritten)."""


@dataclass(frozen=True, slots=True)
class _Pending:
    """A version whose commit failed with its outcome unknown, and what the base advances
    with once it is settled as committed."""

    manifest: ManifestV1
    patch: Patch | None
    staged: StagedKeyframe | None
    files_uploaded: int
    notes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PreparedFiles:
    """The model files a publish was given (None: the previous version's) and the notes
    their preparation left."""

    files: ModelFiles | None
    notes: tuple[str, ...] = ()


def build_manifest(
    run: str,
    writer: str,
    version: int,
    parent: StoredManifest | None,
    specs: Mapping[str, TensorSpec],
    fps: Mapping[str, int],
    patch_ref: PatchRef | None,
    keyframe_ref: KeyframeRef | None,
    file_refs: tuple[FileRef, ...],
    metadata: dict[str, str],
) -> ManifestV1:
    """The manifest of ``version`` (tensors ``specs`` with fingerprints ``fps``), chained to
    ``parent``; every publisher writes its manifests so (the sharded one too)."""
    # Write the oldest spec_version that says it all: 3 for files, 2 for a context-coded
    # patch, else 1, so that readers that predate them keep reading the rest.
    extra: dict[str, Any] = {}
    manifest_type: type[ManifestV1] = ManifestV1
    if file_refs:
        manifest_type, extra = ManifestV3, {"files": file_refs}
        if patch_ref is not None and not isinstance(patch_ref, PatchRefV2):
            patch_ref = PatchRefV2(
                codec=patch_ref.codec,
                shards=patch_ref.shards,
                changed_elements=patch_ref.changed_elements,
                context=None,
            )
    elif isinstance(patch_ref, PatchRefV2):
        manifest_type = ManifestV2
    ordered = [specs[n] for n in sorted(specs)]
    return manifest_type(
        run=run,
        version=version,
        parent_version=parent.version if parent else None,
        parent_digest=parent.digest if parent else None,
        created_at=datetime.now(UTC),
        writer=writer,
        tensors=tuple(
            TensorEntry(name=s.name, dtype=s.dtype, shape=s.shape, fingerprint=format_fingerprint(fps[s.name]))  # type: ignore[arg-type]
            for s in ordered
        ),
        patch=patch_ref,
        keyframe=keyframe_ref,
        stats=VersionStats(
            total_elements=sum(s.numel for s in ordered),
            total_bytes=sum(s.nbytes for s in ordered),
            patch_bytes=sum(r.size for r in patch_ref.shards) if patch_ref else 0,
            keyframe_bytes=sum(r.size for r in keyframe_ref.files) if keyframe_ref else 0,
        ),
        metadata=metadata,
        **extra,
    )


def publish_result(
    manifest: ManifestV1, stored: StoredManifest, *, files_uploaded: int = 0, notes: tuple[str, ...] = ()
) -> PublishResult:
    """What a publish of ``manifest``, committed as ``stored``, wrote."""
    stats = manifest.stats
    return PublishResult(
        version=manifest.version,
        keyframe=manifest.keyframe is not None,
        changed_elements=manifest.patch.changed_elements if manifest.patch else stats.total_elements,
        total_elements=stats.total_elements,
        patch_bytes=stats.patch_bytes,
        keyframe_bytes=stats.keyframe_bytes,
        manifest_digest=stored.digest,
        files=tuple(f.path for f in manifest_files(manifest)),
        files_uploaded=files_uploaded,
        notes=notes,
    )


def _as_model_files(files: FilesArg) -> ModelFiles | None:
    if files is None or isinstance(files, ModelFiles):
        return files
    if isinstance(files, str | os.PathLike):
        return select_model_files(files)
    return ModelFiles.of(files)


def prepare_files(files: FilesArg, dtype: str, *, cast: bool) -> PreparedFiles:
    """A publish's ``files`` checked (before anything is snapshotted or uploaded), with
    ``config.json`` naming the served ``dtype`` when floating tensors are cast to it."""
    given = _as_model_files(files)
    if given is None or not cast:
        return PreparedFiles(given)
    served, notes = with_served_dtype(given, dtype)
    return PreparedFiles(served, notes)


def upload_files(
    run: Run,
    version: int,
    previous: tuple[FileRef, ...],
    files: ModelFiles | None,
    on_bytes: Callable[[int], None] | None = None,
) -> tuple[tuple[FileRef, ...], int]:
    """The file refs of ``version`` of ``run``, and the bytes uploaded for them: the
    parent's refs (``previous``) when no files were given; otherwise one per file, naming
    the object the parent named for the same bytes (nothing uploaded) or a new one,
    uploaded create-only now (before the manifest that names it)."""
    if files is None:
        return previous, 0
    by_digest = {ref.sha256: ref for ref in previous}
    refs: list[FileRef] = []
    items: dict[str, bytes] = {}
    for path, content in files.files.items():
        digest = sha256_hex(content)
        known = by_digest.get(digest)
        key = known.key if known is not None else file_key(version, digest)
        if known is None:
            items[key] = content
        refs.append(FileRef(path=path, key=key, size=len(content), sha256=digest))
    if items:
        run.upload(items, on_bytes)
    return tuple(refs), sum(len(content) for content in items.values())


class RunPublisher:
    """What both publishers (this module's and the sharded one) answer from their run and
    their base of the next diff."""

    _run: Run
    _base: PublishedBase

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


class Publisher(RunPublisher):
    """Publishes versions of one run. Not thread-safe: one trainer process, one Publisher."""

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
        if codec not in PUBLISH_CODECS:
            raise ConfigError(f"codec must be one of {', '.join(map(repr, PUBLISH_CODECS))}, not {codec!r}")
        if queue_size < 1 or max_shard_bytes < 1 << 10 or keyframe_file_bytes < 1 << 10:
            raise ConfigError("queue_size >= 1; max_shard_bytes and keyframe_file_bytes >= 1 KiB")
        opened = open_store(store) if isinstance(store, str | os.PathLike) else store
        require_writable(opened, "publishing")  # before a model is cast, diffed or uploaded
        self._run = Run(opened, run, max_workers=max_workers, signer=as_signer(signing_key))
        self.dtype = dtype
        self.keyframe_every = keyframe_every
        self.codec = codec
        self.max_shard_bytes = max_shard_bytes
        self.keyframe_file_bytes = keyframe_file_bytes
        self.writer = secrets.token_hex(8)
        self._on_bytes = on_bytes
        self._base = PublishedBase(self._run, dtype, cache_dir)
        self._resumed = False
        self._queue: queue.Queue[tuple[Snapshot, dict[str, str], PreparedFiles, Future[PublishResult], int] | None] = (
            queue.Queue(maxsize=queue_size)
        )
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None
        # After a failed publish: snapshots taken before it (an older epoch) are refused
        # with its error, and the next one first settles it (_recover).
        self._failed = False
        self._epoch = 0
        self._epoch_error: BaseException | None = None
        self._pending: _Pending | None = None
        self._closed = False
        self.results: list[PublishResult] = []

    # -- public API --------------------------------------------------------------------

    def publish(
        self, state_dict: Mapping[str, Any], *, metadata: Mapping[str, str] | None = None, files: FilesArg = None
    ) -> int:
        """Publish synchronously; returns the new version number.

        The tensors are read while this runs, one at a time (a zero-copy view of a tensor
        already in the served dtype, else its cast): do not change them from another
        thread meanwhile. ``files``: the version's model files (:data:`FilesArg`; None
        keeps the previous version's). Floating tensors are served as ``dtype``, and so a
        ``config.json`` among them names ``dtype``
        (:func:`~bulletin.model_files.with_served_dtype`; the result's ``notes`` say what
        changed)."""
        self._check_open()
        self.flush()
        checked = check_metadata(metadata or {})  # bad input changes nothing: checked first
        given = prepare_files(files, self.dtype, cast=True)
        return self._publish(self._prepare(state_dict, copy=False), checked, given).version

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
            self._ready()
            specs: dict[str, TensorSpec] = {}
            snap = Snapshot(self._base.next_version, specs, {})
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
            self._base.prepared(snap.version, specs, set())
            return self._publish(snap, checked, given)

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
          host).

        Writes to the tensors after that, from any stream or thread, do not reach the
        version published."""
        self._check_open()
        self._raise_background_error()
        checked = check_metadata(metadata or {})
        given = prepare_files(files, self.dtype, cast=True)
        epoch = self._epoch  # read before _prepare: a failure from now on refuses this snapshot
        snap = self._prepare(state_dict, copy=True)
        future: Future[PublishResult] = Future()
        if self._worker is None:
            self._worker = threading.Thread(target=self._drain, name=f"bulletin-publish-{self.run}", daemon=True)
            self._worker.start()
        self._queue.put((snap, checked, given, future, epoch))
        return future

    def refresh_head(self) -> bool:
        """Sign the head again, now, if it still names this publisher's last version: call it
        more often than readers' ``max_head_age`` while no version is published (a quiet
        trainer's heartbeat; docs/SECURITY.md). Needs ``signing_key``; returns whether the
        head was refreshed."""
        self._check_open()
        self.flush()
        committed = self._base.stored
        return committed is not None and self._run.refresh_head(committed)

    def flush(self) -> None:
        """Wait until every queued publish is committed; raise the first background error."""
        self._queue.join()
        self._raise_background_error()

    def close(self) -> None:
        """Flush, make sure the head shows the last version, then stop the background
        worker and release the cache. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
            committed = self._base.stored
            if committed is not None and not self._failed:
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

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    @property
    def _ranked(self) -> bool:
        """Whether diffs rank their changes as they go (the codec may be the context one)."""
        return self.codec in (AUTO_CODEC, CONTEXT_CODEC)

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInput("this Publisher is closed")

    def _raise_background_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                snap, metadata, files, future, epoch = item
                if epoch != self._epoch:  # keep order: nothing taken before a failed version
                    future.set_exception(self._epoch_error or InternalError("a publish failed"))
                    continue
                try:
                    future.set_result(self._publish(snap, metadata, files))
                except BaseException as exc:
                    if self._error is None:
                        self._error = exc
                    future.set_exception(exc)
            finally:
                self._queue.task_done()

    def _prepare(self, state_dict: Mapping[str, Any], *, copy: bool) -> Snapshot:
        """The part of a publish that runs in the caller's thread: the snapshot (with
        ``copy``, all that must happen before the caller may touch its tensors)."""
        self._ready()
        full = (self._base.next_version - 1) % self.keyframe_every == 0
        try:
            return take_snapshot(
                state_dict, dtype=self.dtype, base=self._base, full=full, copy=copy, ranked=self._ranked
            )
        except BaseException:
            self._failed = True  # tensors diffed before a failure moved the device's bits on
            raise

    def _ready(self) -> None:
        """Before a snapshot: know the run's newest version; settle a failed publish."""
        if not self._resumed:
            self._resume()
        elif self._failed:
            self._recover()

    def _resume(self) -> None:
        """Continue the run from its newest committed version (after a restart): the base
        holds it, from the cache when it verifies, else rebuilt from the run."""
        tip = self._run.tip()
        if tip is not None:
            self._run.advance_head(tip)  # a crash may have left the head behind a commit
        self._base.open(tip)
        self._resumed = True

    def _failure(self, exc: BaseException) -> None:
        """A publish failed after its snapshot: later snapshots were diffed (on the host or
        a device) against bits that were not committed. Refuse those; the next snapshot recovers
        first."""
        self._failed = True  # before the epoch moves on (publish_async reads them the other way)
        self._epoch_error = exc
        self._epoch += 1

    def _recover(self) -> None:
        """Settle a failed publish, then make the last committed version the base again.

        A commit whose outcome is unknown is committed again with the same bytes (which
        finds the manifest if it landed). A version newer than this publisher's last
        means another writer took over: this raises ``VersionConflict``, now and at
        every later publish.
        """
        self._queue.join()  # what is queued publishes (or is refused) before the base is reset
        pending = self._pending
        if pending is not None:
            try:
                stored = self._run.commit(pending.manifest)
            except VersionConflict:
                self._pending = None
                if pending.staged is not None:
                    pending.staged.discard()
                raise
            self._pending = None
            self._base.advance(stored, patch=pending.patch, staged=pending.staged)
            self.results.append(
                publish_result(pending.manifest, stored, files_uploaded=pending.files_uploaded, notes=pending.notes)
            )
        committed = self._base.stored
        tip = self._run.tip()
        # A newer version is another writer's. A run rolled back or rewritten under the
        # version held is for the chain check of the publish itself (_check_chain).
        if tip is not None and (committed is None or tip.version > committed.version):
            ours = f"version {committed.version}" if committed else "nothing yet"
            theirs = f"version {tip.version} by writer {tip.manifest.writer}"
            raise VersionConflict(
                f"{self.run}: the run's newest committed version is {theirs}, but this publisher "
                f"(writer {self.writer}) committed {ours}: another trainer is publishing to the same "
                "run; this publisher cannot continue (a new Publisher resumes from the run's tip)"
            )
        self._base.reset()  # the snapshots taken since let go: the next diffs against the committed bits
        self._failed = False

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
            message = f"{exc}; this publisher cannot continue (a new Publisher resumes from the run's tip)"
            raise type(exc)(message) from None

    def _publish(self, snap: Snapshot, metadata: dict[str, str], files: PreparedFiles) -> PublishResult:
        try:
            return self._publish_once(snap, metadata, files)
        except BaseException as exc:
            self._failure(exc)
            raise

    def _publish_once(self, snap: Snapshot, metadata: dict[str, str], files: PreparedFiles) -> PublishResult:
        if not self._resumed:
            self._resume()
        base = self._base
        parent = base.stored
        if parent is not None:
            self._check_chain(parent)
        version = parent.version + 1 if parent else 1
        if snap.version != version:
            raise InternalError(f"a snapshot taken for version {snap.version} reached the commit of {version}")
        same_layout = parent is not None and dict(base.specs) == snap.specs
        is_keyframe = not same_layout or (version - 1) % self.keyframe_every == 0
        if is_keyframe and snap.changes:  # cannot happen: snapshots of keyframes are taken in full
            raise InternalError("a keyframe version was diffed when its snapshot was taken")
        staged = base.stage(snap.specs, self.keyframe_file_bytes) if is_keyframe else None
        upload = None
        if staged is not None:
            workers = max(1, min(4, self._run.max_workers))
            prefix = keyframe_prefix(version, self.writer, secrets.token_hex(4))
            upload = KeyframeUpload(self._put_file, prefix, workers)
            staged.on_file = upload.send  # each file goes up while the next is written
        try:
            patch, fps = self._diff(snap, staged, same_layout)
            patch_ref = self._upload_patch(version, patch) if patch is not None else None
            keyframe_ref = upload.finish(staged.finish()) if staged is not None and upload is not None else None
            file_refs, files_uploaded = upload_files(self._run, version, base.files, files.files, self._on_bytes)
            manifest = self._manifest(version, parent, snap, fps, patch_ref, keyframe_ref, file_refs, metadata)
        except BaseException:
            if upload is not None:
                upload.abort()  # before the folder it reads goes
            if staged is not None:
                staged.discard()
            raise
        try:
            stored = self._run.commit(manifest)  # raises VersionConflict for a stale trainer
        except StorageUnavailable as exc:
            if not isinstance(exc, AccessDenied):  # the manifest may exist: settled next time
                self._pending = _Pending(manifest, patch, staged, files_uploaded, files.notes)
            elif staged is not None:
                staged.discard()
            raise
        except BaseException:
            if staged is not None:
                staged.discard()
            raise
        base.advance(stored, patch=patch, staged=staged)
        result = publish_result(manifest, stored, files_uploaded=files_uploaded, notes=files.notes)
        self.results.append(result)
        return result

    def _diff(
        self, snap: Snapshot, staged: StagedKeyframe | None, same_layout: bool
    ) -> tuple[Patch | None, dict[str, int]]:
        """Tensor by tensor, in name order: the change found when the snapshot was taken,
        or each one's bits taken from the snapshot (a view, its cast, or the copy taken),
        diffed against the base (same layout), written to the staged keyframe (a
        keyframe), then dropped. Returns the patch (None for a new layout) and every
        tensor's fingerprint."""
        base = self._base
        deltas: dict[str, TensorDelta] = {}
        fps: dict[str, int] = {}
        for name in sorted(snap.specs):
            delta = snap.changes.get(name)
            if delta is not None:
                if delta.base_fingerprint != base.fingerprints[name]:  # the snapshots' chain is the commits'
                    raise InternalError(f"{name}: diffed when taken against bits that are not the base")
                deltas[name], fps[name] = delta, delta.target_fingerprint
                continue
            if staged is None:  # a patch alone: an F32 source is cast inside the diff
                src, source = snap.bits.source(name, snap.specs[name].dtype)
                delta = base.diff(name, src, source, ranked=self._ranked).delta
                deltas[name], fps[name] = delta, delta.target_fingerprint
                del src
                continue
            bits = snap.bits.take(name)
            if same_layout:
                delta = base.diff(name, bits, ranked=self._ranked).delta
                deltas[name], fps[name] = delta, delta.target_fingerprint
            else:
                fps[name] = fingerprint(bits)
            staged.write(name, bits)
            del bits
        return (Patch(deltas) if same_layout else None), fps

    def _manifest(
        self,
        version: int,
        parent: StoredManifest | None,
        snap: Snapshot,
        fps: Mapping[str, int],
        patch_ref: PatchRef | None,
        keyframe_ref: KeyframeRef | None,
        file_refs: tuple[FileRef, ...],
        metadata: dict[str, str],
    ) -> ManifestV1:
        return build_manifest(
            self.run, self.writer, version, parent, snap.specs, fps, patch_ref, keyframe_ref, file_refs, metadata
        )

    def _upload_patch(self, version: int, patch: Patch) -> PatchRef:
        codec: str
        if self.codec == AUTO_CODEC:
            codec, shards = encode_smallest(patch, base=self._base.views(), max_shard_bytes=self.max_shard_bytes)
        else:
            codec = check_patch_codec(self.codec)
            base = self._base.views() if codec == CONTEXT_CODEC else None
            shards = encode(patch, max_shard_bytes=self.max_shard_bytes, codec=codec, base=base)
        refs = []
        items = {}
        for data in shards:
            digest = sha256_hex(data)
            key = patch_shard_key(version, digest)
            refs.append(ObjectRef(key=key, size=len(data), sha256=digest))
            items[key] = data
        self._run.upload(items, self._on_bytes)
        if codec == CONTEXT_CODEC:
            return PatchRefV2(
                codec="context", shards=tuple(refs), changed_elements=patch.changed_elements, context="base"
            )
        return PatchRef(codec=check_codec(codec), shards=tuple(refs), changed_elements=patch.changed_elements)

    def _put_file(self, key: str, file: KeyframeFile) -> None:
        """Create one object from a local file; an existing one is fine only with the same
        bytes (the prefix is this attempt's own: another object there is not ours)."""
        absolute = self._run.key(key)
        store = self._run.store
        # The staged file is never written again (the cache copies it before writing in
        # place: bulletin/shared_files.py): a local store may take it as it is.
        if isinstance(store.put_file_if_absent(absolute, file.path, link=True), Conflicted):
            with tempfile.TemporaryDirectory(dir=self._base.cache_dir) as scratch:
                try:
                    store.get_to_file(absolute, Path(scratch) / "existing", sha256=file.sha256, max_bytes=file.size)
                except (DigestMismatch, ObjectTooLarge):
                    raise Conflict(f"{absolute}: exists with other content") from None
        if self._on_bytes is not None:
            self._on_bytes(file.size)
