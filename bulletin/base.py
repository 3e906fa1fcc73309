"""The base of the next diff: the bits of a run's last committed version (:class:`PublishedBase`).

One object owns what a publisher diffs against, and it moves only when a version is
committed: :meth:`PublishedBase.advance` runs after the manifest was created, so a
publish that fails or whose commit stayed unknown leaves it at the version committed
before. Two halves:

- **Host**: every tensor's bits, in a cache directory, memory-mapped (file-backed
  pages, not the process's own memory)::

      <cache>/state.json     the version held, its manifest digest, folder, fingerprints
      <cache>/base-<id>/     its bits: a safetensors folder (a keyframe's files, patched)
      <cache>/.lock          one publisher at a time (flock)

  Opened against the run's tip, the folder is verified tensor by tensor against the
  fingerprints its state names (the fingerprint is a sum over elements: each tensor
  checks alone), then brought to the tip by the patches after it, or rebuilt from the
  newest keyframe (its files streamed to the folder with ``get_to_file``, SHA-256
  verified, never whole in memory) when missing, damaged or on another chain. A patch
  commit writes only the changed elements into the maps; a keyframe commit switches to
  the folder its files were written to (and uploaded from). ``state.json`` is written
  after the bits, so a publisher killed at any instant leaves a folder that either
  verifies for the version named or is found stale and rebuilt: never silently wrong.
  Nothing is fsynced per version: the verification at open is what makes the cache
  trusted, not durability (a power loss is found the same way), so a version costs
  no forced write of the whole model.
- **Taken since**: the snapshots taken after the committed version and not committed
  yet (``publish_async`` queues them). Each holds what it found when it was taken, the
  change of every host tensor from the snapshot before (O(changed)), or, for a
  keyframe, its private copy of the bits. The base of the next diff is the committed
  bits plus those: :meth:`PublishedBase.diff_next` diffs against the committed bits
  (or the newest copy taken since) and takes the changes since out of the result
  (deltas wrap, so a change is undone by its negation). The maps are never written
  with them: a commit writes its own change into the maps and lets its snapshot go;
  after a failure :meth:`PublishedBase.reset` drops every one, so the next snapshot
  diffs against the committed bits again, exactly.
- **Device**: for CUDA tensors, their served bits kept on the GPU
  (:class:`~bulletin.device_kept.DeviceKept`) and diffed there, at snapshot time, so
  that only the change crosses to the host. The device runs ahead of the commit by the
  snapshots queued (each is diffed against the one before it); their fingerprints
  are tracked here, and after a failure :meth:`PublishedBase.reset` drops the device
  bits, so the next snapshot starts again from the committed host bits.

The publisher's thread takes snapshots while its background thread commits: one lock
makes each commit's write of the maps and each tensor's diff against them atomic.

Whole today; a shard of each tensor (global offsets, per-part fingerprints summed) is
the same object with a smaller folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from bulletin.checkpoint import INDEX_NAME, Checkpoint, encode_safetensors_header, hf_index, plan_checkpoint
from bulletin.device_kept import DeviceKept
from bulletin.errors import BulletinError, FingerprintMismatch, FormatError, InternalError
from bulletin.fileio import os_errors, write_atomic
from bulletin.run import Run, StoredManifest
from bulletin.shared_files import Privatizer, make_private, remove_temps, shared_files
from bulletin.sync import plan
from bulletin.target import Held
from patcher.apply import apply
from patcher.context_diff import diff_ranked
from patcher.decode import decode
from patcher.diff import diff
from patcher.fingerprint import fingerprint, format_fingerprint, parse_fingerprint
from patcher.fold import fold
from patcher.patch import Patch, TensorDelta, TensorSpec
from schemas.manifest import FileRef, manifest_files

__all__ = ["CACHE_ENV", "PublishedBase", "StagedKeyframe", "default_cache_root"]

#: Overrides where publishers keep their bases (else ``$XDG_CACHE_HOME/bulletin``, else
#: ``~/.cache/bulletin``; each under ``publisher/<store hash>/<run>``).
CACHE_ENV: Final = "BULLETIN_CACHE_DIR"
STATE_NAME: Final = "state.json"
LOCK_NAME: Final = ".lock"
_FOLDER_PREFIX: Final = "base-"
#: The cache's own format; a state of any other is stale (rebuilt, never an error).
_CACHE_FORMAT: Final = 1
#: Threads that fingerprint the folder when it is opened (the compiled loop frees the GIL).
_VERIFY_THREADS: Final = 4

log = logging.getLogger("bulletin.base")

Bits = NDArray[np.unsignedinteger]


def default_cache_root() -> Path:
    """Where publishers keep their bases by default (``$BULLETIN_CACHE_DIR``, else the
    platform's cache folder)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "bulletin"


def _release(fd: int, temporary: Path | None) -> None:
    os.close(fd)  # the flock goes with it
    if temporary is not None:
        shutil.rmtree(temporary, ignore_errors=True)


def _store_cache_dir(store_url: str, run: str) -> Path:
    digest = hashlib.sha256(store_url.encode()).hexdigest()[:16]
    return default_cache_root() / "publisher" / digest / run


@dataclass(frozen=True, slots=True)
class KeyframeFile:
    """One file of a staged keyframe, as written: its name, path, size and SHA-256."""

    name: str
    path: Path
    size: int
    sha256: str


#: Writes at least this large are hashed on another thread while they are written.
_HASH_APART_BYTES: Final = 1 << 20


class StagedKeyframe:
    """A keyframe being written into a new folder of the cache, tensor by tensor in name
    order (the order of :func:`~bulletin.checkpoint.plan_checkpoint`), each file's
    SHA-256 computed as it is written. The bytes are exactly
    :func:`~bulletin.checkpoint.safetensors_bytes`'. Uploaded from the files (each data
    file handed to ``on_file`` once it is closed, for an upload to start while the next
    is written); once its version is committed the folder becomes the base
    (:meth:`PublishedBase.advance`)."""

    def __init__(self, folder: Path, specs: Mapping[str, TensorSpec], file_bytes: int) -> None:
        self.folder = folder
        self.on_file: Callable[[KeyframeFile], None] | None = None
        self.specs = dict(specs)
        self._plan = plan_checkpoint(specs, file_bytes)
        self._order = [(i, spec) for i, (_, shard) in enumerate(self._plan) for spec in shard]
        self._next = 0
        self._open: tuple[Any, Any, int] | None = None  # (file object, hash, plan index)
        self.files: list[KeyframeFile] = []
        # Each tensor's bytes are hashed on this thread while the caller's writes them.
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bulletin-keyframe-sha256")
        with os_errors(f"cannot create {folder}"):
            folder.mkdir(parents=True)

    def write(self, name: str, bits: NDArray[Any]) -> None:
        """Append tensor ``name`` (the next one in name order) with ``bits``."""
        if self._next >= len(self._order) or self._order[self._next][1].name != name:
            raise InternalError(f"keyframe tensors written out of order at {name!r}")
        index, spec = self._order[self._next]
        data = np.ascontiguousarray(bits).reshape(-1).view(np.uint8)
        if data.size != spec.nbytes:
            raise InternalError(f"{name}: {data.size} bytes for a tensor of {spec.nbytes}")
        if self._open is None or self._open[2] != index:
            self._close_file()
            file_name, shard = self._plan[index]
            header, _ = encode_safetensors_header(shard, {"format": "pt"})
            with os_errors(f"cannot write {self.folder / file_name}"):
                fh = open(self.folder / file_name, "wb")  # noqa: SIM115 - closed by _close_file
            self._open = (fh, hashlib.sha256(), index)
            self._put(header)
        self._put(data.data)
        self._next += 1

    def _put(self, data: bytes | memoryview) -> None:
        if self._open is None:  # pragma: no cover - write() opens the file first
            raise InternalError("keyframe bytes written with no file open")
        fh, digest, _ = self._open
        # Both release the GIL: the hash of these bytes overlaps their write, and is
        # done when this returns (the caller may drop or change them then).
        hashing = self._hasher.submit(digest.update, data) if len(data) >= _HASH_APART_BYTES else None
        try:
            with os_errors(f"cannot write {fh.name}"):
                fh.write(data)
        finally:
            if hashing is not None:
                hashing.result()
        if hashing is None:
            digest.update(data)

    def _close_file(self) -> None:
        if self._open is None:
            return
        fh, digest, index = self._open
        self._open = None
        with os_errors(f"cannot write {fh.name}"):
            fh.close()
        path = Path(fh.name)
        done = KeyframeFile(self._plan[index][0], path, path.stat().st_size, digest.hexdigest())
        self.files.append(done)
        if self.on_file is not None:
            self.on_file(done)

    def finish(self) -> list[KeyframeFile]:
        """Close the last file, write the index of a split keyframe; the files to upload."""
        if self._next != len(self._order):
            raise InternalError(f"keyframe finished after {self._next} of {len(self._order)} tensors")
        self._close_file()
        if len(self._plan) > 1:
            index = hf_index(self._plan)
            path = self.folder / INDEX_NAME
            with os_errors(f"cannot write {path}"):
                path.write_bytes(index)
            self.files.append(KeyframeFile(INDEX_NAME, path, len(index), hashlib.sha256(index).hexdigest()))
        self._hasher.shutdown()
        return list(self.files)

    def discard(self) -> None:
        if self._open is not None:
            with contextlib.suppress(OSError):
                self._open[0].close()
            self._open = None
        self._hasher.shutdown()
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass(frozen=True, slots=True)
class _State:
    version: int
    manifest_digest: str
    folder: str
    fingerprints: dict[str, int]


@dataclass(slots=True)
class _Taken:
    """A snapshot taken since the committed version, not committed yet: for each host
    tensor, its change from the snapshot before or its own bits (with their fingerprint
    once known); a tensor with neither was read lazily (``publish``), and nothing is
    diffed against it."""

    version: int
    specs: dict[str, TensorSpec]
    changes: Mapping[str, TensorDelta]
    bits: Mapping[str, Bits]
    fingerprints: dict[str, int] = field(default_factory=dict)


def _undone(delta: TensorDelta) -> TensorDelta:
    """The change that takes ``delta``'s target back to its base (wrapping negation)."""
    back = np.negative(delta.delta)
    return TensorDelta(delta.spec, delta.indices, back, delta.target_fingerprint, delta.base_fingerprint)


def _read_state(path: Path) -> _State | None:
    """The cache's state, or None for a missing or unreadable one (then it is stale)."""
    try:
        raw = json.loads(path.read_bytes())
        if raw.get("cache_format") != _CACHE_FORMAT:
            return None
        folder = raw["folder"]
        if not isinstance(folder, str) or not folder.startswith(_FOLDER_PREFIX) or "/" in folder:
            return None
        fps = {str(k): parse_fingerprint(v) for k, v in raw["fingerprints"].items()}
        return _State(int(raw["version"]), str(raw["manifest_digest"]), folder, fps)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, BulletinError):
        return None


