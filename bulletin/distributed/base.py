"""A rank's part of the base of the next diff: the committed bits of the blocks it owns.

The sharded twin of :class:`~bulletin.base.PublishedBase`: the last committed version
(number, layout, every tensor's fingerprint; rank 0 also its manifest) and, for each
block this rank owns, its served bits (2 bytes per BF16 element of the block, the
rank's whole share of the model's kept bits). It moves only when a version is known
committed on every rank (:meth:`advance`, after the commit's outcome was broadcast),
so a step that failed anywhere leaves every rank at the version committed before.

Rebuilt from the run (:meth:`rebuild`) reading only what this rank needs: the keyframe
files that hold its tensors (each streamed to a temporary file, SHA-256 verified, its
blocks copied out, the file removed) and the patches after it (O(changed)), each
block's part of every fingerprint checked against the manifest's sum over all ranks.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from bulletin.checkpoint import INDEX_NAME, Checkpoint
from bulletin.distributed.parts import Block, Layout, local_indices
from bulletin.errors import FingerprintMismatch, FormatError, InternalError
from bulletin.run import Run, StoredManifest
from bulletin.sync import plan
from patcher.apply import put_bits
from patcher.decode import decode
from patcher.patch import TensorSpec

__all__ = ["PartBase", "block_slices"]

_MASK64 = (1 << 64) - 1


def block_slices(block: Block) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(block.offsets, block.sizes, strict=True))


class PartBase:
    """The committed version and this rank's owned blocks of it."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.digest: str | None = None
        self.stored: StoredManifest | None = None  # the manifest itself (every rank holds it: O(manifest))
        self.specs: dict[str, TensorSpec] = {}
        self.fingerprints: dict[str, int] = {}
        self.kept: dict[str, NDArray[np.unsignedinteger]] = {}
        #: The owners of every block when the kept blocks were made: the same on every rank.
        self.owners: dict[str, list[tuple[int, Block]]] = {}

    def holds(self, layout: Layout) -> bool:
        """Whether every rank keeps the blocks it owns in ``layout``: the same answer on
        every rank (each compares the job's layouts, not only its own blocks), so that
        a change of placement on any rank makes the next version a keyframe everywhere."""
        return bool(self.owners) and self.specs == layout.specs and self.owners == layout.owners

    def advance(
        self,
        stored: StoredManifest,
        changes: Mapping[str, tuple[NDArray[np.int64], NDArray[np.unsignedinteger]]] | None,
        kept: dict[str, NDArray[np.unsignedinteger]] | None,
        layout: Layout,
    ) -> None:
        """``stored`` is committed: this rank's blocks of ``layout`` take ``changes``
        (local flat indices and the bits there now: a patch version) or become ``kept``
        (a keyframe)."""
        if kept is not None:
            self.kept = kept
        elif changes is not None:
            for name, (idx, now) in changes.items():
                put_bits(self.kept[name].reshape(-1), idx, now)
        else:  # pragma: no cover - callers pass one
            raise InternalError(f"version {stored.version} committed with neither changes nor bits")
        self._hold(stored)
        self.owners = layout.owners

    def _hold(self, stored: StoredManifest | None) -> None:
        self.stored = stored
        self.version = stored.version if stored else None
        self.digest = stored.digest if stored else None
        self.specs = dict(stored.manifest.specs) if stored else {}
        self.fingerprints = dict(stored.manifest.fingerprints) if stored else {}

    def forget(self, tip: StoredManifest | None) -> None:
        """Hold ``tip`` without bits (the next version is a keyframe: a new layout)."""
        self._hold(tip)
        self.kept, self.owners = {}, {}

    def load(self, run: Run, tip: StoredManifest, owned: Mapping[str, Block]) -> dict[str, NDArray[np.unsignedinteger]]:
        """``tip``'s bits of the ``owned`` blocks, from the run: the keyframe's files that
        hold them, then the patches after it (each decoded whole: O(changed))."""
        route = plan(run, tip, None)
        keyframe = route.keyframe
        if keyframe is None or keyframe.manifest.keyframe is None:  # pragma: no cover - plan starts at one
            raise InternalError(f"{run.name}: no keyframe under version {tip.version}")
        kept = _from_keyframe(run, keyframe, owned)
        for step in route.patches:
            ref = step.manifest.patch
            if ref is None:  # pragma: no cover - plan routes through patches
                raise InternalError(f"version {step.version} has no patch")
            patch = decode(run.download(ref.shards), specs=step.manifest.specs)
            for name, block in owned.items():
                td = patch.tensors[name]
                inside, local = local_indices(block, td.indices)
                flat = kept[name].reshape(-1)
                flat[local] += td.delta[inside]
        return kept

    def hold(
        self,
        tip: StoredManifest,
        kept: dict[str, NDArray[np.unsignedinteger]],
        layout: Layout,
        sums: Mapping[str, int],
    ) -> None:
        """Hold ``tip`` with the ``kept`` blocks :meth:`load` gave for this rank's blocks
        of ``layout``, once the fingerprints summed over every rank's blocks
        (``sums``) are the manifest's."""
        wrong = sorted(name for name in tip.manifest.specs if sums.get(name) != tip.manifest.fingerprints[name])
        if wrong:
            raise FingerprintMismatch(
                f"version {tip.version} rebuilt from the run misses the fingerprints of {', '.join(wrong[:3])}"
            )
        self.kept = kept
        self.owners = layout.owners
        self._hold(tip)


def _from_keyframe(
    run: Run, stored: StoredManifest, owned: Mapping[str, Block]
) -> dict[str, NDArray[np.unsignedinteger]]:
    """Copies of the ``owned`` blocks from ``stored``'s keyframe: only the files that hold
    them are downloaded, one at a time, to a temporary folder."""
    ref = stored.manifest.keyframe
    assert ref is not None
    by_name = {obj.key.rsplit("/", 1)[-1]: obj for obj in ref.files}
    kept: dict[str, NDArray[np.unsignedinteger]] = {}
    scratch = Path(tempfile.mkdtemp(prefix="bulletin-part-"))
    try:
        weight_map: dict[str, str] = {}
        if INDEX_NAME in by_name:
            import json

            obj = by_name[INDEX_NAME]
            run.store.get_to_file(run.key(obj.key), scratch / INDEX_NAME, sha256=obj.sha256, max_bytes=obj.size)
            raw: Any = json.loads((scratch / INDEX_NAME).read_bytes()).get("weight_map", {})
            weight_map = {str(k): str(v) for k, v in raw.items()}
        files: dict[str, list[str]] = {}
        for name in owned:
            file = weight_map.get(name, next(iter(by_name)) if len(by_name) == 1 else "")
            if file not in by_name or file.startswith(".") or not file.endswith(".safetensors"):
                raise FormatError(f"version {stored.version}: the keyframe has no file for {name!r}")
            files.setdefault(file, []).append(name)
        for file, names in sorted(files.items()):
            obj = by_name[file]
            path = scratch / file
            run.store.get_to_file(run.key(obj.key), path, sha256=obj.sha256, max_bytes=obj.size)
            with Checkpoint(path) as ckpt:
                for name in names:
                    if ckpt.specs.get(name) != stored.manifest.specs[name]:
                        raise FormatError(f"version {stored.version}: keyframe tensor {name!r} is not its manifest's")
                    kept[name] = np.array(ckpt.bits(name)[block_slices(owned[name])], copy=True)
            path.unlink()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return kept
