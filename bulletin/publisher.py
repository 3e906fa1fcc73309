"""Trainer side: publish each new state of the weights as an immutable version.

>>> pub = Publisher("s3://bucket/runs", "llama-grpo", keyframe_every=50)
>>> for step in range(steps):
...     train_step()
...     pub.publish_async(model.state_dict())   # returns at once; uploads in the background
>>> pub.close()                                  # waits for the queue; raises the first error

Each version is diffed against the bits of the previous one (kept in memory, two
bytes per BF16 parameter), encoded into shards, uploaded, and committed by creating
its manifest (the commit point), then the head moves. Version 1, every
``keyframe_every``-th version after it, and any change of tensor layout are also
stored in full as plain safetensors. A restarted trainer resumes from the run's
newest version by reconstructing it, so the chain continues without a gap.

A version may carry the model's non-tensor files (``files=``: config, tokenizer, ...;
:mod:`bulletin.model_files`), which every node folder then holds beside the tensors.
They are sticky: a publish without ``files`` keeps the previous version's, and a file
whose bytes did not change is never uploaded again (the new manifest names the object
its parent named).

A publish that fails leaves the publisher consistent: the base of the next diff is
still the last committed version. One whose commit failed with its outcome unknown
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
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

import numpy as np
from numpy.typing import NDArray

from bulletin.checkpoint import INDEX_NAME, Checkpoint, hf_index, plan_checkpoint, safetensors_bytes
from bulletin.device_kept import DeviceKept
from bulletin.errors import (
    AccessDenied,
    ChainMismatch,
    ConfigError,
    InternalError,
    InvalidInput,
    RunRewound,
    StorageUnavailable,
    VersionConflict,
)
from bulletin.keyspace import file_key, keyframe_prefix, patch_shard_key
from bulletin.model_files import ModelFiles, select_model_files, with_served_dtype
from bulletin.run import Run, StoredManifest, sha256_hex
from bulletin.signing import Signer
from bulletin.snapshot import Snapshot, cast_served, snapshot
from bulletin.storage import Store, open_store, require_writable
from bulletin.sync import check_chain, execute, plan
from bulletin.target import ArrayTarget, Held
from patcher.compression import AUTO_CODEC, CONTEXT_CODEC, PUBLISH_CODECS, check_codec, check_patch_codec
from patcher.diff import diff
from patcher.dtypes import SERVED_FLOAT_DTYPES
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

__all__ = ["FilesArg", "PublishResult", "Publisher"]

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


@dataclass(slots=True)
class _Kept:
    """The last published version: its bits, fingerprints, files and manifest."""

    specs: dict[str, TensorSpec]
    bits: dict[str, NDArray[np.unsignedinteger]]
    fingerprints: dict[str, int]
    stored: StoredManifest
    files: tuple[FileRef, ...] = ()


@dataclass(frozen=True, slots=True)
class _Pending:
    """A version whose commit failed with its outcome unknown, and what it would keep."""

    manifest: ManifestV1
    specs: dict[str, TensorSpec]
    bits: dict[str, NDArray[np.unsignedinteger]]
    fingerprints: dict[str, int]
    files_uploaded: int
    notes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Files:
    """The model files a publish was given (None: the previous version's) and the notes
    their preparation left."""

    files: ModelFiles | None
    notes: tuple[str, ...] = ()


def _result(
    manifest: ManifestV1, stored: StoredManifest, *, files_uploaded: int = 0, notes: tuple[str, ...] = ()
) -> PublishResult:
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


class Publisher:
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
    ) -> None:
        """``signing_key``: a :class:`~bulletin.signing.Signer` or a private key file; every
        manifest and head this publisher writes is then signed (docs/SECURITY.md)."""
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
        signer = (
            signing_key if isinstance(signing_key, Signer) or signing_key is None else Signer.from_file(signing_key)
        )
        self._run = Run(
            opened,
            run,
            max_workers=max_workers,
            signer=signer,
        )
        self.dtype = dtype
        self.keyframe_every = keyframe_every
        self.codec = codec
        self.max_shard_bytes = max_shard_bytes
        self.keyframe_file_bytes = keyframe_file_bytes
        self.writer = secrets.token_hex(8)
        self._on_bytes = on_bytes
        self._kept: _Kept | None = None
        self._resumed = False
        self._device = DeviceKept(dtype)
        self._next_version = 1
        self._prepared_specs: dict[str, TensorSpec] | None = None
        self._queue: queue.Queue[tuple[Snapshot, dict[str, str], _Files, Future[PublishResult], int] | None] = (
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

    @property
    def run(self) -> str:
        return self._run.name

    @property
    def version(self) -> int | None:
        """The last version this publisher committed or resumed from."""
        return self._kept.stored.version if self._kept else None

    # -- public API --------------------------------------------------------------------

    def publish(
        self, state_dict: Mapping[str, Any], *, metadata: Mapping[str, str] | None = None, files: FilesArg = None
    ) -> int:
        """Publish synchronously; returns the new version number.

        ``files``: the version's model files (:data:`FilesArg`; None keeps the previous
        version's). Floating tensors are served as ``dtype``, and so a ``config.json``
        among them names ``dtype`` (:func:`~bulletin.model_files.with_served_dtype`; the
        result's ``notes`` say what changed)."""
        self._check_open()
        self.flush()
        checked = check_metadata(metadata or {})  # bad input changes nothing: checked first
        given = self._files(files, cast=True)
        return self._publish(self._prepare(state_dict), checked, given).version

    def publish_checkpoint(
        self,
        path: str | os.PathLike[str],
        *,
        metadata: Mapping[str, str] | None = None,
        files: FilesArg = None,
        keep_files: bool = False,
        cast: bool = False,
    ) -> PublishResult:
        """Publish a safetensors checkpoint (file or directory).

        ``cast``: serve floating tensors as ``dtype``, cast exactly as :meth:`publish`
        casts them (:func:`~bulletin.snapshot.cast_served`), with ``config.json`` naming
        it; without, the checkpoint's dtypes are served as they are. ``files``: the
        version's model files; None takes a directory's own (the default rule of
        :func:`~bulletin.model_files.select_model_files`), or, for a single file or a
        directory without any, keeps the previous version's; ``keep_files`` keeps the
        previous version's whatever the directory holds.
        """
        self._check_open()
        checked = check_metadata(metadata or {})
        if keep_files and files is not None:
            raise ConfigError("give files or keep_files, not both")
        if files is None and not keep_files and Path(path).is_dir():
            selected = select_model_files(path)
            files = selected if len(selected) else None
        given = self._files(files, cast=cast)
        self.flush()
        with Checkpoint(path) as ckpt:
            specs = ckpt.specs
            bits: dict[str, NDArray[np.unsignedinteger]] = {}
            for name, spec in specs.items():
                if cast:
                    dtype, bits[name] = cast_served(ckpt.bits(name), spec.dtype, self.dtype)
                    specs[name] = TensorSpec(name, dtype, spec.shape)
                else:
                    bits[name] = np.array(ckpt.bits(name), copy=True)
        self._ready()
        self._next_version += 1
        self._prepared_specs = specs
        return self._publish(Snapshot(specs, bits, {}), checked, given)

    def publish_async(
        self, state_dict: Mapping[str, Any], *, metadata: Mapping[str, str] | None = None, files: FilesArg = None
    ) -> Future[PublishResult]:
        """Snapshot now (a cast copy), publish in the background; blocks only when the
        bounded queue is full. Errors surface from the future and from flush/close.
        ``files`` as for :meth:`publish` (read now)."""
        self._check_open()
        self._raise_background_error()
        checked = check_metadata(metadata or {})
        given = self._files(files, cast=True)
        epoch = self._epoch  # read before _prepare: a failure from now on refuses this snapshot
        snap = self._prepare(state_dict)
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
        return self._kept is not None and self._run.refresh_head(self._kept.stored)

    def flush(self) -> None:
        """Wait until every queued publish is committed; raise the first background error."""
        self._queue.join()
        self._raise_background_error()

    def close(self) -> None:
        """Flush, make sure the head shows the last version, then stop the background
        worker. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
            if self._kept is not None and not self._failed:
                # A commit only logs a store failure while moving the head; move it now.
                self._run.advance_head(self._kept.stored)
        finally:
            self._closed = True
            if self._worker is not None:
                self._queue.put(None)
                self._worker.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInput("this Publisher is closed")

    def _files(self, files: FilesArg, *, cast: bool) -> _Files:
        """``files`` checked (before anything is snapshotted or uploaded), with
        ``config.json`` naming the served dtype when floating tensors are cast to it."""
        given = _as_model_files(files)
        if given is None or not cast:
            return _Files(given)
        served, notes = with_served_dtype(given, self.dtype)
        return _Files(served, notes)

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

    def _prepare(self, state_dict: Mapping[str, Any]) -> Snapshot:
        """The part of a publish that must happen before the caller may touch its tensors:
        the host snapshot, or for GPU tensors the diff on the device."""
        self._ready()
        full = (self._next_version - 1) % self.keyframe_every == 0
        try:
            snap = snapshot(state_dict, dtype=self.dtype, device=self._device, full=full)
        except BaseException:
            self._failed = True  # tensors diffed before the bad one moved the device's bits on
            raise
        if snap.changes and snap.specs != self._prepared_specs:
            # A layout change is published in full: fetch what only the device has, now,
            # before the next diff moves the kept bits on.
            host = {**snap.bits, **{name: self._device.host_bits(name) for name in snap.changes}}
            snap = Snapshot(snap.specs, host, snap.aliases, {}, snap.old_bits)
        self._prepared_specs = snap.specs
        self._next_version += 1
        return snap

    def _ready(self) -> None:
        """Before a snapshot: know the run's newest version; settle a failed publish."""
        if not self._resumed:
            self._resume()
        elif self._failed:
            self._recover()

    def _resume(self) -> None:
        """Continue the run from its newest committed version (after a restart)."""
        tip = self._run.tip()
        if tip is not None:
            self._run.advance_head(tip)  # a crash may have left the head behind a commit
            self._kept = self._rebuild(tip)
            self._next_version = tip.version + 1
        self._resumed = True

    def _rebuild(self, stored: StoredManifest) -> _Kept:
        """A committed version's bits, reconstructed from the run."""
        held = ArrayTarget()
        execute(self._run, plan(self._run, stored, None), held, None)
        fps = dict(stored.manifest.fingerprints)
        return _Kept(dict(stored.manifest.specs), dict(held.arrays), fps, stored, manifest_files(stored.manifest))

    def _failure(self, exc: BaseException) -> None:
        """A publish failed after its snapshot: the device's kept bits and the version
        counter may be ahead of the last commit, and later snapshots were diffed against
        bits that were not committed. Refuse those; the next snapshot recovers first."""
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
                raise
            self._pending = None
            files = manifest_files(pending.manifest)
            self._kept = _Kept(pending.specs, pending.bits, pending.fingerprints, stored, files)
            self.results.append(
                _result(pending.manifest, stored, files_uploaded=pending.files_uploaded, notes=pending.notes)
            )
        kept = self._kept
        tip = self._run.tip()
        # A newer version is another writer's. A run rolled back or rewritten under the
        # version kept is for the chain check of the publish itself (_check_chain).
        if tip is not None and (kept is None or tip.version > kept.stored.version):
            ours = f"version {kept.stored.version}" if kept else "nothing yet"
            theirs = f"version {tip.version} by writer {tip.manifest.writer}"
            raise VersionConflict(
                f"{self.run}: the run's newest committed version is {theirs}, but this publisher "
                f"(writer {self.writer}) committed {ours}: another trainer is publishing to the same "
                "run; this publisher cannot continue (a new Publisher resumes from the run's tip)"
            )
        if kept is not None and kept.bits.keys() != kept.specs.keys():
            kept = self._kept = self._rebuild(kept.stored)  # bits diffed on the device are not on the host
        self._device = DeviceKept(self.dtype)  # GPU tensors start again from the committed bits
        self._next_version = (kept.stored.version if kept else 0) + 1
        self._prepared_specs = dict(kept.specs) if kept else None
        self._failed = False

    def _check_chain(self, kept: _Kept) -> None:
        """The run still holds the version this publisher continues, as committed or resumed
        from: a run rolled back or rewritten since is ``RunRewound`` / ``ChainMismatch``
        (never a fork chained to a version the bucket no longer has)."""
        head = self._run.read_head()
        ours = (kept.stored.version, kept.stored.digest)
        if head is not None and (head.head.version, head.head.manifest_digest) == ours:
            return  # the head names what this publisher holds: one small read
        tip = self._run.tip()
        held = Held.at(kept.stored)
        try:
            if tip is None:
                raise RunRewound(f"{self.run}: version {held.version} held here, but the run has no version left")
            check_chain(self._run, held, tip, tip=True)
        except ChainMismatch as exc:
            message = f"{exc}; this publisher cannot continue (a new Publisher resumes from the run's tip)"
            raise type(exc)(message) from None

    def _publish(self, snap: Snapshot, metadata: dict[str, str], files: _Files) -> PublishResult:
        try:
            return self._publish_once(snap, metadata, files)
        except BaseException as exc:
            self._failure(exc)
            raise

    def _publish_once(self, snap: Snapshot, metadata: dict[str, str], files: _Files) -> PublishResult:
        if not self._resumed:
            self._resume()
        kept = self._kept
        if kept is not None:
            self._check_chain(kept)
        version = kept.stored.version + 1 if kept else 1
        same_layout = kept is not None and kept.specs == snap.specs
        patch: Patch | None = None
        if kept is not None and same_layout:
            patch = self._diff(kept, snap)
            fps = {td.spec.name: td.target_fingerprint for td in patch}
        else:
            fps = {name: fingerprint(bits) for name, bits in snap.bits.items()}
        is_keyframe = not same_layout or (version - 1) % self.keyframe_every == 0
        if is_keyframe and snap.changes:  # cannot happen: _prepare sends keyframes in full
            raise InternalError("a keyframe version was diffed on the device")
        patch_ref = self._upload_patch(version, patch, kept, snap) if kept is not None and patch is not None else None
        keyframe_ref = self._upload_keyframe(version, snap) if is_keyframe else None
        file_refs, files_uploaded = self._upload_files(version, kept, files.files)
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
        manifest = manifest_type(
            run=self.run,
            version=version,
            parent_version=kept.stored.version if kept else None,
            parent_digest=kept.stored.digest if kept else None,
            created_at=datetime.now(UTC),
            writer=self.writer,
            tensors=tuple(
                TensorEntry(name=s.name, dtype=s.dtype, shape=s.shape, fingerprint=format_fingerprint(fps[s.name]))  # type: ignore[arg-type]
                for s in (snap.specs[n] for n in sorted(snap.specs))
            ),
            patch=patch_ref,
            keyframe=keyframe_ref,
            stats=VersionStats(
                total_elements=sum(s.numel for s in snap.specs.values()),
                total_bytes=sum(s.nbytes for s in snap.specs.values()),
                patch_bytes=sum(r.size for r in patch_ref.shards) if patch_ref else 0,
                keyframe_bytes=sum(r.size for r in keyframe_ref.files) if keyframe_ref else 0,
            ),
            metadata=metadata,
            **extra,
        )
        try:
            stored = self._run.commit(manifest)  # raises VersionConflict for a stale trainer
        except StorageUnavailable as exc:
            if not isinstance(exc, AccessDenied):  # the manifest may exist: settled next time
                self._pending = _Pending(manifest, dict(snap.specs), snap.bits, fps, files_uploaded, files.notes)
            raise
        # Host bits of tensors diffed on the device go stale; the device keeps them.
        self._kept = _Kept(dict(snap.specs), snap.bits, fps, stored, file_refs)
        result = _result(manifest, stored, files_uploaded=files_uploaded, notes=files.notes)
        self.results.append(result)
        return result

    def _upload_files(
        self, version: int, kept: _Kept | None, files: ModelFiles | None
    ) -> tuple[tuple[FileRef, ...], int]:
        """The version's file refs, and the bytes uploaded for them: the parent's refs when
        no files were given; otherwise one per file, naming the object the parent named for
        the same bytes (nothing uploaded) or a new one, uploaded create-only now."""
        previous = kept.files if kept is not None else ()
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
            self._run.upload(items, self._on_bytes)
        return tuple(refs), sum(len(content) for content in items.values())

    def _diff(self, kept: _Kept, snap: Snapshot) -> Patch:
        """The patch from the kept version to ``snap``: host tensors diffed here (the
        codec's chunked diff, target fingerprints in O(changed)), GPU tensors as their
        device already found."""
        host = {name: spec for name, spec in snap.specs.items() if name not in snap.changes}
        patch = diff(
            host,
            {name: snap.old_bits[name] if name in snap.old_bits else kept.bits[name] for name in host},
            {name: snap.bits[name] for name in host},
            base_fingerprints={name: kept.fingerprints[name] for name in host},
        )
        deltas = dict(patch.tensors)
        for name, change in snap.changes.items():
            deltas[name] = TensorDelta.from_change(snap.specs[name], change, kept.fingerprints[name])
        return Patch({name: deltas[name] for name in sorted(deltas)})

    def _base(self, kept: _Kept, snap: Snapshot, patch: Patch) -> dict[str, NDArray[np.unsignedinteger]]:
        """The bits ``patch`` was diffed from, for the context codec: the host's, or for a
        tensor diffed on its device, the device's (now the new bits) less the deltas."""
        base = {name: snap.old_bits[name] if name in snap.old_bits else kept.bits[name] for name in snap.bits}
        for name in snap.changes:
            bits = self._device.host_bits(name)
            td = patch.tensors[name]
            bits.reshape(-1)[td.indices] -= td.delta  # new - delta wraps back to the old bits
            base[name] = bits
        return base

    def _upload_patch(self, version: int, patch: Patch, kept: _Kept, snap: Snapshot) -> PatchRef:
        codec: str
        if self.codec == AUTO_CODEC:
            codec, shards = encode_smallest(
                patch, base=self._base(kept, snap, patch), max_shard_bytes=self.max_shard_bytes
            )
        else:
            codec = check_patch_codec(self.codec)
            base = self._base(kept, snap, patch) if codec == CONTEXT_CODEC else None
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

    def _upload_keyframe(self, version: int, snap: Snapshot) -> KeyframeRef:
        prefix = keyframe_prefix(version, self.writer)
        file_plan = plan_checkpoint(snap.specs, self.keyframe_file_bytes)

        def upload_one(file_name: str, content: bytes) -> ObjectRef:
            key = f"{prefix}/{file_name}"
            self._run.upload({key: content}, self._on_bytes)
            return ObjectRef(key=key, size=len(content), sha256=sha256_hex(content))

        # Files are built inside the workers so that at most `workers` of them are in memory.
        workers = max(1, min(4, self._run.max_workers))

        def build_and_upload(file_name: str, shard: list[TensorSpec]) -> ObjectRef:
            return upload_one(file_name, safetensors_bytes(shard, snap.bits))

        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(build_and_upload, file_name, shard) for file_name, shard in file_plan]
            refs = [f.result() for f in futures]
        if len(file_plan) > 1:
            refs.append(upload_one(INDEX_NAME, hf_index(file_plan)))
        return KeyframeRef(prefix=prefix, files=tuple(refs))
