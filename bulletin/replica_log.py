"""A replica folder that writes about a patch per version: an immutable base plus a log.

:class:`LogDirTarget` is :class:`~bulletin.target.LocalDirTarget`'s ``log`` layout
(docs/FORMAT.md 9.1). The dense layout rewrites its model folder in place for every
version, and scattered changes dirty every page of it: about the whole model written
per version. Here the model folder (the **base**) is never written after it is made;
each activated version appends one **log file**, its verified patch re-encoded
(``patcher.encode``, zstd), and ``state.json`` (:class:`~schemas.local_state.LocalStateV3`)
lists the base and the log entries in order, each with its size and SHA-256. The bits
of the version held are the base's (memory-mapped, read only) plus an in-memory
**overlay** of the elements changed since the base: about 10 bytes per element
(an int64 index and the bits), bounded by compaction.

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
fingerprinted again) and commits it through ``state.json``: it runs after an
activation once the overlay holds more than ``compact_share`` of the model's elements
(or the log reaches :data:`~schemas.local_state.MAX_LOG_ENTRIES`), and on request
(:meth:`LogDirTarget.compact`, also how ``current`` is made loadable again).

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
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import shutil
import struct
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Final, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import ValidationError

from bulletin.checkpoint import Checkpoint
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
from bulletin.target import (
    _ATOMIC_TEMP,
    _TEMP_NAME,
    Bits,
    FetchFiles,
    Held,
    LocalDirTarget,
)
from patcher.apply import apply as apply_patch
from patcher.apply import check_bases
from patcher.decode import decode
from patcher.encode import encode
from patcher.fingerprint import fingerprint, fingerprint_delta, format_fingerprint, parse_fingerprint
from patcher.patch import Patch, TensorSpec
from schemas.local_state import MAX_LOG_ENTRIES, LocalStateV1, LocalStateV3, LogEntryV1, local_state_files
from schemas.manifest import FileRef

__all__ = ["DEFAULT_COMPACT_SHARE", "LOG_MAGIC", "Layout", "LogDirTarget", "decode_log", "encode_log", "open_replica"]

log = logging.getLogger("bulletin.replica_log")

#: The replica layouts (``bulletin sync --layout``).
Layout = Literal["dense", "log"]
#: Compact once the overlay holds this share of the model's elements (its memory then is
#: about 5x that share of the model, at 10 bytes per BF16 element).
DEFAULT_COMPACT_SHARE: Final = 0.05
#: First bytes of a log file (docs/FORMAT.md 9.1).
LOG_MAGIC: Final = b"BLTNLOG\x01"
#: Shards in one log file at most (the decoder's own cap is higher).
_MAX_LOG_SHARDS: Final = 1 << 16
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


class _Overlay:
    """The elements a version changed since the base: per tensor, sorted int64 indices
    and the bits they hold now. Never mutated: :meth:`merged` returns a new overlay, so
    an apply not activated is dropped by dropping its overlay."""

    def __init__(self, tensors: dict[str, tuple[NDArray[np.int64], Bits]] | None = None) -> None:
        self.tensors = tensors or {}

    @property
    def elements(self) -> int:
        return sum(int(idx.size) for idx, _ in self.tensors.values())

    def values_at(self, name: str, base: Bits, indices: NDArray[np.int64]) -> Bits:
        """The bits held now at ``indices`` (sorted) of the tensor whose base is ``base``."""
        old = base.reshape(-1)[indices]
        held = self.tensors.get(name)
        if held is not None and held[0].size:
            idx, vals = held
            pos = np.minimum(np.searchsorted(idx, indices), idx.size - 1)
            hit = idx[pos] == indices
            old[hit] = vals[pos[hit]]
        return old

    def merged(self, name: str, indices: NDArray[np.int64], values: Bits) -> _Overlay:
        """This overlay with ``values`` now at ``indices`` (sorted) of ``name``."""
        held = self.tensors.get(name)
        if held is None or not held[0].size:
            new = (indices.copy(), values.copy())
        else:
            idx = np.concatenate([indices, held[0]])
            vals = np.concatenate([values, held[1]])
            idx, first = np.unique(idx, return_index=True)  # the first occurrence: the new value
            new = (idx, vals[first])
        return _Overlay({**self.tensors, name: new})

    def bits(self, name: str, base: Bits) -> Bits:
        """A copy of the tensor's bits held now."""
        out = np.array(base, copy=True)
        held = self.tensors.get(name)
        if held is not None:
            out.reshape(-1)[held[0]] = held[1]
        return out


