"""A replica folder that writes about a patch per version: an immutable base plus a log.

:class:`LogDirTarget` is :class:`~bulletin.target.LocalDirTarget`'s ``log`` layout
(docs/FORMAT.md 9.1). The dense layout rewrites its model folder in place for every
version, and scattered changes dirty every page of it: about the whole model written
per version. Here the model folder (the **base**) is never written after it is made;
each activated version appends one **log file**, its verified patch re-encoded
(``patcher.encode``, zstd), and ``state.json`` (:class:`~schemas.local_state.LocalStateV3`)
lists the base and the log entries in order, each with its size and SHA-256. The bits
of the version held are the base's (memory-mapped, read only) plus in-memory
**overlays** of the elements changed since the base (:mod:`bulletin.overlay`: about 6
bytes per changed BF16 element, a 4-byte index and the bits), bounded by compaction.

Layout::

    state.json          LocalStateV3: version, fingerprints, base folder, base version and
                        fingerprints, log entries (file, size, SHA-256), model files
    model-<id>/         the base: safetensors files of base_version, and model files
    log/<id>.patch      one verified patch per activated version since the base
    files/<sha256>      a copy of each model file of the version held
    current ->          symlink to the base, only while the log is empty (the base is
                        then exactly the version held, model files included)
    .bulletin-lock      the writer's lock, as for the dense layout

**Disk writes per version** are the log file (about the patch's size) and
``state.json`` (about 60 bytes per tensor), fsynced. **Compaction** writes a new base
(a copy of the old one with the overlay scattered in, fsynced, the changed tensors
fingerprinted again) and commits it through ``state.json``. It starts after an
activation once the overlays hold more than ``compact_share`` of the model's elements
(or the log half of :data:`~schemas.local_state.MAX_LOG_ENTRIES` entries), and runs
**in the background**, on a thread of its own, while versions go on being applied and
activated:

- it writes the version held when it started (its *snapshot*: the overlay then is
  frozen, and what is applied from then on goes to a new overlay over it) into a new
  folder, reading the old base's files and nothing the writer changes;
- its commit is the usual ``state.json`` replace under the writer's lock, between two
  changes (never while an apply or a load waits for its activation): the new base,
  holding the snapshot's version, plus the log entries activated since, whose files
  stay. The frozen overlay is dropped; the one over it is exactly what the new base
  lacks. An activation waits at most for that commit, never for the copy;
- a keyframe activated meanwhile makes it moot: it is dropped and its folder removed;
- :meth:`LogDirTarget.close` lets a running compaction finish (its commit too, unless a
  change is pending). A process killed at any instant reopens on the old base or the
  new one, each with the log that leads from it to the version committed last.

**Memory** stays bounded: an apply waits for the running compaction once the overlays
hold :data:`BACKLOG_FACTOR` times ``compact_share`` of the elements (versions arriving
faster than the disk copies the model). :meth:`LogDirTarget.compact` compacts in the
caller's thread (``bulletin sync --materialize``, also how ``current`` is made loadable
again); ``background=False`` runs the automatic compaction inside the activation.
:attr:`LogDirTarget.written` counts the bytes written, per version and per compaction.

**Crash safety.** As for the dense layout, replacing ``state.json`` is the one commit
point, and nothing it names is ever changed: a log file is written (temp name, fsync,
rename) before the state that lists it, a new base likewise; ``current`` is removed
before a state whose log is not empty is committed and pointed at the base again
after one whose log is. Every open under the lock re-reads the log (each file's size
and SHA-256, then the fingerprint chain from the base's fingerprints to the state's,
every changed element verified against the base's bits) and removes what the state
does not name (log files, model folders, temp files, copies). A log that does not
verify leaves the folder unverified: :meth:`~LogDirTarget.restored` reports nothing
and the next sync rebuilds it from a keyframe.

**Threads.** One thread drives the target (the sync loop: applies, activations, loads);
the compaction thread only writes its own folder and commits under the target's lock.
Bit mappings handed out (:meth:`~LogDirTarget.context_bits`) stay valid across a
compaction's commit: they keep the old base mapped, whose bits plus the overlays they
were given are still the version held.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import shutil
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Final, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import ValidationError

from bulletin.checkpoint import INDEX_NAME, Checkpoint
from bulletin.errors import (
    BulletinError,
    ConfigError,
    DigestMismatch,
    FormatError,
    InvalidInput,
    VerificationFailed,
)
from bulletin.fileio import fsync_dir, os_errors, stage_file, write_atomic
from bulletin.keyspace import check_run_name
from bulletin.overlay import Layered, Overlay, advance
from bulletin.target import (
    _ATOMIC_TEMP,
    _TEMP_NAME,
    Bits,
    FetchFiles,
    Held,
    LocalDirTarget,
    WriteKeyframe,
)
from patcher.apply import apply as apply_patch
from patcher.context import select_ranks
from patcher.context_decode import CodedChanges, needs_base, resolve, resolve_transition
from patcher.decode import decode
from patcher.encode import encode
from patcher.fingerprint import fingerprint, format_fingerprint, parse_fingerprint
from patcher.format import TensorInfo
from patcher.patch import Patch, TensorDelta, TensorSpec, check_layout
from schemas.local_state import MAX_LOG_ENTRIES, LocalStateV1, LocalStateV3, LogEntryV1, local_state_files
from schemas.manifest import FileRef

__all__ = [
    "BACKLOG_FACTOR",
    "DEFAULT_COMPACT_SHARE",
    "LOG_MAGIC",
    "Layout",
    "LogDirTarget",
    "WriteKind",
    "decode_log",
    "encode_log",
    "open_replica",
]

log = logging.getLogger("bulletin.replica_log")

#: The replica layouts (``bulletin sync --layout``).
Layout = Literal["dense", "log"]
#: What :attr:`LogDirTarget.written` counts bytes for: ``version`` (a log file and the
#: state per applied version), ``compaction`` (a new base), ``keyframe`` (a keyframe's
#: base, streamed in).
WriteKind = Literal["version", "compaction", "keyframe"]
#: Compact once the overlay holds this share of the model's elements. The overlays then
#: hold 3x that share of a BF16 model's size (6 bytes per changed element), and at most
#: BACKLOG_FACTOR times that: 0.09x the model, which leaves a catch-up's working set
#: (a round of folded changes, sync.ROUND_SHARE) room under 0.25x. At 0.4% of the
#: elements changed per version, a compaction every 5 versions or more.
DEFAULT_COMPACT_SHARE: Final = 0.02
#: An apply waits for the running compaction once the overlays hold this many times
#: ``compact_share`` of the elements: what bounds their memory.
BACKLOG_FACTOR: Final = 1.5
#: First bytes of a log file (docs/FORMAT.md 9.1).
LOG_MAGIC: Final = b"BLTNLOG\x01"
#: Shards in one log file at most (the decoder's own cap is higher).
_MAX_LOG_SHARDS: Final = 1 << 16
#: Compact, whatever the overlay's size, once the log holds this many entries (half the
#: state's cap, so that versions go on while it runs).
_COMPACT_AT_ENTRIES: Final = MAX_LOG_ENTRIES // 2
_LOG_DIR: Final = "log"
_LOG_NAME = re.compile(r"[0-9a-f]{12}\.patch")


def encode_log(patch: Patch) -> bytes:
    """A log file: :data:`LOG_MAGIC`, the shard count (u32 LE), then each shard of
    ``patch`` (zstd codec, no context needed to read it back) as u64 LE length + bytes."""
    shards = encode(patch, codec="zstd")
    parts = [LOG_MAGIC, struct.pack("<I", len(shards))]
    for shard in shards:
        parts += [struct.pack("<Q", len(shard)), shard]
    return b"".join(parts)


def decode_log(data: bytes, specs: Mapping[str, TensorSpec], *, source: str) -> Patch:
    """The patch of a log file (``FormatError`` for anything but exactly what
    :func:`encode_log` writes, ``IncompatibleTensors`` for another layout)."""
    view = memoryview(data)
    if len(view) < 12 or bytes(view[:8]) != LOG_MAGIC:
        raise FormatError(f"{source}: not a Bulletin replica log file")
    (count,) = struct.unpack_from("<I", view, 8)
    if not 1 <= count <= _MAX_LOG_SHARDS:
        raise FormatError(f"{source}: {count} shards")
    pos, shards = 12, []
    for _ in range(count):
        if pos + 8 > len(view):
            raise FormatError(f"{source}: truncated")
        (size,) = struct.unpack_from("<Q", view, pos)
        if size > len(view) - pos - 8:
            raise FormatError(f"{source}: a shard runs past the end")
        shards.append(view[pos + 8 : pos + 8 + size])
        pos += 8 + size
    if pos != len(view):
        raise FormatError(f"{source}: {len(view) - pos} trailing bytes")
    return decode(shards, specs=specs)


class _Cancelled(Exception):
    """A background compaction stops: a keyframe replaced its base, or the target closes."""


@dataclass(eq=False, slots=True)
class _Compaction:
    """A new base being written: the version held when it started (its snapshot)."""

    name: str
    """The new base's folder."""
    version: int
    fingerprints: dict[str, int]
    """Of ``version``: what the new base must hold."""
    overlay: Overlay
    """The old base -> ``version`` (frozen when it started)."""
    logged: int
    """Log entries the new base holds (the first ones): those after it stay."""
    generation: int
    """The target's base generation it was taken from: it commits only onto that one."""
    sources: list[Path]
    """The old base's tensor files, then its HF index (if it has one)."""
    cancelled: bool = False
    written: int = 0
    thread: threading.Thread | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def check(self) -> None:
        if self.cancelled:
            raise _Cancelled


