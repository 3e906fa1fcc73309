"""An in-place engine with a replica folder as its durable copy (``--engine torch --local-dir``).

The engine's live tensors are what is served and what versions are applied to in place;
the folder, which no engine reads, takes every version too and is what a restart puts
back into the engine, bit for bit, without a download: :meth:`FolderBackedTarget.restored`
loads the folder's verified version into the engine (a process that runs its engine
itself, as ``--engine torch`` does, starts with random weights).

This is where the ``log`` layout (:class:`~bulletin.replica_log.LogDirTarget`) pays: the
engine holds the live bits, so the folder needs no loadable copy of each version, and a
version costs about its patch in disk writes. The dense layout works too.

Every change goes to the folder first and to the engine second; both verify it (the
folder against its own bits, the engine against its live ones), and their fingerprints
must agree before anything is activated. :meth:`~FolderBackedTarget.prepare` applies to
the folder (a log file written, nothing served changed) and has the engine precompute,
so that the sidecar's pause is the engine's writes alone. The folder commits first at
activation: a process killed after it restarts on the new version, restored from the
folder; killed before it, on the old one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from bulletin.errors import BulletinError, VerificationFailed
from bulletin.target import Held, LocalDirTarget, WeightTarget

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from bulletin.target import FetchFiles
    from patcher.context_decode import CodedChanges
    from patcher.format import TensorInfo
    from patcher.patch import Patch, TensorSpec
    from schemas.manifest import FileRef

    Bits = NDArray[np.unsignedinteger]

__all__ = ["FolderBackedTarget"]

log = logging.getLogger("bulletin.sidecar")


class FolderBackedTarget(WeightTarget):
    """``engine`` (an in-place target: live tensors) kept durable in ``folder``.

    ``restored()`` is the folder's verified version once the engine demonstrably holds
    it: loaded from the folder where this process has not loaded it yet (what the
    engine then holds is re-hashed and compared with the folder's record). A folder
    whose bits the engine cannot take (another model's layout) or that do not hash to
    its record restores nothing: a keyframe route rebuilds both.
    """

    in_place = True

    def __init__(self, engine: WeightTarget, folder: LocalDirTarget) -> None:
        self.engine = engine
        self.folder = folder
        self.restores_loads = engine.restores_loads
        #: The version the engine was shown to hold, by this process (None: not yet).
        self._held: Held | None = None
        #: A patch applied to the folder by :meth:`prepare`: it, its base, the result.
        self._prepared: tuple[Patch, dict[str, int], dict[str, int]] | None = None

    def layout(self) -> Mapping[str, TensorSpec] | None:
        return self.engine.layout()

    def restored(self) -> Held | None:
        held = self.folder.restored()
        if held is None:
            return None
        if held == self._held:
            return held
        specs, bits = self.folder.layout(), self.folder.context_bits()
        if specs is None or bits is None:
            return None
        try:
            self.engine.load_full(bits, specs)
            found = self.engine.full_fingerprints()
            if found != held.fingerprints:
                bad = sorted(
                    n for n in found.keys() | held.fingerprints.keys() if found.get(n) != held.fingerprints.get(n)
                )
                raise VerificationFailed(f"{len(bad)} tensor(s) do not hash to the folder's record: {bad[:3]}")
            self.engine.activate(held.version, manifest_digest=held.manifest_digest)
        except BulletinError as exc:
            self.engine.abort()
            log.warning(
                "%s: version %d cannot be restored into the engine (%s); a keyframe route loads it",
                self.folder.dir,
                held.version,
                exc,
            )
            return None
        log.info("%s: version %d restored into the engine from the folder", self.folder.dir, held.version)
        self._held = held
        return held

    def load_full(self, tensors: Mapping[str, Bits], specs: Mapping[str, TensorSpec]) -> None:
        self._drop_prepared()
        self._held = None
        self.folder.load_full(tensors, specs)  # a new folder: the version held stays until activation
        try:
            self.engine.load_full(tensors, specs)
        except BaseException:
            self.folder.abort()
            raise

    def _drop_prepared(self) -> None:
        if self._prepared is not None:
            self._prepared = None
            self.folder.abort()

    def prepare(self, patch: Patch, fingerprints: Mapping[str, int]) -> None:
        """The folder applies ``patch`` (nothing served changes), the engine precomputes."""
        self._drop_prepared()
        self.engine.prepare(patch, fingerprints)
        new = self.folder.apply(patch, fingerprints)
        self._prepared = (patch, dict(fingerprints), new)

    def apply(self, patch: Patch, fingerprints: Mapping[str, int]) -> dict[str, int]:
        prepared, self._prepared = self._prepared, None
        if prepared is not None and (prepared[0] is not patch or prepared[1] != dict(fingerprints)):
            self.folder.abort()  # prepared for another patch
            prepared = None
        folder = prepared[2] if prepared is not None else self.folder.apply(patch, fingerprints)
        try:
            new = self.engine.apply(patch, fingerprints)
            if any(folder.get(name) != fp for name, fp in new.items()):
                raise VerificationFailed("the engine and its folder landed on different bits")
        except BaseException:
            self.engine.abort()
            self.folder.abort()
            raise
        return new

    def stage_files(self, files: Sequence[FileRef], fetch: FetchFiles) -> None:
        self.folder.stage_files(files, fetch)

    def abort(self) -> None:
        self._prepared = None
        self.engine.abort()
        self.folder.abort()

    def full_fingerprints(self) -> dict[str, int]:
        return self.engine.full_fingerprints()  # what is served

    def context_bits(self) -> Mapping[str, Bits] | None:
        return self.engine.context_bits()

    @property
    def resolves_context(self) -> bool:
        return self.engine.resolves_context

    def resolve_context(
        self,
        changes: Sequence[CodedChanges],
        tensors: Mapping[str, TensorInfo],
        fingerprints: Mapping[str, int],
        *,
        pending: Patch | None = None,
    ) -> Patch:
        return self.engine.resolve_context(changes, tensors, fingerprints, pending=pending)

    def activate(self, version: int, *, manifest_digest: str | None = None) -> None:
        """The folder commits first (durable), then the engine."""
        self._prepared = None
        self.folder.activate(version, manifest_digest=manifest_digest)
        self.engine.activate(version, manifest_digest=manifest_digest)
        held = self.folder.restored()
        self._held = held if held is not None and held.version == version else None

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            self.folder.close()
