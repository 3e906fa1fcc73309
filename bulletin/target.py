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
    abort()                       undo a load or apply that will not be activated
    activate(version)             make it live and durable (engine reload, state file)
    close()                       release files and handles (idempotent)

Until ``activate`` the previous version is still the one reported as current.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from pydantic import ValidationError

from bulletin.checkpoint import Checkpoint, write_checkpoint
from bulletin.errors import (
    ConfigError,
    FormatError,
    IncompatibleTensors,
    InvalidInput,
)
from bulletin.fileio import write_atomic
from bulletin.keyspace import check_run_name
from patcher.apply import apply as apply_patch
from patcher.apply_shards import apply_shards
from patcher.decode import decode
from patcher.fingerprint import fingerprint, format_fingerprint, parse_fingerprint
from patcher.patch import Patch, TensorSpec
from schemas.local_state import JournalV1, LocalStateV1

__all__ = ["ArrayTarget", "Held", "LocalDirTarget", "WeightTarget"]

Bits = NDArray[np.unsignedinteger]
#: A change an ArrayTarget applied: a decoded patch, or the shards it applied straight from.
_Applied = Patch | Sequence[bytes]


@dataclass(frozen=True, slots=True)
class Held:
    """What a target holds, verified: a version and its tensors' fingerprints."""

    version: int
    fingerprints: dict[str, int]


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

    @abstractmethod
    def full_fingerprints(self) -> dict[str, int]:
        """Recompute every tensor's fingerprint from the bits held (staged ones included)."""

    @abstractmethod
    def activate(self, version: int) -> None:
        """Make what was loaded or applied live and durable as ``version``."""

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
        new = apply_shards(shards, self.arrays, fingerprints, specs=self._held_specs())  # restores on failure
        self._applied.append(shards)
        return new

    def full_fingerprints(self) -> dict[str, int]:
        return {name: fingerprint(bits) for name, bits in self.arrays.items()}

    def activate(self, version: int) -> None:
        self.version = version
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