class PublishedBase:
    """The bits of the last committed version of ``run``, the base of the next diff.

    ``cache_dir``: the folder to keep them in (None: the default one for the store and
    run, or a temporary one, removed at :meth:`close`, for a memory store). A folder
    another publisher holds is not shared: this one then works in a temporary folder
    (a warning says so). Not thread-safe: the publisher calls it from one thread at a
    time.
    """

    def __init__(self, run: Run, served_dtype: str, cache_dir: str | os.PathLike[str] | None = None) -> None:
        self._run = run
        self.stored: StoredManifest | None = None
        self._temporary = False
        if cache_dir is not None:
            folder = Path(cache_dir)
        elif run.store.url.startswith("memory://"):  # the run ends with the process
            folder = Path(tempfile.mkdtemp(prefix="bulletin-publisher-"))
            self._temporary = True
        else:
            folder = _store_cache_dir(run.store.url, run.name)
        self.cache_dir = self._lock(folder)
        self._ckpt: Checkpoint | None = None
        self._folder: str | None = None
        # The thread making the files a local store shares private (see _shared).
        self._privatizer: Privatizer | None = None
        # The device half, and the snapshots taken since the committed version (queued).
        self._device = DeviceKept(served_dtype)
        self._device_fps: dict[str, int] = {}
        self._taken: list[_Taken] = []
        # A commit (the background thread) against a snapshot's diffs (the caller's).
        self._mutex = threading.Lock()

    # -- the cache folder ----------------------------------------------------------------

    def _lock(self, folder: Path) -> Path:
        with os_errors(f"cannot create the publisher cache {folder}"):
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if self._temporary:  # pragma: no cover - a fresh temp folder has no other holder
                raise InternalError(f"{folder}: a fresh temporary folder is locked") from None
            other = Path(tempfile.mkdtemp(prefix="bulletin-publisher-"))
            log.warning(
                "%s: another publisher holds the cache %s; this one keeps its base in %s (rebuilt from the run)",
                self._run.name,
                folder,
                other,
            )
            self._temporary = True
            return self._lock(other)
        # A publisher dropped without close() still lets the lock (and a temporary folder) go.
        self._release = weakref.finalize(self, _release, fd, folder if self._temporary else None)
        return folder

    def close(self) -> None:
        """Release the maps and the lock; a temporary folder is removed. Idempotent. A
        private copy still running stops: the next publisher of the cache makes it."""
        self._stop_privatizing()
        self._unmap()
        self._release()

    def _unmap(self) -> None:
        if self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None

    def _map(self, folder: str) -> Checkpoint:
        self._unmap()
        path = self.cache_dir / folder
        with os_errors(f"cannot read {path}"):
            remove_temps(path)
            shared = bool(shared_files(path))
        # A file a local store shares is its object: never written through this map.
        self._ckpt = Checkpoint(path, writable=not shared)
        self._folder = folder
        return self._ckpt

    @property
    def _shared(self) -> bool:
        """Whether the folder mapped holds files a local store shares (mapped read only)."""
        return self._ckpt is not None and not self._ckpt.writable

    def _start_privatizing(self) -> None:
        """Copy the shared files in the background (after a keyframe's commit)."""
        if self._shared and self._privatizer is None and self._folder is not None:
            self._privatizer = Privatizer(self.cache_dir / self._folder)

    def _stop_privatizing(self) -> None:
        if self._privatizer is not None:
            self._privatizer.stop()
            self._privatizer = None

    def _writable(self) -> Checkpoint:
        """The base's map, to write the next version into: every shared file first made
        private (waiting for the background copy, then copying what it left)."""
        if self._ckpt is None or self._folder is None:
            raise InternalError("the base holds no version")
        if not self._shared:
            return self._ckpt
        if self._privatizer is not None:
            self._privatizer.join()
            self._privatizer = None
        for path in shared_files(self.cache_dir / self._folder):
            make_private(path)
        # The old map is left to readers of its views (closed, it stays valid for them).
        ckpt = self._map(self._folder)
        if self._shared:  # pragma: no cover - every shared file was just copied
            raise InternalError(f"{self.cache_dir / self._folder}: still shared after its private copy")
        return ckpt

    def _new_folder(self) -> Path:
        return self.cache_dir / f"{_FOLDER_PREFIX}{secrets.token_hex(6)}"

    def _write_state(self, stored: StoredManifest, folder: str, fingerprints: Mapping[str, int]) -> None:
        doc = {
            "cache_format": _CACHE_FORMAT,
            "run": self._run.name,
            "store": self._run.store.url,
            "version": stored.version,
            "manifest_digest": stored.digest,
            "folder": folder,
            "fingerprints": {name: format_fingerprint(fp) for name, fp in sorted(fingerprints.items())},
        }
        write_atomic(self.cache_dir / STATE_NAME, [json.dumps(doc, indent=1).encode()])

    def _sweep(self) -> None:
        """Remove folders of this cache the state does not name (staged keyframes of a
        publisher killed before their commit, bases replaced)."""
        for entry in self.cache_dir.iterdir():
            if entry.name.startswith(_FOLDER_PREFIX) and entry.name != self._folder and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)

    # -- the committed version -----------------------------------------------------------

    @property
    def version(self) -> int | None:
        return self.stored.version if self.stored is not None else None

    @property
    def specs(self) -> Mapping[str, TensorSpec]:
        return self.stored.manifest.specs if self.stored is not None else {}

    @property
    def fingerprints(self) -> Mapping[str, int]:
        return self.stored.manifest.fingerprints if self.stored is not None else {}

    @property
    def files(self) -> tuple[FileRef, ...]:
        return manifest_files(self.stored.manifest) if self.stored is not None else ()

    def bits(self, name: str) -> NDArray[np.unsignedinteger]:
        """The committed bits of ``name``: a read-only view of the map."""
        if self._ckpt is None:
            raise InternalError("the base holds no version")
        view = self._ckpt.bits(name)[...]
        view.flags.writeable = False
        return view

    def views(self) -> dict[str, NDArray[np.unsignedinteger]]:
        """Every tensor's committed bits, read-only views (the context codec's base)."""
        return {name: self.bits(name) for name in self.specs}

    def diff(self, name: str, bits: NDArray[Any], *, ranked: bool = False) -> TensorDelta:
        """The change from the committed bits of ``name`` to ``bits`` (same spec), with
        its target fingerprint in O(changed): the codec's chunked diff of one tensor, or
        (``ranked``, for the context codec) the diff that ranks its changes as it goes."""
        spec = self.specs[name]
        differ = diff_ranked if ranked else diff
        patch = differ(
            {name: spec}, {name: self.bits(name)}, {name: bits}, base_fingerprints={name: self.fingerprints[name]}
        )
        return patch.tensors[name]

    def open(self, tip: StoredManifest | None) -> None:
        """Hold ``tip`` (the run's newest version; None for an empty run): the cache's
        folder when it verifies and the run's patches lead from it to ``tip``, else
        rebuilt from the run (keyframe files streamed to a new folder, then patches)."""
        self._stop_privatizing()
        self._unmap()
        state = _read_state(self.cache_dir / STATE_NAME)
        held = self._verified(state, tip) if state is not None else None
        if tip is None:
            self._stop_privatizing()
            self.stored, self._folder = None, None
            self._sweep()
            self.reset()
            return
        if held is not None and (held.version, held.fingerprints) == (tip.version, dict(tip.manifest.fingerprints)):
            log.debug("%s: the cached base holds version %d", self._run.name, tip.version)
        else:
            self._reach(tip, held)
        if self._folder is None:  # pragma: no cover - _verified or _reach mapped one
            raise InternalError(f"{self._run.name}: the base holds version {tip.version} in no folder")
        self.stored = tip
        self._write_state(tip, self._folder, tip.manifest.fingerprints)
        self._sweep()
        self.reset()

    def _verified(self, state: _State, tip: StoredManifest | None) -> Held | None:
        """What the cached folder holds: the state's version if every tensor's fingerprint
        is the state's, or ``tip`` if every one is the tip's (a publisher killed after
        writing a commit's changes, before the state named them); else None."""
        try:
            ckpt = self._map(state.folder)
        except (BulletinError, OSError) as exc:
            log.info("%s: the cached base cannot be read (%s); rebuilding it", self._run.name, exc)
            self._unmap()
            return None
        names = list(ckpt)
        self._start_privatizing()  # a keyframe shared with a local store: copied while this reads

        def hashed(name: str) -> int:
            return fingerprint(ckpt.bits(name))

        with ThreadPoolExecutor(max_workers=_VERIFY_THREADS, thread_name_prefix="bulletin-verify") as pool:
            found = dict(zip(names, pool.map(hashed, names), strict=True))
        if found == state.fingerprints:
            return Held(state.version, found, state.manifest_digest)
        if tip is not None and found == dict(tip.manifest.fingerprints):
            return Held(tip.version, found, tip.digest)
        wrong = sorted(name for name in found if found[name] != state.fingerprints.get(name))
        log.warning(
            "%s: the cached base of version %d does not verify (%s); rebuilding it",
            self._run.name,
            state.version,
            ", ".join(wrong[:3]) or "other tensors",
        )
        self._stop_privatizing()
        self._unmap()
        return None

    def _reach(self, tip: StoredManifest, held: Held | None) -> None:
        """Bring the folder to ``tip``: patches from ``held`` when the run leads from it,
        else the newest keyframe at or below ``tip`` and the patches after it."""
        route = plan(self._run, tip, held if self._ckpt is not None else None)
        if route.keyframe is not None:
            self._stop_privatizing()  # the folder goes
            self._unmap()
            self._folder = None
            self._download_keyframe(route.keyframe)
            fps = dict(route.keyframe.manifest.fingerprints)
        elif held is not None:
            fps = dict(held.fingerprints)
        else:  # pragma: no cover - plan gives a keyframe whenever nothing is held
            raise InternalError(f"{self._run.name}: no route to version {tip.version}")
        ckpt = self._writable() if route.patches else self._ckpt
        assert ckpt is not None
        for step in route.patches:
            ref = step.manifest.patch
            if ref is None:  # pragma: no cover - plan routes only through patches
                raise InternalError(f"version {step.version} has no patch")
            shards = self._run.download(ref.shards)
            writable = {name: ckpt.bits(name) for name in ckpt}
            change = decode(shards, specs=step.manifest.specs, base=writable, base_fingerprints=fps)
            del shards
            fps = apply(change, writable, fps)
            if fps != dict(step.manifest.fingerprints):
                raise FingerprintMismatch(
                    f"{self._run.name}: version {step.version}'s patch does not reach its manifest's fingerprints"
                )
        log.info(
            "%s: the publisher's base now holds version %d (%s)",
            self._run.name,
            tip.version,
            f"keyframe {route.keyframe.version} + {len(route.patches)} patches"
            if route.keyframe is not None
            else f"{len(route.patches)} patches onto the cached version",
        )

    def _download_keyframe(self, stored: StoredManifest) -> None:
        ref = stored.manifest.keyframe
        if ref is None:  # pragma: no cover - plan's keyframes have one
            raise InternalError(f"version {stored.version} has no keyframe")
        folder = self._new_folder()
        with os_errors(f"cannot create {folder}"):
            folder.mkdir(parents=True)
        try:
            for obj in ref.files:
                name = obj.key.rsplit("/", 1)[-1]
                if name.startswith(".") or not (name.endswith(".safetensors") or name == INDEX_NAME):
                    raise FormatError(f"{obj.key}: not a file of a safetensors checkpoint")
                self._run.store.get_to_file(
                    self._run.key(obj.key), folder / name, sha256=obj.sha256, max_bytes=obj.size
                )
            ckpt = self._map(folder.name)
            if ckpt.specs != dict(stored.manifest.specs):
                raise FormatError(
                    f"version {stored.version}: the keyframe's files hold other tensors than its manifest"
                )
            for name in ckpt:
                if fingerprint(ckpt.bits(name)) != stored.manifest.fingerprints[name]:
                    raise FingerprintMismatch(
                        f"version {stored.version}: keyframe tensor {name!r} misses its fingerprint"
                    )
        except BaseException:
            self._unmap()
            self._folder = None
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def stage(self, specs: Mapping[str, TensorSpec], file_bytes: int) -> StagedKeyframe:
        """A new folder of the cache for a keyframe of ``specs`` (files of ``file_bytes``)."""
        return StagedKeyframe(self._new_folder(), specs, file_bytes)

    def advance(self, stored: StoredManifest, *, patch: Patch | None, staged: StagedKeyframe | None) -> None:
        """Make ``stored``, just committed, the base: the folder ``staged`` was written to
        (a keyframe version), or ``patch`` (its transition from the version held) written
        into the maps, changed elements only. The state names it last; its snapshot (and
        any older one) is let go."""
        with self._mutex:
            if staged is not None:
                self._stop_privatizing()  # the folder before's: it goes
                self._map(staged.folder.name)
            elif patch is not None and self._ckpt is not None and self.stored is not None:
                ckpt = self._writable()
                reached = apply(patch, {name: ckpt.bits(name) for name in ckpt}, self.fingerprints)
                if reached != dict(stored.manifest.fingerprints):  # pragma: no cover - the patch made them
                    raise InternalError(f"version {stored.version}: the base missed the fingerprints it committed")
            else:
                raise InternalError(
                    f"version {stored.version} committed with neither a patch of the base nor a keyframe"
                )
            if self._folder is None:  # pragma: no cover - a version held is in a folder
                raise InternalError(f"version {stored.version} committed onto a base in no folder")
            self.stored = stored
            self._taken = [taken for taken in self._taken if taken.version > stored.version]
        self._write_state(stored, self._folder, stored.manifest.fingerprints)
        if staged is not None:
            self._sweep()  # the folder of the version before
            self._start_privatizing()  # its files, where a local store took them as objects

    # -- snapshots taken, and the device half ----------------------------------------------

    @property
    def next_version(self) -> int:
        """The version the next snapshot is for (after those queued)."""
        with self._mutex:
            if self._taken:
                return self._taken[-1].version + 1
            return self.stored.version + 1 if self.stored is not None else 1

    @property
    def prepared_specs(self) -> Mapping[str, TensorSpec] | None:
        """The layout of the last snapshot taken (or of the committed version)."""
        with self._mutex:
            if self._taken:
                return self._taken[-1].specs
            return dict(self.stored.manifest.specs) if self.stored is not None else None

    def prepared(
        self,
        version: int,
        specs: Mapping[str, TensorSpec],
        on_device: set[str],
        *,
        changes: Mapping[str, TensorDelta] | None = None,
        bits: Mapping[str, Bits] | None = None,
    ) -> None:
        """A snapshot of ``version`` was taken: ``changes`` (host or device, each from the
        snapshot before) and ``bits`` (private copies) are what the next diff's base holds
        for it until it is committed; its GPU tensors (``on_device``) are the device's
        bits now; the device forgets the others."""
        with self._mutex:
            self._taken.append(_Taken(version, dict(specs), changes or {}, bits or {}))
        for name in [n for n in self._device_fps if n not in on_device]:
            self._device.drop(name)
            del self._device_fps[name]

    def diff_next(self, spec: TensorSpec, bits: NDArray[Any], *, ranked: bool = False) -> TensorDelta | None:
        """The change of host tensor ``spec`` from the base of the next diff (the committed
        bits and the snapshots taken since) to ``bits``, in O(changed) beyond one read of
        each; None when a snapshot taken since holds neither its change nor its bits.

        The diff runs against the committed bits, or the private copy of the newest
        snapshot since that holds one (a keyframe's). When no snapshot after those changed
        the tensor, that is the base itself: the diff of :meth:`diff` (``ranked`` as
        there). Else the plain diff is folded with their changes undone; the context
        encoder then ranks it itself, against the bits it is coded against (the version
        before, committed by then)."""
        name = spec.name
        with self._mutex:
            since: list[TensorDelta] = []
            for taken in reversed(self._taken):
                if name in taken.bits:
                    below = taken.bits[name]
                    if name not in taken.fingerprints:
                        taken.fingerprints[name] = fingerprint(below)
                    fp = taken.fingerprints[name]
                    break
                if name not in taken.changes:
                    return None
                since.append(taken.changes[name])
            else:
                if self._ckpt is None or self.specs.get(name) != spec:
                    raise InternalError(f"{name}: a patch snapshot of a tensor the base does not hold as {spec}")
                below, fp = self.bits(name), self.fingerprints[name]
            since.reverse()
            moved = [delta for delta in since if delta.changed]
            if not moved:
                differ = diff_ranked if ranked else diff
                found = differ({name: spec}, {name: below}, {name: bits}, base_fingerprints={name: fp})
                return found.tensors[name]
            plain = diff({name: spec}, {name: below}, {name: bits}, base_fingerprints={name: fp})
            del below  # a view of the maps: let go before a commit may switch them
        undo = [Patch({name: _undone(delta)}) for delta in reversed(moved)]
        return fold([*undo, plain]).tensors[name]

    def device_delta(self, spec: TensorSpec, value: Any) -> TensorDelta | None:
        """The change of GPU tensor ``value`` since the last snapshot, found on its device
        (which moves on to it), or None when the device holds nothing for it."""
        if spec.name not in self._device_fps:
            return None
        change = self._device.diff(spec.name, value)
        if change is None:
            return None
        delta = TensorDelta.from_change(spec, change, self._device_fps[spec.name])
        self._device_fps[spec.name] = delta.target_fingerprint
        return delta

    def device_keep(self, name: str, value: Any) -> NDArray[np.unsignedinteger]:
        """Keep GPU tensor ``value``'s served bits on its device from now on; a host copy."""
        host, fp = self._device.keep(name, value)
        self._device_fps[name] = fp
        return host

    def reset(self) -> None:
        """After a failure (or at open): the next snapshot is of the version after the
        committed one and diffs against its bits; the snapshots taken since and the
        device's bits are dropped."""
        with self._mutex:
            self._taken = []
        self._device = DeviceKept(self._device.served_dtype)
        self._device_fps = {}
