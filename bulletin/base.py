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

**Whole or in blocks.** A :class:`~bulletin.Publisher` holds every tensor whole. A rank
of a :class:`~bulletin.distributed.ShardedPublisher` holds only the block of each
tensor it owns (:mod:`bulletin.blocks`): its folder is one safetensors file of those
blocks, ``state.json`` also names the blocks and each one's **part** of the tensor's
fingerprint (hashed with the tensor's own flat indices: the parts of every rank sum to
the manifest's fingerprint, which the sharded publisher checks across ranks after
:meth:`PublishedBase.open`). A rebuild then reads only the byte ranges of its blocks
from the keyframe's files (:mod:`bulletin.keyframe_blocks`); patches are applied to the
blocks, O(changed).
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
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from bulletin.blocks import Block, BlockChanges, block_changes, block_diff, part_fingerprint
from bulletin.checkpoint import INDEX_NAME, SINGLE_NAME, Checkpoint
from bulletin.device_kept import DeviceKept
from bulletin.errors import BulletinError, FingerprintMismatch, FormatError, InternalError
from bulletin.fileio import os_errors, write_atomic
from bulletin.keyframe_blocks import read_blocks
from bulletin.keyframe_stage import StagedKeyframe
from bulletin.patch_blocks import apply_to_blocks
from bulletin.run import Run, StoredManifest
from bulletin.shared_files import Privatizer, make_private, remove_temps, shared_files
from bulletin.sync import plan
from bulletin.target import Held
from patcher.apply import apply, put_bits
from patcher.decode import decode
from patcher.fingerprint import fingerprint, format_fingerprint, parse_fingerprint
from patcher.fold import fold
from patcher.patch import Patch, TensorDelta, TensorSpec
from schemas.manifest import FileRef, ObjectRef, manifest_files

__all__ = ["CACHE_ENV", "PublishedBase", "default_cache_root"]

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
class _State:
    version: int
    manifest_digest: str
    folder: str
    fingerprints: dict[str, int]
    #: What the folder holds of each tensor: its part of the fingerprint, and its block
    #: where not whole (a whole base holds every tensor: its parts are its fingerprints).
    parts: dict[str, int]
    blocks: dict[str, Block]


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
        parts = {str(k): parse_fingerprint(v) for k, v in raw.get("parts", raw["fingerprints"]).items()}
        blocks = {str(k): Block(tuple(b[0]), tuple(b[1]), tuple(b[2])) for k, b in raw.get("blocks", {}).items()}
        return _State(int(raw["version"]), str(raw["manifest_digest"]), folder, fps, parts, blocks)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, BulletinError):
        return None


def _whole(blocks: Mapping[str, Block], specs: Mapping[str, TensorSpec]) -> bool:
    """Whether ``blocks`` are every tensor of ``specs``, each whole (a Publisher's base)."""
    return set(blocks) == set(specs) and all(b.is_whole for b in blocks.values())


def _cut(blocks: Mapping[str, Block]) -> dict[str, Block]:
    """The blocks that are not whole tensors: what a state records."""
    return {name: block for name, block in blocks.items() if not block.is_whole}