class LocalDirTarget(WeightTarget):
    """A directory holding the current version as plain safetensors, changed atomically.

    Layout::

        state.json        LocalStateV1: version, fingerprints, which model folder
        current ->        symlink to the model folder (point engines here)
        model-<id>/       model.safetensors (+ HF index when split)
        journal.json/.npz present only while an in-place apply runs (undo data)

    An apply writes the old bits of every element it will change to the journal
    (fsynced) before touching the files, and the state file names the new version
    only after the files are flushed. Opening the directory after a crash restores
    from the journal, so the folder always holds exactly the version ``state.json``
    names. A keyframe is written to a fresh folder and switched to by replacing
    ``state.json``; leftover folders are removed at the next open.
    """

    STATE = "state.json"
    JOURNAL = "journal.json"
    UNDO = "journal.npz"
    CURRENT = "current"

    def __init__(self, directory: str | os.PathLike[str], *, run: str | None = None) -> None:
        self.dir = Path(directory)
        self.run = None if run is None else check_run_name(run)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._state = self._read_state()
        self._checkpoint: Checkpoint | None = None
        self._pending: tuple[str, Checkpoint] | None = None
        self._pending_fps: dict[str, int] | None = None
        self._recover()
        if self._state is not None:
            self._checkpoint = Checkpoint(self.dir / self._state.model_dir, writable=True)

    # -- state ---------------------------------------------------------------------------

    def _read_state(self) -> LocalStateV1 | None:
        path = self.dir / self.STATE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            state = LocalStateV1.model_validate_json(data)
        except ValidationError as exc:
            raise FormatError(f"{path}: unreadable local state: {exc.errors()[0]['msg']}") from exc
        if self.run is not None and state.run is not None and state.run != self.run:
            raise ConfigError(f"{self.dir} holds run {state.run!r}, not {self.run!r}")
        return state

    def _read_journal(self, path: Path) -> JournalV1:
        try:
            return JournalV1.model_validate_json(path.read_bytes())
        except ValidationError as exc:
            raise FormatError(f"{path}: unreadable undo journal: {exc.errors()[0]['msg']}") from exc

    def _recover(self) -> None:
        journal_path = self.dir / self.JOURNAL
        if journal_path.exists():
            journal = self._read_journal(journal_path)
            if (
                self._state is not None
                and journal.model_dir == self._state.model_dir
                and journal.from_version == self._state.version
            ):
                self._undo(journal)  # the apply never committed: put the old bits back
            (self.dir / self.UNDO).unlink(missing_ok=True)
            journal_path.unlink()
        keep = {self._state.model_dir} if self._state else set()
        for entry in self.dir.iterdir():
            if entry.name.startswith("model-") and entry.name not in keep and entry.is_dir():
                shutil.rmtree(entry)

    def _undo(self, journal: JournalV1) -> None:
        undo_path = self.dir / self.UNDO
        if not undo_path.exists():  # crashed before the undo data was durable: nothing changed
            return
        with (
            Checkpoint(self.dir / journal.model_dir, writable=True) as ckpt,
            np.load(undo_path, allow_pickle=False) as undo,
        ):
            names = json.loads(bytes(undo["names"]).decode())
            for k, name in enumerate(names):
                flat = ckpt.bits(name).reshape(-1)
                flat[undo[f"i{k}"]] = undo[f"o{k}"]
            ckpt.flush()

    def layout(self) -> Mapping[str, TensorSpec] | None:
        return self._checkpoint.specs if self._checkpoint is not None else None

    def restored(self) -> Held | None:
        if self._state is None:
            return None
        return Held(self._state.version, {n: parse_fingerprint(f) for n, f in self._state.fingerprints.items()})

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
        self._discard_pending()
        name = f"model-{secrets.token_hex(6)}"
        write_checkpoint(self.dir / name, specs, tensors)
        self._pending = (name, Checkpoint(self.dir / name, writable=True))
        self._pending_fps = None

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
        if journaled and self._state is not None:
            self._write_journal(patch, ckpt, JournalV1(model_dir=model_dir, from_version=self._state.version))
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
        tmp = self.dir / f".{self.UNDO}.tmp"
        with open(tmp, "wb") as fh:
            np.savez(fh, **undo)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.dir / self.UNDO)
        write_atomic(self.dir / self.JOURNAL, [journal.model_dump_json().encode()])

    def full_fingerprints(self) -> dict[str, int]:
        if self._pending is None and self._checkpoint is None:
            return {}
        _, ckpt = self._working()
        return {name: fingerprint(ckpt.bits(name)) for name in ckpt.specs}

    def activate(self, version: int) -> None:
        if self._pending is None:
            raise InvalidInput("nothing to activate: load or apply first")
        model_dir, ckpt = self._pending
        fps = self._pending_fps
        if fps is None:
            fps = {name: fingerprint(ckpt.bits(name)) for name in ckpt.specs}
        state = LocalStateV1(
            run=self.run,
            version=version,
            model_dir=model_dir,
            fingerprints={n: format_fingerprint(fp) for n, fp in sorted(fps.items())},
            updated_at=datetime.now(UTC),
        )
        # The commit point of the local copy: from here on the folder is `version`.
        write_atomic(self.dir / self.STATE, [state.model_dump_json().encode()])
        link_tmp = self.dir / f".{self.CURRENT}.tmp"
        link_tmp.unlink(missing_ok=True)
        link_tmp.symlink_to(model_dir)
        os.replace(link_tmp, self.dir / self.CURRENT)
        old = self._state.model_dir if self._state else None
        self._state = state
        if self._checkpoint is not None and self._checkpoint is not ckpt:
            self._checkpoint.close()
        self._checkpoint = ckpt
        self._pending = None
        self._pending_fps = None
        (self.dir / self.UNDO).unlink(missing_ok=True)
        (self.dir / self.JOURNAL).unlink(missing_ok=True)
        if old is not None and old != model_dir:
            shutil.rmtree(self.dir / old, ignore_errors=True)

    def _discard_pending(self) -> None:
        if self._pending is not None:
            name, ckpt = self._pending
            if self._state is None or name != self._state.model_dir:
                ckpt.close()
                shutil.rmtree(self.dir / name, ignore_errors=True)
        self._pending = None
        self._pending_fps = None

    def abort(self) -> None:
        """Drop a load or apply that will not be activated, restoring what was held."""
        journal_path = self.dir / self.JOURNAL
        if journal_path.exists():
            journal = self._read_journal(journal_path)
            if self._state is not None and journal.model_dir == self._state.model_dir:
                self._undo(journal)
        (self.dir / self.UNDO).unlink(missing_ok=True)
        journal_path.unlink(missing_ok=True)
        self._discard_pending()

    def close(self) -> None:
        if self._checkpoint is not None:
            self._checkpoint.close()
            self._checkpoint = None