class LogDirTarget(LocalDirTarget):
    """A replica folder in the ``log`` layout (module docstring): O(patch) writes per version.

    Opens a dense folder too (its model folder becomes the base, with an empty log, and
    the first activation writes the ``log`` state). A dense :class:`LocalDirTarget`
    refuses a ``log`` folder (``ConfigError``): its state names a base that need not be
    the version held. ``compact_share`` and ``background``: see the module docstring.
    ``on_written(kind, nbytes)`` is called with what each change wrote (the bytes
    :attr:`written` adds up; from the compaction thread for a background compaction).
    """

    LOG = _LOG_DIR

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        run: str | None = None,
        compact_share: float = DEFAULT_COMPACT_SHARE,
        background: bool = True,
        on_written: Callable[[WriteKind, int], None] | None = None,
    ) -> None:
        if not 0 < compact_share <= 1:
            raise ConfigError(f"compact_share must be in (0, 1], not {compact_share!r}")
        self.dir = Path(directory)
        self.run = None if run is None else check_run_name(run)
        self.compact_share = compact_share
        #: Whether an activation's compaction runs on a thread of its own.
        self.background = background
        self.on_written = on_written
        #: Bytes written, by what for (tensor files, log files, state files; not the file
        #: system's own writes).
        self.written: dict[WriteKind, int] = {"version": 0, "compaction": 0, "keyframe": 0}
        #: Compactions committed, and why the last one that failed did (None: none failed
        #: since the last that committed).
        self.compactions = 0
        self.last_compaction_error: str | None = None
        self._state: LocalStateV1 | None = None
        self._checkpoint: Checkpoint | None = None  # the base, read only
        self._pending: tuple[str, Checkpoint] | None = None  # a keyframe's new folder
        self._pending_fps: dict[str, int] | None = None
        self._journaled = False
        self._files: dict[str, str] = {}
        self._pending_files: dict[str, str] | None = None
        self._files_lost: str | None = None
        self._base_version = 0
        self._base_fps: dict[str, int] = {}
        self._log: list[LogEntryV1] = []
        #: The overlay a compaction writes into the new base (None: none runs, or it
        #: failed and this stays until the next starts), under ``_overlay``.
        self._frozen: Overlay | None = None
        self._overlay = Overlay()
        #: An apply onto the held base not yet activated: its changes (an overlay over
        #: ``_overlay``, merged into it by the activation) and its log file.
        self._pending_overlay: Overlay | None = None
        self._pending_entry: tuple[str, int, str] | None = None
        #: Why the log could not be verified (None: it was).
        self._log_lost: str | None = None
        self._job: _Compaction | None = None
        #: After a failed background compaction, the overlays' size the next one waits for
        #: (BACKLOG_FACTOR shares more: a failing disk is not copied to per version).
        self._retry_at = 0
        self._generation = 0  # one more for each new base
        self._closing = False
        # The writer's lock (each change and each read of what is held), and its
        # condition: a change ended, a compaction ended.
        self._mutex = threading.RLock()
        self._changed = threading.Condition(self._mutex)
        with os_errors(f"cannot create the replica folder {self.dir}"):
            self.dir.mkdir(parents=True, exist_ok=True)
        self._unlock = self._lock()
        try:
            self._state = self._read_state()
            self._files = local_state_files(self._state) if self._state is not None else {}
            self._recover()
        except BaseException:
            if self._checkpoint is not None:
                self._checkpoint.close()
            self._unlock()
            raise

    # -- recovery ------------------------------------------------------------------------

    def _recover(self) -> None:
        with os_errors(f"cannot recover {self.dir}"):
            self._roll_back()  # a dense folder's journal, if a dense writer died mid-apply
            state = self._state
            if state is not None:
                self._checkpoint = Checkpoint(self.dir / state.model_dir)
                if isinstance(state, LocalStateV3):
                    self._base_version, self._log = state.base_version, list(state.log)
                    self._base_fps = {n: parse_fingerprint(f) for n, f in state.base_fingerprints.items()}
                else:  # a dense folder: its model folder is the base
                    self._base_version, self._log = state.version, []
                    self._base_fps = dict(Held.recorded(state).fingerprints)
                self._replay(Held.recorded(state).fingerprints)
                if not self._log:
                    missing = self._sync_files(state.model_dir, self._files)
                    if not missing and self._log_lost is None:
                        self._point_current(state.model_dir)
                else:
                    self._unlink_current()
                    missing = [path for path, digest in self._files.items() if self._copy(digest) is None]
                self._note_lost_files(missing, state.version)
            self._drop_copies(set(self._files.values()))
            self._tidy()

    def _replay(self, record: Mapping[str, int]) -> None:
        """Rebuild the overlay from the log, verifying every entry (module docstring)."""
        assert self._checkpoint is not None
        overlay, fps = Overlay(), dict(self._base_fps)
        try:
            for entry in self._log:
                path = self.dir / entry.file
                with os_errors(f"cannot read {path}"):
                    try:
                        data = path.read_bytes()
                    except FileNotFoundError:
                        raise DigestMismatch(f"{path}: log file of version {entry.version} is gone") from None
                if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
                    raise DigestMismatch(f"{path}: not the log file of version {entry.version} state.json names")
                patch = decode_log(data, self._checkpoint.specs, source=str(path))
                step, fps = advance(Layered(self._checkpoint, (overlay,)), patch, fps)
                overlay.absorb(step)
            if fps != dict(record):
                raise VerificationFailed("the log does not end at the fingerprints state.json records")
        except BulletinError as exc:
            self._log_lost = f"the patch log does not verify ({exc})"
            log.warning("%s: %s; the next sync rebuilds the folder from a keyframe", self.dir, self._log_lost)
            return
        self._overlay = overlay

    def _tidy(self) -> None:
        """Remove what state.json does not name: model folders, log files, temp files."""
        keep = self._state.model_dir if self._state is not None else None
        for entry in list(os.scandir(self.dir)):
            if entry.is_dir(follow_symlinks=False):
                if entry.name != keep and entry.name.startswith("model-"):
                    self._remove_model(entry.name)
            elif _TEMP_NAME.fullmatch(entry.name):
                os.unlink(entry.path)
        self._drop_logs({entry.file for entry in self._log})

    def _drop_logs(self, keep: set[str]) -> None:
        folder = self.dir / self.LOG
        with os_errors(f"cannot tidy {folder}"):
            if not folder.is_dir():
                return
            dropped = False
            for entry in list(os.scandir(folder)):
                rel = f"{self.LOG}/{entry.name}"
                if rel not in keep and (_LOG_NAME.fullmatch(entry.name) or _ATOMIC_TEMP.fullmatch(entry.name)):
                    os.unlink(entry.path)
                    dropped = True
            if dropped:
                fsync_dir(folder)

    def _unlink_current(self) -> None:
        link = self.dir / self.CURRENT
        if os.path.islink(link):
            os.unlink(link)
            fsync_dir(self.dir)
        elif os.path.lexists(link):
            raise ConfigError(f"{link} is not the symlink Bulletin keeps there: move it away")

    # -- what is held --------------------------------------------------------------------

    def restored(self) -> Held | None:
        with self._mutex:
            if self._log_lost is not None:
                return None
            return super().restored()

    @property
    def overlay_elements(self) -> int:
        """Elements the version held differs from the base at, as the overlays count them
        (what compaction is sized by; one changed before and after a compaction's start
        counts twice while it runs)."""
        with self._mutex:
            return self._overlay.elements + (self._frozen.elements if self._frozen is not None else 0)

    @property
    def log_entries(self) -> int:
        """Patches in the log of the version held (0: the base is that version)."""
        with self._mutex:
            return len(self._log)

    @property
    def compacting(self) -> bool:
        """Whether a compaction is running."""
        with self._mutex:
            return self._job is not None

    @property
    def staged_path(self) -> Path:
        """The folder holding what was loaded but not activated, or the base while it is
        exactly the version held (no log, nothing applied); else ``InvalidInput``:
        :meth:`compact` first."""
        with self._mutex:
            if self._pending is not None:
                return (self.dir / self._pending[0]).resolve()
            if self._state is None:
                raise InvalidInput("nothing is held yet: load a keyframe first")
            if self._log or self._pending_overlay is not None:
                raise InvalidInput(f"{self.dir}: the version is a base plus a log; compact() makes a loadable folder")
            return (self.dir / self._state.model_dir).resolve()

    @property
    def model_path(self) -> Path | None:
        """``current``, while it exists: the base, when it is exactly the version held."""
        with self._mutex:
            return self.dir / self.CURRENT if self._state is not None and not self._log else None

    def _layers(self) -> Layered:
        """The version held, or the one a pending apply makes (under the lock)."""
        assert self._checkpoint is not None
        frozen = () if self._frozen is None else (self._frozen,)
        step = () if self._pending_overlay is None else (self._pending_overlay,)
        return Layered(self._checkpoint, (*frozen, self._overlay, *step))

    def context_bits(self) -> Mapping[str, Bits] | None:
        with self._mutex:
            if self._pending is not None:
                ckpt = self._pending[1]
                return {name: ckpt.bits(name) for name in ckpt.specs}
            if self._checkpoint is None:
                return None
            return self._layers()

    @property
    def resolves_context(self) -> bool:
        # A context-coded patch is resolved against the base's map read through the
        # overlays: context_bits would copy every changed tensor whole (O(model)).
        return True

    def resolve_context(
        self,
        changes: Sequence[CodedChanges],
        tensors: Mapping[str, TensorInfo],
        fingerprints: Mapping[str, int],
        *,
        pending: Patch | None = None,
    ) -> Patch:
        """One context-coded transition's patch, resolved against the bits held (those
        :meth:`context_bits` gives) without copying them: each entry's pass over its
        tensor reads the base's map with the overlays' changes (and ``pending``'s) laid
        over it. Reads only."""
        with self._mutex:
            if self._pending is not None:  # a keyframe's new folder, written in place
                layers = Layered(self._pending[1], ())
            elif self._checkpoint is None:
                raise InvalidInput("nothing is held yet: load a keyframe first")
            else:
                layers = self._layers()
        check_layout({name: info.spec for name, info in tensors.items()}, layers.specs)

        def entry(ch: CodedChanges, step: TensorDelta | None) -> NDArray[np.int64]:
            e, dtype = ch.entry, tensors[ch.entry.tensor].spec.dtype
            if not needs_base(e):
                return resolve(ch, dtype, None)
            base, overlay = layers.base_bits(e.tensor), layers.overlay(e.tensor, step)
            return select_ranks(base, dtype, ch.window, e.start, e.stop, ch.classes, ch.ranks, overlay=overlay)

        return resolve_transition(changes, tensors, fingerprints, entry, pending=pending, holder="the folder")

    def full_fingerprints(self) -> dict[str, int]:
        bits = self.context_bits()  # one consistent view, hashed without holding the lock
        return {} if bits is None else {name: fingerprint(bits[name]) for name in bits}

    # -- changes -------------------------------------------------------------------------

    def _busy(self) -> bool:
        """A change is under way (loaded, applied or files staged, not yet activated)."""
        return self._pending is not None or self._pending_overlay is not None or self._pending_files is not None

    def _count(self, kind: WriteKind, nbytes: int) -> None:
        self.written[kind] += nbytes
        if self.on_written is not None:
            self.on_written(kind, nbytes)

    def load_full(self, tensors: Mapping[str, Bits], specs: Mapping[str, TensorSpec]) -> None:
        with self._mutex:
            super().load_full(tensors, specs)

    def load_keyframe(
        self, write: WriteKeyframe, fingerprints: Mapping[str, int], *, scratch_dir: Path | None = None
    ) -> None:
        with self._mutex:
            super().load_keyframe(write, fingerprints, scratch_dir=scratch_dir)

    def apply(self, patch: Patch, fingerprints: Mapping[str, int]) -> dict[str, int]:
        with self._changed:
            if self._pending is not None:  # a keyframe's new folder: written in place, as dense
                _, ckpt = self._pending
                patch.check_layout(ckpt.specs)
                new_fps = apply_patch(patch, {name: ckpt.bits(name) for name in ckpt.specs}, fingerprints)
                ckpt.flush()
                self._pending_fps = new_fps
                return new_fps
            if self._state is None or self._checkpoint is None:
                raise InvalidInput("nothing is held yet: load a keyframe first")
            if self._pending_overlay is not None:
                raise InvalidInput("an apply is pending: activate or abort it before applying again")
            self._make_room()
            step, new_fps = advance(self._layers(), patch, fingerprints)
            data = encode_log(patch)
            name = f"{self.LOG}/{secrets.token_hex(6)}.patch"
            with os_errors(f"cannot create {self.dir / self.LOG}"):
                (self.dir / self.LOG).mkdir(exist_ok=True)
            write_atomic(self.dir / name, [data])  # fsynced, renamed, the folder fsynced
            self._count("version", len(data))
            self._pending_overlay = step
            self._pending_entry = (name, len(data), hashlib.sha256(data).hexdigest())
            self._pending_fps = new_fps
            return new_fps

    def _make_room(self) -> None:
        """Bound the overlays and the log before an apply adds to them: wait for the
        running compaction past :data:`BACKLOG_FACTOR` times the share, and compact here
        if the log is full and none runs (one that failed)."""
        if self._busy():
            return  # a compaction cannot commit before this change ends: never wait for it
        bound = BACKLOG_FACTOR * self.compact_share * self._numel()
        if self._job is not None and (len(self._log) >= MAX_LOG_ENTRIES or self._elements() > bound):
            log.warning(
                "%s: versions outrun the compaction (the overlays hold %d elements, the log %d entries); "
                "waiting for it",
                self.dir,
                self._elements(),
                len(self._log),
            )
            self._changed.wait_for(lambda: self._job is None)
        if len(self._log) >= MAX_LOG_ENTRIES:
            self._remove_model(self._compact_now(), quiet=True)

    def _elements(self) -> int:
        return self._overlay.elements + (self._frozen.elements if self._frozen is not None else 0)

    def _discard_pending(self) -> None:
        with self._changed:
            if self._pending_entry is not None:
                with os_errors(f"cannot remove {self.dir / self._pending_entry[0]}"):
                    (self.dir / self._pending_entry[0]).unlink(missing_ok=True)
            self._pending_entry = None
            self._pending_overlay = None
            super()._discard_pending()
            self._changed.notify_all()

    def stage_files(self, files: Sequence[FileRef], fetch: FetchFiles) -> None:
        with self._mutex:
            wanted = {f.path: f.sha256 for f in files}
            if self._pending is not None:  # a new folder gets them as in the dense layout
                super().stage_files(files, fetch)
                return
            if self._state is None:
                raise InvalidInput("nothing is held yet: load a keyframe first")
            if wanted == self._files and self._files_lost is None:
                return
            self._keep_copies(files, fetch)
            self._pending_files = wanted  # the base folder's own files change only at a commit

    def activate(self, version: int, *, manifest_digest: str | None = None) -> None:
        with self._changed:
            try:
                self._activate(version, manifest_digest)
            finally:
                self._changed.notify_all()  # a compaction waiting for this change to end

    def _activate(self, version: int, manifest_digest: str | None) -> None:
        if self._pending is not None:
            self._activate_base(version, manifest_digest)
            return
        if self._state is None or self._checkpoint is None:
            raise InvalidInput("nothing to activate: load or apply first")
        if self._pending_overlay is None and self._pending_files is None:
            raise InvalidInput("nothing to activate: load or apply first")
        entries = list(self._log)
        if self._pending_entry is not None:
            name, size, digest = self._pending_entry
            entries.append(LogEntryV1(version=version, file=name, size=size, sha256=digest))
        fps = self._pending_fps if self._pending_fps is not None else dict(Held.recorded(self._state).fingerprints)
        files = dict(sorted((self._pending_files if self._pending_files is not None else self._files).items()))
        state = self._log_state(version, manifest_digest, self._state.model_dir, entries, fps, files)
        if entries or files != self._files:
            # `current` names the base only while it is exactly the version held.
            with os_errors(f"cannot unlink {self.dir / self.CURRENT}"):
                self._unlink_current()
        self._count("version", self._commit(state, None))
        self._state, self._log, self._files = state, entries, files
        self._files_lost = None
        step, self._pending_overlay = self._pending_overlay, None
        if step is not None:
            try:
                self._overlay.absorb(step)
            except BaseException as exc:  # out of memory, half merged: the log on disk is right
                self._log_lost = f"the overlay could not be updated in memory ({exc!r})"
                raise
        self._pending_entry = None
        self._pending_fps = None
        self._pending_files = None
        try:
            with os_errors(f"cannot tidy {self.dir}"):
                if not entries:
                    self._sync_files(state.model_dir, files)
                    self._point_current(state.model_dir)
                self._drop_copies(set(files.values()))
            self._maybe_compact()
        except (BulletinError, OSError) as exc:
            log.warning(
                "%s: version %s is committed, but tidying up failed (the next open finishes it): %s",
                self.dir,
                version,
                exc,
            )

    def _numel(self) -> int:
        assert self._checkpoint is not None
        return sum(spec.numel for spec in self._checkpoint.specs.values())

    def _log_state(
        self,
        version: int,
        manifest_digest: str | None,
        model_dir: str,
        entries: list[LogEntryV1],
        fps: Mapping[str, int],
        files: dict[str, str],
        base: tuple[int, Mapping[str, int]] | None = None,
    ) -> LocalStateV3:
        base_version, base_fps = base if base is not None else (self._base_version, self._base_fps)
        try:
            return LocalStateV3(
                run=self.run,
                version=version,
                model_dir=model_dir,
                fingerprints={n: format_fingerprint(fp) for n, fp in sorted(fps.items())},
                manifest_digest=manifest_digest,
                updated_at=datetime.now(UTC),
                base_version=base_version,
                base_fingerprints={n: format_fingerprint(fp) for n, fp in sorted(base_fps.items())},
                log=entries,
                files=files,
            )
        except ValidationError as exc:
            raise InvalidInput(f"cannot activate version {version} here: {exc.errors()[0]['msg']}") from None

    def _commit(self, state: LocalStateV3, link_to: str | None) -> int:
        """Stage the state (and a ``current`` link to ``link_to``), then rename the state
        over state.json: the commit point. Returns the state's size in bytes."""
        state_path = self.dir / self.STATE
        data = state.model_dump_json().encode()
        staged = stage_file(state_path, [data])
        link_tmp: Path | None = None
        try:
            if link_to is not None:
                link_tmp = self._stage_link(link_to)
            with os_errors(f"cannot write {state_path}"):
                os.replace(staged, state_path)
        except BaseException:
            for tmp in (staged, link_tmp):
                if tmp is not None:
                    with os_errors(f"cannot remove {tmp}"):
                        tmp.unlink(missing_ok=True)
            raise
        if link_tmp is not None:
            with os_errors(f"cannot link {self.dir / self.CURRENT}"):
                os.replace(link_tmp, self.dir / self.CURRENT)
        fsync_dir(self.dir)
        return len(data)

    def _activate_base(self, version: int, manifest_digest: str | None) -> None:
        """A keyframe's folder (applied onto, maybe) becomes the base, with an empty log."""
        assert self._pending is not None
        name, ckpt = self._pending
        fps = self._pending_fps
        if fps is None:
            fps = {n: fingerprint(ckpt.bits(n)) for n in ckpt.specs}
        files = dict(sorted((self._pending_files if self._pending_files is not None else self._files).items()))
        state = self._log_state(version, manifest_digest, name, [], fps, files, base=(version, fps))
        old = self._state.model_dir if self._state is not None else None
        if self._job is not None:
            self._job.cancelled = True  # its base is about to go: it can never commit
        nbytes = self._commit(state, name)
        self._count("keyframe", nbytes + sum(os.path.getsize(path) for path in ckpt.files))
        self._adopt(state, fps, ckpt)
        self._settle_base(old)

    def _adopt(self, state: LocalStateV3, fps: dict[str, int], ckpt: Checkpoint | None) -> None:
        """Hold ``state``'s base (read only) with an empty log."""
        if ckpt is not None:
            ckpt.close()
        if self._checkpoint is not None:
            self._checkpoint.close()
        self._checkpoint = Checkpoint(self.dir / state.model_dir)
        self._state, self._files, self._files_lost, self._log_lost = state, dict(state.files), None, None
        self._base_version, self._base_fps, self._log = state.version, dict(fps), []
        self._frozen, self._overlay = None, Overlay()
        self._generation += 1
        self._retry_at = 0
        self._pending = None
        self._pending_fps = None
        self._pending_files = None
        self._pending_overlay = None
        self._pending_entry = None

    def _settle_base(self, replaced: str | None) -> None:
        """After a new base's commit: drop the old base, the log and unneeded copies."""
        try:
            if replaced is not None and self._state is not None and replaced != self._state.model_dir:
                self._mark(replaced)
                self._remove_model(replaced)
            self._drop_logs(set())
            self._drop_copies(set(self._files.values()))
        except (BulletinError, OSError) as exc:
            log.warning(
                "%s: a new base is committed, but tidying up failed (the next open finishes it): %s", self.dir, exc
            )

    # -- compaction ------------------------------------------------------------------------

    def _maybe_compact(self) -> None:
        """After an activation (nothing pending): start a compaction if one is due."""
        if self._job is not None or not self._log or self._log_lost is not None or self._files_lost is not None:
            return
        elements, share = self._elements(), self.compact_share * self._numel()
        if len(self._log) < _COMPACT_AT_ENTRIES and (elements <= share or elements < self._retry_at):
            return
        if not self.background:
            self._remove_model(self._compact_now(), quiet=True)
            return
        job = self._start()
        job.thread = threading.Thread(
            target=self._compact_in_background, args=(job,), name="bulletin-compaction", daemon=True
        )
        try:
            job.thread.start()
        except RuntimeError as exc:  # no thread to be had: the log stays, as for a failure
            self._end(job)
            log.warning("%s: cannot start a compaction (%s); the next activation tries again", self.dir, exc)

    def _start(self) -> _Compaction:
        """Freeze the overlays into the snapshot of a new compaction (nothing pending)."""
        assert self._state is not None and self._checkpoint is not None
        state = self._state
        frozen = self._overlay if self._frozen is None else self._frozen.under(self._overlay)
        self._frozen, self._overlay = frozen, Overlay()
        index = self.dir / state.model_dir / INDEX_NAME
        job = _Compaction(
            name=f"model-{secrets.token_hex(6)}",
            version=state.version,
            fingerprints=dict(Held.recorded(state).fingerprints),
            overlay=frozen,
            logged=len(self._log),
            generation=self._generation,
            sources=[*self._checkpoint.files, *([index] if index.is_file() else [])],
        )
        self._job = job
        return job

    def _write_base(self, job: _Compaction) -> None:
        """Write ``job``'s new base folder, fsynced: the old base's files copied, the
        frozen overlay scattered in, the changed tensors fingerprinted against the
        snapshot's. Reads nothing the writer changes, so it runs without the lock."""
        folder = self.dir / job.name
        with os_errors(f"cannot write {folder}"):
            os.mkdir(folder)
            os.close(os.open(folder / self.MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            copied = []
            for path in job.sources:  # the tensor files, then the HF index
                job.check()
                shutil.copyfile(path, folder / path.name)
                copied.append(folder / path.name)
            job.check()
            with Checkpoint(folder, writable=True) as ckpt:
                for tensor, (idx, vals) in job.overlay.tensors.items():
                    ckpt.bits(tensor).reshape(-1)[idx] = vals
                ckpt.flush()
                job.check()
                wrong = [t for t in job.overlay.tensors if fingerprint(ckpt.bits(t)) != job.fingerprints[t]]
            if wrong:
                raise VerificationFailed(f"{folder}: compacted {wrong[0]} misses its fingerprint")
            for path in copied:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fsync_dir(folder)
            job.written = sum(os.path.getsize(path) for path in copied)

    def _commit_compaction(self, job: _Compaction) -> str:
        """Commit ``job``'s base with the log entries activated since its snapshot (under
        the lock, nothing pending, the base it was taken from still held); returns the
        base it replaces, for the caller to remove."""
        assert self._state is not None
        state, entries, files = self._state, self._log[job.logged :], dict(self._files)
        if not entries:  # the base is the version: `current` points at it, files and all
            missing = self._sync_files(job.name, files)
            if missing:
                raise DigestMismatch(f"{self.dir}: the kept copies of {missing[:3]} cannot be read back")
        new = self._log_state(
            state.version,
            state.manifest_digest,
            job.name,
            entries,
            Held.recorded(state).fingerprints,
            files,
            base=(job.version, job.fingerprints),
        )
        base = Checkpoint(self.dir / job.name)
        try:
            nbytes = self._commit(new, None if entries else job.name)
        except BaseException:
            base.close()
            raise
        replaced = state.model_dir
        # The old base's map is left to whoever still reads it (bits handed out before):
        # dropped here, not closed; its folder may go, the map stays valid.
        self._checkpoint, self._frozen = base, None
        self._state, self._log = new, entries
        self._base_version, self._base_fps = job.version, dict(job.fingerprints)
        self._generation += 1
        self.compactions += 1
        self.last_compaction_error, self._retry_at = None, 0
        self._count("compaction", job.written + nbytes)
        try:
            self._mark(replaced)
            self._drop_logs({entry.file for entry in entries})
        except (BulletinError, OSError) as exc:
            log.warning(
                "%s: a compaction is committed, but tidying up failed (the next open finishes it): %s", self.dir, exc
            )
        return replaced

    def _compact_now(self) -> str:
        """Compact in this thread, holding the lock; returns the base replaced."""
        job = self._start()
        committed = False
        try:
            self._write_base(job)
            replaced = self._commit_compaction(job)
            committed = True
        finally:
            self._end(job)
            if not committed:
                self._remove_model(job.name, quiet=True)
        return replaced

    def _compact_in_background(self, job: _Compaction) -> None:
        """The compaction thread: write without the lock, then commit under it between
        two changes (module docstring). Never raises: a failure is logged and kept in
        :attr:`last_compaction_error`; the log stays, and the next activation tries again."""
        failure: Exception | None = None
        replaced: str | None = None
        try:
            try:
                self._write_base(job)
            except _Cancelled:
                pass
            except Exception as exc:
                failure = exc
            with self._changed:
                if failure is None and not job.cancelled:
                    self._changed.wait_for(lambda: job.cancelled or not self._busy() or self._closing)
                    if self._busy():  # closing with a change pending: that change decides
                        job.cancelled = True
                    if not job.cancelled and job.generation == self._generation:
                        try:
                            replaced = self._commit_compaction(job)
                        except Exception as exc:
                            failure = exc
                if failure is not None and not job.cancelled:
                    self.last_compaction_error = str(failure)
                    self._retry_at = self._elements() + int(BACKLOG_FACTOR * self.compact_share * self._numel())
                    log.warning(
                        "%s: a background compaction failed; the log stays and the next activation tries again: %s",
                        self.dir,
                        failure,
                    )
            # The base replaced, or the folder not committed, goes before the job ends (so
            # that wait_for_compaction() finds the folder tidy), without holding the lock.
            self._remove_model(replaced if replaced is not None else job.name, quiet=True)
        finally:
            with self._changed:
                self._end(job)

    def _end(self, job: _Compaction) -> None:
        if self._job is job:
            self._job = None
        job.done.set()
        self._changed.notify_all()

    def wait_for_compaction(self, timeout: float | None = None) -> bool:
        """Block until no compaction runs (False if ``timeout`` seconds passed first)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._job is None, timeout)

    def compact(self) -> None:
        """Write the version held as a new base folder and drop the log, in this thread
        (a background compaction running is waited for first); ``current`` then points at
        it (a loadable checkpoint). O(model) writes; nothing to do without a log."""
        with self._changed:
            if self._state is None or self._checkpoint is None:
                raise InvalidInput("nothing is held yet: load a keyframe first")
            if self._busy():
                raise InvalidInput("a change is pending: activate or abort it before compacting")
            if self._log_lost is not None or self._files_lost is not None:
                raise InvalidInput(f"{self.dir}: the version held is not verified; sync it from a keyframe")
            self._changed.wait_for(lambda: self._job is None)
            if not self._log:
                return
            replaced = self._compact_now()
        self._remove_model(replaced, quiet=True)

    def abort(self) -> None:
        with self._changed:
            self._pending_files = None
            self._discard_pending()
            self._drop_copies(set(self._files.values()))
            self._changed.notify_all()

    def close(self) -> None:
        """Release the files and the lock (idempotent), once a running compaction has
        ended: it commits unless a change is pending (dropped here, as for the dense
        layout, and rolled back by the next open)."""
        with self._changed:
            self._closing = True
            job = self._job
            if job is not None and self._busy():
                job.cancelled = True  # it could not commit: stop it at its next step
            self._changed.notify_all()
        if job is not None and job.thread is not None and job.thread is not threading.current_thread():
            job.thread.join()
        with self._mutex:
            if self._pending is not None:
                self._pending[1].close()
                self._pending = None
            if self._checkpoint is not None:
                self._checkpoint.close()
                self._checkpoint = None
            self._unlock()


def open_replica(
    directory: str | os.PathLike[str], *, run: str | None = None, layout: Layout = "dense"
) -> LocalDirTarget:
    """A replica folder's target in ``layout``: ``dense`` (:class:`LocalDirTarget`, a
    loadable folder rewritten per version) or ``log`` (:class:`LogDirTarget`)."""
    if layout == "dense":
        return LocalDirTarget(directory, run=run)
    if layout == "log":
        return LogDirTarget(directory, run=run)
    raise ConfigError(f"layout must be 'dense' or 'log', not {layout!r}")