class _Merged(Mapping[str, Bits]):
    """The bits held, one tensor at a time (a copy each, made when asked for)."""

    def __init__(self, base: Checkpoint, overlay: _Overlay) -> None:
        self._base, self._overlay = base, overlay

    def __getitem__(self, name: str) -> Bits:
        if name not in self._base.specs:
            raise KeyError(name)
        base = self._base.bits(name)
        return base if name not in self._overlay.tensors else self._overlay.bits(name, base)

    def __iter__(self) -> Iterator[str]:
        return iter(self._base.specs)

    def __len__(self) -> int:
        return len(self._base.specs)


def _advance(
    base: Checkpoint, overlay: _Overlay, patch: Patch, fingerprints: Mapping[str, int]
) -> tuple[_Overlay, dict[str, int]]:
    """``patch`` applied onto base + overlay, reading only: the new overlay and
    fingerprints. ``WrongBase`` unless ``fingerprints`` are its bases; a changed tensor
    whose result misses its target is ``VerificationFailed``."""
    patch.check_layout(base.specs)
    check_bases({td.spec.name: td.base_fingerprint for td in patch}, fingerprints)
    new_fps = dict(fingerprints)
    wrong: list[str] = []
    for td in patch:
        name = td.spec.name
        if not td.changed:
            continue
        old = overlay.values_at(name, base.bits(name), td.indices)
        new = old + td.delta  # wraps mod 2**bits, as the deltas do
        got = (td.base_fingerprint + fingerprint_delta(td.indices, old, new)) & 0xFFFFFFFFFFFFFFFF
        if got != td.target_fingerprint:
            wrong.append(name)
            continue
        overlay = overlay.merged(name, td.indices, new)
        new_fps[name] = got
    if wrong:
        raise VerificationFailed(
            f"{len(wrong)} tensors miss their target after the patch (first {wrong[0]}): "
            "the bits held are not the ones their fingerprints record"
        )
    return overlay, new_fps