class PublishedBase:
    """The bits of the last committed version of ``run``, the base of the next diff.

    ``cache_dir``: the folder to keep them in (None: the default one for the store and
    run, or a temporary one, removed at :meth:`close`, for a memory store). A folder
    another publisher holds is not shared: this one then works in a temporary folder
    (a warning says so). ``subfolder``: a folder under it, one per rank of a sharded
    job (whose ranks may share a file system). Not thread-safe: the publisher calls it
    from one thread at a time.
    """

    def __init__(
        self,
        run: Run,
        served_dtype: str,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        subfolder: str | None = None,
    ) -> None:
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
        if subfolder is not None:
            folder = folder / subfolder
        self.cache_dir = self._lock(folder)
        self._ckpt: Checkpoint | None = None
        self._folder: str | None = None
        #: The block of each tensor held (whole for a Publisher) and its part of the
        #: tensor's fingerprint (its fingerprint, when whole).
        self.blocks: dict[str, Block] = {}
        self.parts: dict[str, int] = {}
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
        cut = _cut(self.blocks)
        if cut or set(self.parts) != set(fingerprints):
            doc["parts"] = {name: format_fingerprint(fp) for name, fp in sorted(self.parts.items())}
            doc["blocks"] = {n: [list(b.shape), list(b.offsets), list(b.sizes)] for n, b in sorted(cut.items())}
        # Not fsynced, as the bits are not: opening verifies them against the run (an
        # fsync a step also waits for the journal, a keyframe's data blocks included).
        # No indent: json's C encoder serves only compact output, and a step writes this
        # (tens of ms a step in pure Python for a few hundred tensors' blocks and parts).
        write_atomic(self.cache_dir / STATE_NAME, [json.dumps(doc, separators=(",", ":")).encode()], durable=False)

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

    def diff(self, name: str, src: NDArray[Any], source: str | None = None, *, ranked: bool = False) -> BlockChanges:
        """The change of the block held of ``name`` (the whole tensor, for a Publisher)
        from its committed bits to ``src``, the block's elements' bits in dtype
        ``source`` (default: the served dtype; an F32 source is cast inside the diff),
        with its part of the fingerprint change in O(changed): :func:`~bulletin.blocks.block_diff`
        (``ranked`` as there)."""
        spec = self.specs[name]
        return block_diff(
            spec, self.blocks[name], self.bits(name), src, source or spec.dtype, self.parts[name], ranked=ranked
        )

    def open(self, tip: StoredManifest | None, owned: Mapping[str, Block] | None = None) -> None:
        """Hold ``tip`` (the run's newest version; None for an empty run), whole or the
        ``owned`` blocks of its tensors: the cache's folder when it verifies (and holds
        those blocks) and the run's patches lead from it to ``tip``, else rebuilt from the
        run (keyframe files streamed to a new folder, or the blocks copied out of them,
        then patches). Holding blocks, the caller checks that every rank's :attr:`parts`
        sum to ``tip``'s fingerprints."""
        self._stop_privatizing()
        self._unmap()
        if tip is None:
            self.stored, self._folder, self.blocks, self.parts = None, None, {}, {}
            self._sweep()
            self.reset()
            return
        specs = tip.manifest.specs
        wanted = {name: Block.whole(spec.shape) for name, spec in specs.items()} if owned is None else dict(owned)
        if any(name not in specs or block.shape != specs[name].shape for name, block in wanted.items()):
            raise InternalError(f"{self._run.name}: blocks asked of tensors version {tip.version} does not hold")
        state = _read_state(self.cache_dir / STATE_NAME)
        held = self._verified(state, tip, wanted) if state is not None else None
        if held is not None and (held.version, held.fingerprints) == (tip.version, dict(tip.manifest.fingerprints)):
            log.debug("%s: the cached base holds version %d", self._run.name, tip.version)
        else:
            self._reach(tip, held, wanted)
        if self._folder is None:  # pragma: no cover - _verified or _reach mapped one
            raise InternalError(f"{self._run.name}: the base holds version {tip.version} in no folder")
        self.stored = tip
        self._write_state(tip, self._folder, tip.manifest.fingerprints)
        self._sweep()
        self.reset()

    def forget(self, tip: StoredManifest | None) -> None:
        """Hold ``tip`` without its bits: the next version is a keyframe (a new layout)."""
        self._stop_privatizing()
        self._unmap()
        with contextlib.suppress(FileNotFoundError):
            (self.cache_dir / STATE_NAME).unlink()  # no folder verifies for it now
        self.stored, self._folder, self.blocks, self.parts = tip, None, {}, {}
        self._sweep()
        self.reset()

    def _hash_parts(self, ckpt: Checkpoint) -> dict[str, int]:
        """Each block's part of its tensor's fingerprint, from the folder mapped."""
        names = list(ckpt)

        def hashed(name: str) -> int:
            return part_fingerprint(self.blocks[name], ckpt.bits(name))

        with ThreadPoolExecutor(max_workers=_VERIFY_THREADS, thread_name_prefix="bulletin-verify") as pool:
            return dict(zip(names, pool.map(hashed, names), strict=True))

    def _verified(self, state: _State, tip: StoredManifest, wanted: Mapping[str, Block]) -> Held | None:
        """What the cached folder holds: the state's version if it holds the ``wanted``
        blocks and each one's part is the state's, or (whole) ``tip`` if every
        fingerprint is the tip's (a publisher killed after writing a commit's changes,
        before the state named them); else None."""
        if set(state.parts) != set(wanted) or state.blocks != _cut(wanted):
            log.info("%s: the cached base holds other blocks; rebuilding it", self._run.name)
            return None
        try:
            ckpt = self._map(state.folder)
            self.blocks = dict(wanted)
            specs = tip.manifest.specs
            if ckpt.specs != {n: TensorSpec(n, specs[n].dtype, b.sizes) for n, b in wanted.items()}:
                raise FormatError(f"{self.cache_dir / state.folder}: holds other tensors than its state")
        except (BulletinError, OSError) as exc:
            log.info("%s: the cached base cannot be read (%s); rebuilding it", self._run.name, exc)
            self._unmap()
            return None
        self._start_privatizing()  # a keyframe shared with a local store: copied while this reads
        found = self._hash_parts(ckpt)
        if found == state.parts:
            self.parts = found
            return Held(state.version, dict(state.fingerprints), state.manifest_digest)
        if _whole(self.blocks, tip.manifest.specs) and found == dict(tip.manifest.fingerprints):
            self.parts = found
            return Held(tip.version, found, tip.digest)
        wrong = sorted(name for name in found if found[name] != state.parts.get(name))
        log.warning(
            "%s: the cached base of version %d does not verify (%s); rebuilding it",
            self._run.name,
            state.version,
            ", ".join(wrong[:3]) or "other tensors",
        )
        self._stop_privatizing()
        self._unmap()
        return None

    def _reach(self, tip: StoredManifest, held: Held | None, wanted: Mapping[str, Block]) -> None:
        """Bring the folder to ``tip``: patches from ``held`` when the run leads from it,
        else the newest keyframe at or below ``tip`` and the patches after it."""
        route = plan(self._run, tip, held if self._ckpt is not None else None)
        whole = _whole(wanted, tip.manifest.specs)
        if route.keyframe is not None:
            self._stop_privatizing()  # the folder goes
            self._unmap()
            self._folder = None
            self.blocks = dict(wanted)
            if whole:
                self._download_keyframe(route.keyframe)
            else:
                self._extract_blocks(route.keyframe)
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
            writable = {name: ckpt.bits(name) for name in ckpt}
            if not whole:  # the blocks' part of each change, from the shards holding one; checked across ranks
                read = apply_to_blocks(
                    self._run, ref, step.manifest.specs, self.blocks, writable, workers=min(8, self._run.max_workers)
                )
                log.debug(
                    "%s: version %d: %d of %d shards hold changes of the blocks",
                    self._run.name,
                    step.version,
                    read,
                    len(ref.shards),
                )
                continue
            shards = self._run.download(ref.shards)
            change = decode(shards, specs=step.manifest.specs, base=writable, base_fingerprints=fps)
            del shards
            fps = apply(change, writable, fps)
            if fps != dict(step.manifest.fingerprints):
                raise FingerprintMismatch(
                    f"{self._run.name}: version {step.version}'s patch does not reach its manifest's fingerprints"
                )
        self.parts = fps if whole else self._hash_parts(ckpt)
        log.info(
            "%s: the publisher's base now holds version %d (%s)",
            self._run.name,
            tip.version,
            f"keyframe {route.keyframe.version} + {len(route.patches)} patches"
            if route.keyframe is not None
            else f"{len(route.patches)} patches onto the cached version",
        )

    def _keyframe_files(self, stored: StoredManifest) -> dict[str, ObjectRef]:
        """``stored``'s keyframe files by name, each checked to be one of a checkpoint."""
        ref = stored.manifest.keyframe
        if ref is None:  # pragma: no cover - plan's keyframes have one
            raise InternalError(f"version {stored.version} has no keyframe")
        files: dict[str, ObjectRef] = {}
        for obj in ref.files:
            name = obj.key.rsplit("/", 1)[-1]
            if name.startswith(".") or not (name.endswith(".safetensors") or name == INDEX_NAME):
                raise FormatError(f"{obj.key}: not a file of a safetensors checkpoint")
            files[name] = obj
        return files

    def _download_keyframe(self, stored: StoredManifest) -> None:
        folder = self._new_folder()
        with os_errors(f"cannot create {folder}"):
            folder.mkdir(parents=True)
        try:
            for name, obj in self._keyframe_files(stored).items():
                self._run.store.get_to_file(
                    self._run.key(obj.key), folder / name, sha256=obj.sha256, max_bytes=obj.size
                )
                make_private(folder / name)  # downloaded in pieces: laid out again in whole folios
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

    def _extract_blocks(self, stored: StoredManifest) -> None:
        """A new folder holding the blocks of :attr:`blocks` from ``stored``'s keyframe,
        read by byte ranges (:func:`~bulletin.keyframe_blocks.read_blocks`): the rank's
        shard of each file, not the file."""
        folder = self._new_folder()
        try:
            with os_errors(f"cannot create {folder}"):
                folder.mkdir(parents=True)
            read_blocks(
                self._run.store,
                self._run.key,
                self._keyframe_files(stored),
                stored.manifest.specs,
                self.blocks,
                folder / SINGLE_NAME,
                workers=min(8, self._run.max_workers),
            )
            make_private(folder / SINGLE_NAME)  # written by ranges: laid out again in whole folios
            self._map(folder.name)
        except BaseException:
            self._unmap()
            self._folder = None
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def stage(
        self,
        specs: Mapping[str, TensorSpec],
        file_bytes: int,
        *,
        blocks: Mapping[str, Block] | None = None,
        hashed: bool = True,
    ) -> StagedKeyframe:
        """A new folder of the cache for a keyframe of ``specs`` (files of ``file_bytes``),
        or of the ``blocks`` of its tensors (``specs`` then the blocks' shapes)."""
        return StagedKeyframe(self._new_folder(), specs, file_bytes, blocks=blocks, hashed=hashed)

    def advance(
        self,
        stored: StoredManifest,
        *,
        patch: Patch | None = None,
        staged: StagedKeyframe | None = None,
        changes: Mapping[str, BlockChanges] | None = None,
        parts: Mapping[str, int] | None = None,
    ) -> None:
        """Make ``stored``, just committed, the base: the folder ``staged`` was written to
        (a keyframe version), or its transition from the version held written into the
        maps, changed elements only: ``patch`` (whole tensors) or each block's
        ``changes`` (:meth:`diff`). ``parts``: each block's part of the new
        fingerprints (the fingerprints themselves when whole). The state names it last;
        its snapshot (and any older one) is let go."""
        with self._mutex:
            if staged is not None:
                self._stop_privatizing()  # the folder before's: it goes
                self._map(staged.folder.name)
                self.blocks = dict(staged.blocks)
            elif patch is not None and self._ckpt is not None and self.stored is not None:
                ckpt = self._writable()
                reached = apply(patch, {name: ckpt.bits(name) for name in ckpt}, self.fingerprints)
                if reached != dict(stored.manifest.fingerprints):  # pragma: no cover - the patch made them
                    raise InternalError(f"version {stored.version}: the base missed the fingerprints it committed")
            elif changes is not None and self._ckpt is not None and self.stored is not None:
                ckpt = self._writable()
                for name, change in changes.items():
                    put_bits(ckpt.bits(name).reshape(-1), change.local, change.now)
            else:
                raise InternalError(
                    f"version {stored.version} committed with neither a patch of the base nor a keyframe"
                )
            if self._folder is None:  # pragma: no cover - a version held is in a folder
                raise InternalError(f"version {stored.version} committed onto a base in no folder")
            if parts is None and not _whole(self.blocks, stored.manifest.specs):
                raise InternalError(f"version {stored.version}: blocks committed without their parts")
            self.parts = dict(parts) if parts is not None else dict(stored.manifest.fingerprints)
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
            whole = Block.whole(spec.shape)
            if not moved:
                return block_diff(spec, whole, below, bits, spec.dtype, fp, ranked=ranked).delta
            plain = Patch({name: block_diff(spec, whole, below, bits, spec.dtype, fp).delta})
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

    def device_changes(self, name: str, value: Any) -> BlockChanges | None:
        """The change of GPU block ``value`` (the block held of ``name``) from its committed
        bits, found on its device (which moves on to it: only the change crosses to the
        host), or None when the device holds nothing for it. Its part of the fingerprint
        change is hashed with the tensor's own indices here, from the old bits the host
        holds (O(changed)). The device's bits are the committed ones as long as every
        step keeps or diffs them (:meth:`device_only`) and a failure drops them
        (:meth:`reset`)."""
        if name not in self._device_fps:
            return None
        change = self._device.diff(name, value)
        if change is None:
            return None
        was = self.bits(name).reshape(-1)[change.indices]
        return block_changes(self.specs[name], self.blocks[name], change.indices, was, change.delta, self.parts[name])

    def device_only(self, names: set[str]) -> None:
        """Drop the device's bits of every tensor but ``names`` (those a step diffed or kept
        on their device): the others' are not the committed bits any more."""
        for name in [n for n in self._device_fps if n not in names]:
            self._device.drop(name)
            del self._device_fps[name]

    def reset(self) -> None:
        """After a failure (or at open): the next snapshot is of the version after the
        committed one and diffs against its bits; the snapshots taken since and the
        device's bits are dropped."""
        with self._mutex:
            self._taken = []
        self._device = DeviceKept(self._device.served_dtype)
        self._device_fps = {}
