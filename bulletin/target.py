"""What a Subscriber applies versions to: local files, host arrays, or a live engine.

A target holds one bits array per served tensor. The Subscriber checks every byte
it got (digests, decoding, fingerprint chain) *before* calling the target, so a
target only ever sees well-formed patches; it still checks base fingerprints and
verifies the result, and restores what it held when anything fails.

:class:`WeightTarget` is the one interface (an ABC, shaped like zarr's ``Store``):
six abstract methods, defaults for the optional steps, and capability attributes
that callers read instead of probing. In the order a Subscriber calls it::

    restored()                    -> Held to resume from (version, fingerprints), or None
    load_full(tensors, specs)     replace everything (fresh node, keyframe)
    prepare(patch, fingerprints)  optional: check and precompute, reading only
    apply(patch, fingerprints)    -> new fingerprints; in place; restores on failure
    apply_shards(shards, fps)     the same from encoded shards (if supports_shards)
    resolve_context(changes, ...) -> a context-coded transition's patch, resolved
                                  against the bits where they live (if resolves_context)
    stage_files(files, fetch)     optional: the version's model files (config, tokenizer);
                                  folders hold them, other targets ignore them
    abort()                       undo a load or apply that will not be activated
    activate(version, *, manifest_digest=None)
                                  make it live and durable (engine reload, state file)
    close()                       release files and handles (idempotent)

Until ``activate`` the previous version is still the one reported as current.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import weakref
import zipfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from bulletin.checkpoint import Checkpoint, write_checkpoint
from bulletin.errors import (
    BulletinError,
    ConfigError,
    DigestMismatch,
    FormatError,
    IncompatibleTensors,
    InvalidInput,
    LocalStorageError,
    ReplicaBusy,
)
from bulletin.fileio import atomic_file, fsync_dir, local_error, os_errors, stage_file, write_atomic
from bulletin.keyspace import check_run_name
from patcher.apply import apply as apply_patch
from patcher.apply_shards import apply_shards
from patcher.compression import CONTEXT_CODEC
from patcher.context_decode import CodedChanges
from patcher.decode import decode, read_shard_header
from patcher.fingerprint import fingerprint, format_fingerprint, parse_fingerprint
from patcher.format import TensorInfo
from patcher.patch import Patch, TensorSpec
from schemas.common import parse_document
from schemas.local_state import (
    JournalV1,
    LocalStateV1,
    LocalStateV2,
    LocalStateV3,
    local_state_files,
    parse_local_state,
)
from schemas.manifest import MAX_FILE_BYTES, FileRef

if TYPE_CHECKING:
    from bulletin.run import StoredManifest

__all__ = ["ArrayTarget", "Held", "LocalDirTarget", "WeightTarget", "WriteKeyframe", "read_local_state"]

log = logging.getLogger("bulletin.target")

Bits = NDArray[np.unsignedinteger]
#: Downloads model files (checked against their refs' sizes and SHA-256), in order.
FetchFiles = Callable[[Sequence[FileRef]], Sequence[bytes]]
#: Streams a keyframe's files into the folder given and returns them verified (sync's part
#: of :meth:`WeightTarget.load_keyframe`: the target only says where they go).
WriteKeyframe = Callable[[Path], Checkpoint]
#: A change an ArrayTarget applied: a decoded patch, or the shards it applied straight from.
_Applied = Patch | Sequence[bytes]


@dataclass(frozen=True, slots=True)
class Held:
    """What a target holds, verified: a version and its tensors' fingerprints.

    ``manifest_digest`` is the SHA-256 of the run manifest the version was synced from
    (what a Subscriber checks the run's chain against before it plans a route); None
    where it is not known (a state written before it was recorded, a version activated
    without a manifest). It is provenance, not content: two Helds with the same version
    and fingerprints compare equal whatever their digests.
    """

    version: int
    fingerprints: dict[str, int]
    manifest_digest: str | None = field(default=None, compare=False)

    @classmethod
    def at(cls, stored: StoredManifest) -> Held:
        """What a target holds once ``stored``'s version is verified and active."""
        return cls(stored.version, dict(stored.manifest.fingerprints), stored.digest)

    @classmethod
    def recorded(cls, state: LocalStateV1) -> Held:
        """What a replica folder's state file says it holds."""
        fingerprints = {n: parse_fingerprint(f) for n, f in state.fingerprints.items()}
        return cls(state.version, fingerprints, state.manifest_digest)


class WeightTarget(ABC):
    """Where versions land. Implementations: ArrayTarget, LocalDirTarget, engine adapters.

    Subclasses implement the six abstract methods. ``prepare``, ``abort`` and ``close``
    default to doing nothing, which suits a target whose ``apply`` restores on failure
    and that changes nothing before ``activate`` or holds nothing to release; override
    them where that is not so. ``apply_shards`` is offered only where
    :attr:`supports_shards` says so.
    """

    #: Whether what the engine serves changes during ``load_full`` / ``apply`` (before
    #: ``activate``): a gate wrapper then pauses requests around those calls, not only
    #: around ``activate``. True unless a target knows better: the safe assumption.
    in_place: bool = True

    #: Whether :meth:`abort` after :meth:`load_full` puts back the bits of the version
    #: activated last. False for live weights without a second copy (torch, vLLM): sync
    #: then stops reporting that version (see ``execute``'s ``on_lost``), since the
    #: target may hold the new bits, the old ones, or a mix.
    restores_loads: bool = True

    #: Whether :meth:`load_keyframe` stages the keyframe where nothing served reads it
    #: until :meth:`activate` (a new folder), so that it may stream from the store while
    #: requests run, even for an ``in_place`` target.
    stages_keyframes: bool = False

    @property
    def supports_shards(self) -> bool:
        """Whether :meth:`apply_shards` applies straight from encoded shards; sync then
        skips decoding when a single transition is due."""
        return False

    @abstractmethod
    def layout(self) -> Mapping[str, TensorSpec] | None:
        """Served tensor name -> spec, or None while nothing is held."""

    @abstractmethod
    def restored(self) -> Held | None:
        """The verified version a Subscriber opened on this target may resume from.

        Durable targets (a folder, an engine backed by one) report the version last
        activated, also across restarts; volatile ones (host arrays, live tensors)
        None, since they cannot vouch for bits loaded before this process.
        """

    @abstractmethod
    def load_full(self, tensors: Mapping[str, Bits], specs: Mapping[str, TensorSpec]) -> None:
        """Replace every tensor's bits (arrays of the specs' bits dtypes); checks first."""

    def load_keyframe(
        self, write: WriteKeyframe, fingerprints: Mapping[str, int], *, scratch_dir: Path | None = None
    ) -> None:
        """Replace every tensor's bits with a keyframe's, streamed from the store: ``write``
        streams its files into the folder it is given and returns them as a read-only
        :class:`~bulletin.checkpoint.Checkpoint`, every byte and every tensor's fingerprint
        checked (they are ``fingerprints``); a failure there raises before anything held
        changes. Then as :meth:`load_full`.

        Default: the files go to a temp folder under ``scratch_dir`` (the system's temp
        folder when None), :meth:`load_full` gets views of their memory maps (file pages,
        no anonymous copy of the model), and the folder is removed afterwards. A target
        that keeps a folder streams into the folder it will serve (:class:`LocalDirTarget`).
        """
        with (
            tempfile.TemporaryDirectory(prefix=".bulletin-keyframe-", dir=scratch_dir) as folder,
            write(Path(folder)) as verified,
        ):
            specs = verified.specs
            self.load_full({name: verified.bits(name) for name in specs}, specs)

    def prepare(self, patch: Patch, fingerprints: Mapping[str, int]) -> None:
        """Check and precompute an :meth:`apply` of ``patch`` by reading only, so that a
        caller can pause requests for the writes alone. Default: nothing; apply does it all."""
        return

    @abstractmethod
    def apply(self, patch: Patch, fingerprints: Mapping[str, int]) -> dict[str, int]:
        """Apply in place and return the new fingerprints; ``WrongBase`` (checked before
        any write) and ``VerificationFailed`` leave the old bits intact."""

    def apply_shards(self, shards: Sequence[bytes], fingerprints: Mapping[str, int]) -> dict[str, int]:
        """As :meth:`apply` for the patch that ``shards`` encode, without decoding it first."""
        raise InvalidInput(f"{type(self).__name__} cannot apply from shards (supports_shards is False)")

    def context_bits(self) -> Mapping[str, Bits] | None:
        """Host arrays of the bits held now (read them only), by tensor name: the base that
        context-coded patches (docs/FORMAT.md 3.15) are decoded against. Default None, for
        bits that live elsewhere (a GPU engine): sync then has the target resolve them
        (:attr:`resolves_context`) or, failing that, takes a keyframe route and decodes
        against the keyframe's bits, which it downloaded."""
        return None

    @property
    def resolves_context(self) -> bool:
        """Whether :meth:`resolve_context` decodes context-coded transitions against the
        bits held where they live (a GPU's memory), so that sync needs no host copy of
        them (:meth:`context_bits`) and no keyframe route."""
        return False

    def resolve_context(
        self,
        changes: Sequence[CodedChanges],
        tensors: Mapping[str, TensorInfo],
        fingerprints: Mapping[str, int],
        *,
        pending: Patch | None = None,
    ) -> Patch:
        """The patch of one context-coded transition, by reading only: ``changes`` is the
        entropy stage of every shard of it (``patcher.context_decode.decode_changes``),
        ``tensors`` what its checked headers describe, ``fingerprints`` the verified
        record of the bits held. ``pending`` is the fold of earlier transitions not yet
        applied, read through as if it were (its base fingerprints are the record, its
        targets this transition's bases). ``WrongBase`` before any bits are read when
        the record is not the transition's base."""
        raise InvalidInput(f"{type(self).__name__} cannot resolve context-coded changes (resolves_context is False)")

    @abstractmethod
    def full_fingerprints(self) -> dict[str, int]:
        """Recompute every tensor's fingerprint from the bits held (staged ones included)."""

    @abstractmethod
    def activate(self, version: int, *, manifest_digest: str | None = None) -> None:
        """Make what was loaded or applied live and durable as ``version``.

        ``manifest_digest`` is the SHA-256 of the run manifest of ``version`` (sync passes
        it); durable targets record it, so that :meth:`restored` reports it after a
        restart, and in-memory ones may keep it for their lifetime."""

    def stage_files(self, files: Sequence[FileRef], fetch: FetchFiles) -> None:
        """The version about to be activated has exactly these model files (config,
        tokenizer, ...; docs/FORMAT.md 5.1; none: it has none). Called after
        :meth:`load_full` / :meth:`apply` and before :meth:`activate`, which commits them
        with the tensors; :meth:`abort` drops them. ``fetch`` downloads the ones the target
        lacks, checked. Default: ignored, for targets that are not folders (live tensors,
        host arrays); an engine target backed by a folder passes them on to it."""
        return

    def abort(self) -> None:
        """Drop a load or apply that will not be activated, restoring the bits of the
        version activated last where the target can. Default: nothing to undo."""
        return

    def close(self) -> None:
        """Release files and handles; idempotent. Default: nothing is held."""
        return


def _check_full(tensors: Mapping[str, Bits], specs: Mapping[str, TensorSpec]) -> None:
    if tensors.keys() != specs.keys():
        raise IncompatibleTensors("tensors and specs name different tensors")
    for name, spec in specs.items():
        array = tensors[name]
        if array.dtype != spec.bits_dtype or array.size != spec.numel:
            raise IncompatibleTensors(f"{name}: expected {spec.numel} x {spec.bits_dtype}")


def _subtract(arrays: Mapping[str, Bits], patch: Patch) -> None:
    """Undo an applied ``patch``: deltas are ``(new - old) mod 2**bits``, so subtract them."""
    for td in patch:
        if td.changed:
            flat = arrays[td.spec.name].reshape(-1)
            flat[td.indices] -= td.delta


class ArrayTarget(WeightTarget):
    """Bits held in host memory (NumPy): the publisher's resume path, verify, tests.

    Until :meth:`activate`, what a load replaced and the patches applied are kept
    (references, no copies) so that :meth:`abort` can put the activated version back.
    """

    def __init__(self) -> None:
        self.specs: dict[str, TensorSpec] | None = None
        self.arrays: dict[str, Bits] = {}
        self.version: int | None = None
        self.manifest_digest: str | None = None
        # What the last activated version was before a load replaced it, and the patches
        # (or shards) applied since: the undo data of abort.
        self._replaced: tuple[dict[str, TensorSpec] | None, dict[str, Bits], list[_Applied]] | None = None
        self._applied: list[_Applied] = []

    @property
    def supports_shards(self) -> bool:
        return True

    def layout(self) -> Mapping[str, TensorSpec] | None:
        return self.specs

    def restored(self) -> Held | None:
        return None

    def load_full(self, tensors: Mapping[str, Bits], specs: Mapping[str, TensorSpec]) -> None:
        _check_full(tensors, specs)
        arrays = {n: np.array(tensors[n], copy=True).reshape(specs[n].shape) for n in specs}
        if self._replaced is None:
            self._replaced = (self.specs, self.arrays, self._applied)
        self._applied = []
        self.arrays = arrays
        self.specs = dict(specs)

    def _held_specs(self) -> dict[str, TensorSpec]:
        if self.specs is None:
            raise InvalidInput("nothing is held yet: load a keyframe first")
        return self.specs

    def apply(self, patch: Patch, fingerprints: Mapping[str, int]) -> dict[str, int]:
        patch.check_layout(self._held_specs())
        new = apply_patch(patch, self.arrays, fingerprints)  # restores on failure
        self._applied.append(patch)
        return new

    def apply_shards(self, shards: Sequence[bytes], fingerprints: Mapping[str, int]) -> dict[str, int]:
        if any(read_shard_header(shard).codec == CONTEXT_CODEC for shard in shards):
            # abort undoes applied shards by decoding them again, which a context-coded
            # patch cannot do once its base is gone: decode it now, against the base.
            patch = decode(shards, specs=self._held_specs(), base=self.arrays, base_fingerprints=fingerprints)
            return self.apply(patch, fingerprints)
        new = apply_shards(shards, self.arrays, fingerprints, specs=self._held_specs())  # restores on failure
        self._applied.append(shards)
        return new

    def context_bits(self) -> Mapping[str, Bits] | None:
        return self.arrays if self.specs is not None else None

    def full_fingerprints(self) -> dict[str, int]:
        return {name: fingerprint(bits) for name, bits in self.arrays.items()}

    def activate(self, version: int, *, manifest_digest: str | None = None) -> None:
        self.version = version
        self.manifest_digest = manifest_digest
        self._replaced = None
        self._applied = []

    def abort(self) -> None:
        applied = self._applied
        if self._replaced is not None:
            self.specs, self.arrays, applied = self._replaced
        for change in reversed(applied):
            # Shards were applied without a decoded patch; decode them now (rare path).
            _subtract(self.arrays, change if isinstance(change, Patch) else decode(change))
        self._replaced = None
        self._applied = []


def read_local_state(directory: str | os.PathLike[str], *, run: str | None = None) -> LocalStateV1 | None:
    """What a replica folder's ``state.json`` records, read only (None if there is none).

    Takes no lock, runs no recovery and creates or changes nothing, so it may look at a
    folder that a writer holds (``bulletin status --local``): while that writer is
    mid-change it reports the version activated last, which is what the folder holds
    once the writer's change commits or is rolled back. ``run`` refuses (``ConfigError``)
    a folder that holds another run.
    """
    folder = Path(directory)
    if run is not None:
        check_run_name(run)
    path = folder / LocalDirTarget.STATE
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise local_error(exc, f"cannot read {path}") from exc
    state = parse_local_state(data, source=f"{path} (local state)")
    if run is not None and state.run is not None and state.run != run:
        raise ConfigError(f"{folder} holds run {state.run!r}, not {run!r}")
    return state


#: Temp names LocalDirTarget (and bulletin.fileio on its behalf) writes in a replica folder.
_TEMP_NAME = re.compile(r"\.(state\.json|journal\.json|journal\.npz|current)\.tmp(-\d+)?")
#: Model folders LocalDirTarget names (``model-`` and 12 hex digits).
_MODEL_NAME = re.compile(r"model-[0-9a-f]{12}")
#: Temp names of bulletin.fileio's atomic writes (a model file, a kept copy).
_ATOMIC_TEMP = re.compile(r"\..+\.tmp-\d+")
_DIGEST = re.compile(r"[0-9a-f]{64}")


def _file_digest(path: Path) -> str | None:
    """SHA-256 of a regular file (not a link) of at most MAX_FILE_BYTES, or None."""
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not os.path.isfile(path) or os.path.islink(path) or info.st_size > MAX_FILE_BYTES:
        return None
    with os_errors(f"cannot read {path}"):
        return hashlib.sha256(path.read_bytes()).hexdigest()


def _is_tensor_file(name: str) -> bool:
    lower = name.lower()
    return lower.endswith(".safetensors") or lower.endswith(".safetensors.index.json")


class LocalDirTarget(WeightTarget):
    """A directory holding the current version as plain safetensors, changed atomically.

    Layout::

        state.json        LocalStateV1: version, fingerprints, which model folder
                          (LocalStateV2 when the version has model files: their digests)
        current ->        symlink to the model folder state.json names (point engines here)
        model-<id>/       model.safetensors (+ HF index when split), the version's model
                          files (config.json, tokenizer files, ...), and .bulletin-model,
                          the mark of a folder this class created
        files/<sha256>    a copy of each model file of the version held (and of one being
                          staged): what a model folder's files are restored from
        journal.json/.npz present only while an in-place apply runs (undo data)
        .bulletin-lock    the writer's lock (it records the writer's process id)

    **One writer.** A target holds an exclusive OS lock (``flock`` on ``.bulletin-lock``)
    from its construction to :meth:`close`, or to the end of its process however it
    ends. A second target on the folder, in another process or in this one, raises
    :class:`~bulletin.errors.ReplicaBusy` at once and reads, recovers and changes
    nothing. Recovery runs only under the lock; to look without writing (``bulletin
    status --local``) use :func:`read_local_state`.

    **Crash safety.** ``state.json`` is the one truth, and replacing it (an atomic
    rename of a file already fsynced) is the commit point of every change:

    - a keyframe (:meth:`load_full`) goes to a fresh marked folder, its files fsynced;
    - an in-place :meth:`apply` makes the old bits of every element it will change
      durable (``journal.npz``, then ``journal.json``) before it touches the files, and
      flushes them before :meth:`activate`;
    - :meth:`activate` writes the new state and the new ``current`` link under temp names,
      renames the state over ``state.json`` (the commit), then switches ``current`` and
      drops the journal and the folder it replaced. A failure before the commit leaves
      the previous version in force (:meth:`abort` puts its bits back); a step after it
      that fails is logged, not raised, and redone by the next open.

    **Model files** (:meth:`stage_files`) are copied into the working folder before the
    commit, each from a verified copy kept under ``files/`` (fsynced first): a new
    folder gets all of them, the held folder, changed in place, the ones that differ
    (and loses the ones the new version does not have). Without :meth:`stage_files`, a
    version keeps the files held (a keyframe's new folder gets copies). Copies of files
    no longer held go once the version that dropped them is committed.

    Every open under the lock finishes what a killed writer left: it writes the undo
    data back if ``state.json`` still names the version the journal started from,
    points ``current`` at the folder ``state.json`` names, makes that folder's model
    files exactly those ``state.json`` lists (byte for byte, from the kept copies;
    removing files a change not committed had added, which are known by their copies),
    and removes temp files, unneeded copies and the marked folders it does not name.
    Whatever instant a writer died at, the folder then holds exactly the version
    ``state.json`` names, bit for bit, files included, and ``current`` resolves to it.
    Nothing this class did not create is removed: a folder without the mark stays (an
    empty one with this class's naming, from a crash between creating it and marking
    it, is the exception), and so does a file a user put into a model folder.

    **Failures are typed.** The disk's refusals are
    :class:`~bulletin.errors.LocalStorageError` kinds (``DiskFull``, ``ReadOnlyStorage``,
    ``PermissionDenied``, see :mod:`bulletin.fileio`), unreadable state or journal files
    ``FormatError``; the held version stays intact and temp files and new folders are
    removed.
    """

    STATE = "state.json"
    JOURNAL = "journal.json"
    UNDO = "journal.npz"
    CURRENT = "current"
    LOCK = ".bulletin-lock"
    MARKER = ".bulletin-model"
    FILES = "files"

    def __init__(self, directory: str | os.PathLike[str], *, run: str | None = None) -> None:
        self.dir = Path(directory)
        self.run = None if run is None else check_run_name(run)
        self._state: LocalStateV1 | None = None
        self._checkpoint: Checkpoint | None = None
        self._pending: tuple[str, Checkpoint] | None = None
        self._pending_fps: dict[str, int] | None = None
        self._journaled = False  # an in-place apply since the last activation wrote the journal
        #: Model files of the version held (path -> sha256), and of the one staged (None:
        #: the same as held).
        self._files: dict[str, str] = {}
        self._pending_files: dict[str, str] | None = None
        #: Why the held folder's model files could not be made exact (None: they are).
        self._files_lost: str | None = None
        with os_errors(f"cannot create the replica folder {self.dir}"):
            self.dir.mkdir(parents=True, exist_ok=True)
        self._unlock: Callable[[], None] = self._lock()
        try:
            self._state = self._read_state()
            if isinstance(self._state, LocalStateV3):
                raise ConfigError(
                    f"{self.dir} is a replica in the log layout (a base and a patch log, docs/FORMAT.md 9.1): "
                    "open it with layout='log' (bulletin sync --layout log)"
                )
            self._files = local_state_files(self._state) if self._state is not None else {}
            self._recover()
            if self._state is not None:
                self._checkpoint = Checkpoint(self.dir / self._state.model_dir, writable=True)
        except BaseException:
            self._unlock()
            raise

    # -- the one writer ------------------------------------------------------------------

    def _lock(self) -> Callable[[], None]:
        """Take the folder's lock, or raise ReplicaBusy; returns what releases it."""
        path = self.dir / self.LOCK
        with os_errors(f"cannot open the lock file {path}"):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            except OSError:
                pid = ""
            finally:
                os.close(fd)
            holder = (
                "another target in this process"
                if pid == str(os.getpid())
                else f"process {pid}"
                if pid.isdigit()
                else "another process"
            )
            raise ReplicaBusy(
                f"{self.dir} is held by {holder} (lock {path}): a replica folder has one writer at a time"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise local_error(exc, f"cannot lock {path}") from exc
        # Released by close(), or when this object is collected, or at exit; the kernel
        # releases it when the process dies, a SIGKILL included.
        unlock = weakref.finalize(self, os.close, fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # only the message of a second opener would miss it
        return unlock

    # -- state ---------------------------------------------------------------------------

    @classmethod
    def peek(cls, directory: str | os.PathLike[str], *, run: str | None = None) -> Held | None:
        """What :meth:`restored` of a target on ``directory`` would report, read only: no
        lock, no recovery, nothing created or changed (see :func:`read_local_state`)."""
        state = read_local_state(directory, run=run)
        return Held.recorded(state) if state is not None else None

    def _read_state(self) -> LocalStateV1 | None:
        return read_local_state(self.dir, run=self.run)

    def _read_journal(self, path: Path) -> JournalV1:
        return parse_document(JournalV1, path.read_bytes(), source=f"{path} (undo journal)")

    def _uncommitted(self, journal: JournalV1) -> bool:
        """Whether the journal's apply did not commit: state.json still names its start."""
        return (
            self._state is not None
            and journal.model_dir == self._state.model_dir
            and journal.from_version == self._state.version
        )

    def _note_lost_files(self, missing: list[str], version: int) -> None:
        """Recovery found the model files ``missing`` of ``version`` damaged or gone: the
        folder stays loadable for its tensors, and the next sync rebuilds it."""
        if missing:
            self._files_lost = (
                f"model files {missing[:3]} of version {version} are damaged or gone, with no intact copy kept"
            )
            log.warning("%s: %s; the next sync rebuilds the folder from a keyframe", self.dir, self._files_lost)

    def _recover(self) -> None:
        """Under the lock: finish what a killed writer left (see the class docstring)."""
        with os_errors(f"cannot recover {self.dir}"):
            self._roll_back()
            if self._state is not None:
                self._point_current(self._state.model_dir)
                self._note_lost_files(self._sync_files(self._state.model_dir, self._files), self._state.version)
            self._drop_copies(set(self._files.values()))
            keep = self._state.model_dir if self._state is not None else None
            for entry in list(os.scandir(self.dir)):
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != keep and entry.name.startswith("model-"):
                        self._remove_model(entry.name)
                elif _TEMP_NAME.fullmatch(entry.name):
                    os.unlink(entry.path)

    def _roll_back(self) -> None:
        """Write back the undo data of an apply that did not commit (state.json still
        names its start), then drop the journal; undo data without a journal means the
        apply had not begun writing."""
        journal_path = self.dir / self.JOURNAL
        if journal_path.exists():
            journal = self._read_journal(journal_path)
            if self._uncommitted(journal):
                self._undo(journal)
        self._drop_journal()

    def _drop_journal(self) -> None:
        # Undo data first: a journal without it means "nothing left to write back".
        (self.dir / self.UNDO).unlink(missing_ok=True)
        (self.dir / self.JOURNAL).unlink(missing_ok=True)

    def _undo(self, journal: JournalV1) -> None:
        undo_path = self.dir / self.UNDO
        if not undo_path.exists():  # not yet durable (nothing changed) or already written back
            return
        try:
            with (
                Checkpoint(self.dir / journal.model_dir, writable=True) as ckpt,
                open(undo_path, "rb") as fh,  # numpy leaks its own handle on a torn file
                np.load(fh, allow_pickle=False) as undo,
            ):
                names = json.loads(bytes(undo["names"]).decode())
                for k, name in enumerate(names):
                    flat = ckpt.bits(name).reshape(-1)
                    flat[undo[f"i{k}"]] = undo[f"o{k}"]
                ckpt.flush()
        except BulletinError:
            raise
        except (zipfile.BadZipFile, EOFError, KeyError, ValueError, IndexError) as exc:
            raise FormatError(
                f"{undo_path}: unreadable undo data ({type(exc).__name__}: {exc}); "
                f"the folder cannot be rolled back: remove {self.dir} and sync again"
            ) from exc

    def _point_current(self, model_dir: str) -> None:
        """Make ``current`` resolve to ``model_dir`` (an atomic switch), if it does not."""
        link = self.dir / self.CURRENT
        try:
            if os.readlink(link) == model_dir:
                return
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise ConfigError(f"{link} is not the symlink Bulletin keeps there: move it away") from None
            raise
        os.replace(self._stage_link(model_dir), link)
        fsync_dir(self.dir)

    def _stage_link(self, model_dir: str) -> Path:
        tmp = self.dir / f".{self.CURRENT}.tmp"
        with os_errors(f"cannot link {self.dir / self.CURRENT}"):
            tmp.unlink(missing_ok=True)
            os.symlink(model_dir, tmp)
        return tmp

    def _remove_model(self, name: str, *, quiet: bool = False) -> None:
        """Remove a model folder this class created (it holds MARKER), the mark last, so
        that a crash midway leaves it recognisable (or empty) to the next open. A folder
        without the mark is left alone, unless it is empty and has this class's naming."""
        folder = self.dir / name
        try:
            with os_errors(f"cannot remove {folder}"):
                if not folder.is_dir():
                    return
                if not (folder / self.MARKER).exists():
                    if _MODEL_NAME.fullmatch(name) and not any(folder.iterdir()):
                        folder.rmdir()
                    return
                with os.scandir(folder) as entries:  # closed when a removal fails mid-scan
                    for entry in entries:
                        if entry.name == self.MARKER:
                            continue
                        if entry.is_dir(follow_symlinks=False):
                            shutil.rmtree(entry.path)
                        else:
                            os.unlink(entry.path)
                os.unlink(folder / self.MARKER)
                folder.rmdir()
        except (BulletinError, OSError) as exc:
            if not quiet:
                raise
            log.warning("%s", exc)

    # -- model files ---------------------------------------------------------------------

    def _copy(self, digest: str) -> bytes | None:
        """The kept copy of the model file with this SHA-256, checked, or None."""
        path = self.dir / self.FILES / digest
        try:
            with os_errors(f"cannot read {path}"):
                data = path.read_bytes()
        except LocalStorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError | NotADirectoryError | IsADirectoryError):
                return None
            raise
        return data if hashlib.sha256(data).hexdigest() == digest else None

    def _copies(self) -> set[str]:
        folder = self.dir / self.FILES
        with os_errors(f"cannot list {folder}"):
            if not folder.is_dir():
                return set()
            return {entry.name for entry in os.scandir(folder) if _DIGEST.fullmatch(entry.name)}

    def _drop_copies(self, keep: set[str]) -> None:
        """Remove the kept copies (and temp files) of model files not in ``keep``."""
        folder = self.dir / self.FILES
        with os_errors(f"cannot tidy {folder}"):
            if not folder.is_dir():
                return
            for entry in list(os.scandir(folder)):
                if entry.name not in keep and not entry.is_dir(follow_symlinks=False):
                    os.unlink(entry.path)
            if not keep and not any(folder.iterdir()):
                folder.rmdir()

    def _sync_files(self, model_dir: str, files: Mapping[str, str]) -> list[str]:
        """Make ``model_dir`` hold exactly ``files`` (path -> sha256) beside its tensors:
        each written from its kept copy unless it already has those bytes, and every other
        file this class put there removed (a file with a kept copy's digest, or a temp
        file of one); anything else a user left stays. Returns the paths it could not
        provide (no intact copy)."""
        folder = self.dir / model_dir
        touched: set[Path] = set()
        missing: list[str] = []
        with os_errors(f"cannot write the model files of {folder}"):
            for path, digest in sorted(files.items()):
                dest = folder / path
                if _file_digest(dest) == digest:
                    continue
                data = self._copy(digest)
                if data is None:
                    missing.append(path)
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(dest, [data], sync_dir=False)
                touched.add(dest.parent)
            ours = self._copies()
            for root, dirs, names in os.walk(folder, topdown=False):
                base = Path(root)
                for name in names:
                    rel = (base / name).relative_to(folder).as_posix()
                    if rel in files or rel == self.MARKER or (base == folder and _is_tensor_file(name)):
                        continue
                    if _ATOMIC_TEMP.fullmatch(name) or (ours and _file_digest(base / name) in ours):
                        os.unlink(base / name)
                        touched.add(base)
                for name in dirs:  # a folder emptied here (of a nested file removed)
                    sub = base / name
                    if sub in touched and not os.path.islink(sub) and not any(sub.iterdir()):
                        sub.rmdir()
                        touched.add(base)
            for where in touched:
                if where.is_dir():
                    fsync_dir(where)
        return missing

    def _keep_copies(self, files: Sequence[FileRef], fetch: FetchFiles) -> None:
        """Make ``files/`` hold a checked copy of each of ``files`` (fsynced), fetching the
        ones it lacks (checked again here)."""
        held = self._copies()
        needed: dict[str, FileRef] = {}
        for ref in files:
            if ref.sha256 not in needed and (ref.sha256 not in held or self._copy(ref.sha256) is None):
                needed[ref.sha256] = ref
        if needed:
            store = self.dir / self.FILES
            with os_errors(f"cannot create {store}"):
                store.mkdir(exist_ok=True)
            for ref, data in zip(needed.values(), fetch(list(needed.values())), strict=True):
                if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
                    raise DigestMismatch(f"{ref.key} ({ref.path}): not the bytes the manifest promises")
                write_atomic(store / ref.sha256, [data])

    def stage_files(self, files: Sequence[FileRef], fetch: FetchFiles) -> None:
        """Copy the version's model files into the folder being staged: those it lacks are
        fetched (``fetch`` checks them; they are checked again here) and kept under
        ``files/`` (fsynced) first. Nothing held changes before :meth:`activate`: a crash
        or :meth:`abort` puts the held version's files back."""
        wanted = {f.path: f.sha256 for f in files}
        in_place = self._state is not None and (self._pending is None or self._pending[0] == self._state.model_dir)
        if in_place and wanted == self._files and self._files_lost is None:
            return  # the steady state: the held folder keeps its files, checked when opened
        self._keep_copies(files, fetch)
        if self._pending is None:  # only the files change: stage the held folder as it is
            if self._state is None or self._checkpoint is None:
                raise InvalidInput("nothing is held yet: load a keyframe first")
            self._pending = (self._state.model_dir, self._checkpoint)
            self._pending_fps = dict(Held.recorded(self._state).fingerprints)
        model_dir, _ = self._pending
        self._pending_files = wanted  # from here on abort puts the held files back
        missing = self._sync_files(model_dir, wanted)
        if missing:
            raise LocalStorageError(f"{self.dir}: the kept copies of {missing[:3]} cannot be read back")

    # -- what is held --------------------------------------------------------------------

    def layout(self) -> Mapping[str, TensorSpec] | None:
        return self._checkpoint.specs if self._checkpoint is not None else None

    def restored(self) -> Held | None:
        if self._files_lost is not None:
            return None  # not an exact version: a keyframe route rebuilds the folder
        return Held.recorded(self._state) if self._state is not None else None

    @property
    def files(self) -> Mapping[str, str]:
        """The model files of the version held: path -> SHA-256."""
        return dict(self._files)

    @property
    def staged_path(self) -> Path:
        """The folder holding what was loaded or applied but not yet activated (or, with
        nothing staged, the current one). Engines reload from it before activation."""
        name, _ = self._working()
        return (self.dir / name).resolve()

    @property
    def model_path(self) -> Path | None:
        """The folder an engine should load (stable symlink ``current``)."""
        return self.dir / self.CURRENT if self._state is not None else None

    # -- changes -------------------------------------------------------------------------

    def load_full(self, tensors: Mapping[str, Bits], specs: Mapping[str, TensorSpec]) -> None:
        _check_full(tensors, specs)
        self._load_into_new_folder(lambda folder: write_checkpoint(folder, specs, tensors), None)

    stages_keyframes = True  # a new model folder; ``current`` moves at activate

    def load_keyframe(
        self, write: WriteKeyframe, fingerprints: Mapping[str, int], *, scratch_dir: Path | None = None
    ) -> None:
        """The keyframe's files are streamed straight into a new model folder (read once,
        written once); their fingerprints, checked by ``write``, are not computed again."""

        def stream(folder: Path) -> None:
            with write(folder):
                pass  # verified; the folder's writable maps are opened below

        self._load_into_new_folder(stream, dict(fingerprints))

    def _load_into_new_folder(self, fill: Callable[[Path], object], fingerprints: dict[str, int] | None) -> None:
        """Stage a keyframe in a fresh marked folder that ``fill`` writes its tensor files
        into (``fingerprints``: theirs, known verified; None: computed at activation)."""
        self._discard_pending()
        name = f"model-{secrets.token_hex(6)}"
        folder = self.dir / name
        try:
            with os_errors(f"cannot create {folder}"):
                os.mkdir(folder)
                os.close(os.open(folder / self.MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            fill(folder)
            # The files held go to the new folder too (stage_files may replace them).
            missing = self._sync_files(name, self._files)
            ckpt = Checkpoint(folder, writable=True)
        except BaseException:
            self._remove_model(name, quiet=True)  # nothing half-written stays behind
            raise
        self._pending = (name, ckpt)
        self._pending_fps = fingerprints
        self._pending_files = {path: digest for path, digest in self._files.items() if path not in missing}

    def _working(self) -> tuple[str, Checkpoint]:
        if self._pending is not None:
            return self._pending
        if self._state is None or self._checkpoint is None:
            raise InvalidInput("nothing is held yet: load a keyframe first")
        return self._state.model_dir, self._checkpoint

    def apply(self, patch: Patch, fingerprints: Mapping[str, int]) -> dict[str, int]:
        model_dir, ckpt = self._working()
        patch.check_layout(ckpt.specs)
        journaled = self._state is not None and model_dir == self._state.model_dir
        if journaled and self._journaled:
            # A second journal would hold the bits after the first apply, not the version's.
            raise InvalidInput("an in-place apply is pending: activate or abort it before applying again")
        if journaled and self._state is not None:
            try:
                self._write_journal(patch, ckpt, JournalV1(model_dir=model_dir, from_version=self._state.version))
            except BaseException:
                with contextlib.suppress(OSError):  # nothing was changed yet: drop the half
                    self._drop_journal()
                raise
            self._journaled = True
        arrays = {name: ckpt.bits(name) for name in ckpt.specs}
        try:
            new_fps = apply_patch(patch, arrays, fingerprints)  # restores in memory on failure
            ckpt.flush()
        except BaseException:
            if journaled:
                self.abort()
            raise
        self._pending = (model_dir, ckpt)
        self._pending_fps = new_fps
        return new_fps

    def _write_journal(self, patch: Patch, ckpt: Checkpoint, journal: JournalV1) -> None:
        """Old bits of every element the patch changes, durable before any change."""
        changed = [td for td in patch if td.changed]
        names = json.dumps([td.spec.name for td in changed]).encode()
        undo: dict[str, Any] = {"names": np.frombuffer(names, np.uint8)}
        for k, td in enumerate(changed):
            undo[f"i{k}"] = td.indices
            undo[f"o{k}"] = ckpt.bits(td.spec.name).reshape(-1)[td.indices]
        with os_errors(f"cannot write {self.dir / self.JOURNAL}"):
            # A stale journal (a tidy-up that failed) must never name this undo data.
            (self.dir / self.JOURNAL).unlink(missing_ok=True)
        with atomic_file(self.dir / self.UNDO) as fh:  # the temp file goes on failure
            np.savez(fh, **undo)
        write_atomic(self.dir / self.JOURNAL, [journal.model_dump_json().encode()])

    def context_bits(self) -> Mapping[str, Bits] | None:
        if self._pending is None and self._checkpoint is None:
            return None
        _, ckpt = self._working()
        return {name: ckpt.bits(name) for name in ckpt.specs}

    def full_fingerprints(self) -> dict[str, int]:
        if self._pending is None and self._checkpoint is None:
            return {}
        _, ckpt = self._working()
        return {name: fingerprint(ckpt.bits(name)) for name in ckpt.specs}

    def activate(self, version: int, *, manifest_digest: str | None = None) -> None:
        if self._pending is None:
            raise InvalidInput("nothing to activate: load or apply first")
        model_dir, ckpt = self._pending
        fps = self._pending_fps
        if fps is None:
            fps = {name: fingerprint(ckpt.bits(name)) for name in ckpt.specs}
        files = dict(sorted((self._pending_files if self._pending_files is not None else self._files).items()))
        # A version without model files keeps state.json at spec_version 1 (older readers).
        fields: dict[str, Any] = {
            "run": self.run,
            "version": version,
            "model_dir": model_dir,
            "fingerprints": {n: format_fingerprint(fp) for n, fp in sorted(fps.items())},
            "manifest_digest": manifest_digest,
            "updated_at": datetime.now(UTC),
        }
        state = LocalStateV2(**fields, files=files) if files else LocalStateV1(**fields)
        # Everything that can fail is staged before the commit point: the state file
        # (fsynced, under a temp name) and the new `current` link.
        state_path = self.dir / self.STATE
        staged = stage_file(state_path, [state.model_dump_json().encode()])
        link_tmp: Path | None = None
        try:
            link_tmp = self._stage_link(model_dir)
            with os_errors(f"cannot write {state_path}"):
                os.replace(staged, state_path)  # the commit point: from here on the folder is `version`
        except BaseException:
            for tmp in (staged, link_tmp):
                if tmp is not None:
                    with contextlib.suppress(OSError):
                        tmp.unlink(missing_ok=True)
            raise
        old = self._state.model_dir if self._state else None
        self._state = state
        self._files = files
        self._files_lost = None
        if self._checkpoint is not None and self._checkpoint is not ckpt:
            self._checkpoint.close()
        self._checkpoint = ckpt
        self._pending = None
        self._pending_fps = None
        self._pending_files = None
        self._journaled = False
        self._settle(link_tmp, None if old == model_dir else old)

    def _settle(self, link_tmp: Path, replaced: str | None) -> None:
        """After the commit: switch ``current``, make both renames durable, drop the
        journal and the folder ``replaced``. Nothing here may undo the commit, and the next
        open redoes whatever did not happen, so a failure is logged rather than raised."""
        try:
            if replaced is not None:  # a folder state.json named is this class's, marked or not
                self._mark(replaced)  # (so that the next open removes it if this does not)
            with os_errors(f"cannot link {self.dir / self.CURRENT}"):
                os.replace(link_tmp, self.dir / self.CURRENT)
            fsync_dir(self.dir)
            with os_errors(f"cannot remove the journal in {self.dir}"):
                self._drop_journal()
            if replaced is not None:
                self._remove_model(replaced)
            self._drop_copies(set(self._files.values()))
        except (BulletinError, OSError) as exc:
            log.warning(
                "%s: version %s is committed, but tidying up failed (the next open finishes it): %s",
                self.dir,
                self._state.version if self._state else None,
                exc,
            )

    def _mark(self, name: str) -> None:
        with os_errors(f"cannot mark {self.dir / name}"):
            if (self.dir / name).is_dir():
                os.close(os.open(self.dir / name / self.MARKER, os.O_WRONLY | os.O_CREAT, 0o644))

    def _discard_pending(self) -> None:
        if self._pending is not None:
            name, ckpt = self._pending
            if self._state is None or name != self._state.model_dir:
                ckpt.close()
                self._remove_model(name, quiet=True)  # or at the next open
        self._pending = None
        self._pending_fps = None

    def abort(self) -> None:
        """Drop a load or apply that will not be activated, restoring what was held."""
        with os_errors(f"cannot restore {self.dir}"):
            self._roll_back()
        self._journaled = False
        held = self._state.model_dir if self._state is not None else None
        if self._pending_files is not None and self._pending is not None and self._pending[0] == held and held:
            self._sync_files(held, self._files)  # model files changed in the held folder: back
        self._pending_files = None
        self._discard_pending()
        self._drop_copies(set(self._files.values()))

    def close(self) -> None:
        """Release the files and the folder's lock (idempotent). A change not activated
        stays on disk until the next open rolls it back."""
        if self._pending is not None and self._pending[1] is not self._checkpoint:
            self._pending[1].close()
        if self._checkpoint is not None:
            self._checkpoint.close()
            self._checkpoint = None
        self._unlock()