class LogDirTarget(LocalDirTarget):
    """A replica folder in the ``log`` layout (module docstring): O(patch) writes per version.

    Opens a dense folder too (its model folder becomes the base, with an empty log, and
    the first activation writes the ``log`` state). A dense :class:`LocalDirTarget`
    refuses a ``log`` folder (``ConfigError``): its state names a base that need not be
    the version held. ``compact_share``: see the module docstring.
    """

    LOG = _LOG_DIR

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        run: str | None = None,
        compact_share: float = DEFAULT_COMPACT_SHARE,
    ) -> None:
        if not 0 < compact_share <= 1:
            raise ConfigError(f"compact_share must be in (0, 1], not {compact_share!r}")
        self.dir = Path(directory)
        self.run = None if run is None else check_run_name(run)
        self.compact_share = compact_share
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
        self._overlay = _Overlay()
        #: An apply onto the held base not yet activated: its overlay and its log file.
        self._pending_overlay: _Overlay | None = None
        self._pending_entry: tuple[str, int, str] | None = None
        #: Why the log could not be verified (None: it was).
        self._log_lost: str | None = None
        #: Bytes the last compaction wrote (for benchmarks), and how many ran.
        self.compactions = 0
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
        overlay, fps = _Overlay(), dict(self._base_fps)
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
                overlay, fps = _advance(self._checkpoint, overlay, patch, fps)
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
        if self._log_lost is not None:
            return None
        return super().restored()

    @property
    def overlay_elements(self) -> int:
        """Elements the version held differs from the base at (what compaction is sized by)."""
        return self._overlay.elements

    @property
    def log_entries(self) -> int:
        """Patches in the log of the version held (0: the base is that version)."""
        return len(self._log)

    @property
    def staged_path(self) -> Path:
        """The folder holding what was loaded but not activated, or the base while it is
        exactly the version held (no log, nothing applied); else ``InvalidInput``:
        :meth:`compact` first."""
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
        return self.dir / self.CURRENT if self._state is not None and not self._log else None

    def context_bits(self) -> Mapping[str, Bits] | None:
        if self._pending is not None:
            ckpt = self._pending[1]
            return {name: ckpt.bits(name) for name in ckpt.specs}
        if self._checkpoint is None:
            return None
        return _Merged(self._checkpoint, self._pending_overlay or self._overlay)

    def full_fingerprints(self) -> dict[str, int]:
        bits = self.context_bits()
        return {} if bits is None else {name: fingerprint(bits[name]) for name in bits}

    # -- changes -------------------------------------------------------------------------

    def apply(self, patch: Patch, fingerprints: Mapping[str, int]) -> dict[str, int]:
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
        overlay, new_fps = _advance(self._checkpoint, self._overlay, patch, fingerprints)
        data = encode_log(patch)
        name = f"{self.LOG}/{secrets.token_hex(6)}.patch"
        with os_errors(f"cannot create {self.dir / self.LOG}"):
            (self.dir / self.LOG).mkdir(exist_ok=True)
        write_atomic(self.dir / name, [data])  # fsynced, renamed, the folder fsynced
        self._pending_overlay = overlay
        self._pending_entry = (name, len(data), hashlib.sha256(data).hexdigest())
        self._pending_fps = new_fps
        return new_fps

    def _discard_pending(self) -> None:
        if self._pending_entry is not None:
            with os_errors(f"cannot remove {self.dir / self._pending_entry[0]}"):
                (self.dir / self._pending_entry[0]).unlink(missing_ok=True)
        self._pending_entry = None
        self._pending_overlay = None
        super()._discard_pending()

    def stage_files(self, files: Sequence[FileRef], fetch: FetchFiles) -> None:
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
        self._commit(state, None)
        self._state, self._log, self._files = state, entries, files
        self._files_lost = None
        if self._pending_overlay is not None:
            self._overlay = self._pending_overlay
        self._pending_overlay = None
        self._pending_entry = None
        self._pending_fps = None
        self._pending_files = None
        try:
            with os_errors(f"cannot tidy {self.dir}"):
                if not entries:
                    self._sync_files(state.model_dir, files)
                    self._point_current(state.model_dir)
                self._drop_copies(set(files.values()))
            if len(entries) >= MAX_LOG_ENTRIES or self._overlay.elements > self.compact_share * self._numel():
                self.compact()
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

    def _commit(self, state: LocalStateV3, link_to: str | None) -> Path | None:
        """Stage the state (and a ``current`` link to ``link_to``), then rename the state
        over state.json: the commit point. Returns the staged link."""
        state_path = self.dir / self.STATE
        staged = stage_file(state_path, [state.model_dump_json().encode()])
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
        return link_tmp

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
        self._commit(state, name)
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
        self._base_version, self._base_fps, self._log, self._overlay = state.version, dict(fps), [], _Overlay()
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

    def compact(self) -> None:
        """Write the version held as a new base folder and drop the log; ``current`` then
        points at it (a loadable checkpoint). O(model) writes; nothing to do without a log."""
        if self._state is None or self._checkpoint is None:
            raise InvalidInput("nothing is held yet: load a keyframe first")
        if self._pending is not None or self._pending_overlay is not None or self._pending_files is not None:
            raise InvalidInput("a change is pending: activate or abort it before compacting")
        if self._log_lost is not None or self._files_lost is not None:
            raise InvalidInput(f"{self.dir}: the version held is not verified; sync it from a keyframe")
        if not self._log:
            return
        state, base = self._state, self._checkpoint
        fps = dict(Held.recorded(state).fingerprints)
        name = f"model-{secrets.token_hex(6)}"
        folder = self.dir / name
        try:
            with os_errors(f"cannot write {folder}"):
                os.mkdir(folder)
                os.close(os.open(folder / self.MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
                source = self.dir / state.model_dir
                copied = []
                for path in base.files:  # the tensor files, then the HF index
                    shutil.copyfile(path, folder / path.name)
                    copied.append(folder / path.name)
                if (source / "model.safetensors.index.json").is_file():
                    shutil.copyfile(source / "model.safetensors.index.json", folder / "model.safetensors.index.json")
                    copied.append(folder / "model.safetensors.index.json")
                with Checkpoint(folder, writable=True) as ckpt:
                    for tensor, (idx, vals) in self._overlay.tensors.items():
                        ckpt.bits(tensor).reshape(-1)[idx] = vals
                    ckpt.flush()
                    wrong = [t for t in self._overlay.tensors if fingerprint(ckpt.bits(t)) != fps[t]]
                if wrong:
                    raise VerificationFailed(f"{folder}: compacted {wrong[0]} misses its fingerprint")
                for path in copied:
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                missing = self._sync_files(name, self._files)
                if missing:
                    raise DigestMismatch(f"{self.dir}: the kept copies of {missing[:3]} cannot be read back")
                fsync_dir(folder)
            new = self._log_state(
                state.version, state.manifest_digest, name, [], fps, dict(self._files), base=(state.version, fps)
            )
            self._commit(new, name)
        except BaseException:
            self._remove_model(name, quiet=True)
            raise
        self.compactions += 1
        self._adopt(new, fps, None)
        self._settle_base(state.model_dir)

    def abort(self) -> None:
        self._pending_files = None
        self._discard_pending()
        self._drop_copies(set(self._files.values()))

    def close(self) -> None:
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
