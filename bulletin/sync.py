"""Bringing a target from the version it holds to another one.

Planning reads manifests only (down the hash chain from the target, each checked
against its child's digest before it is parsed, only as far as a route needs);
executing downloads what the plan needs, checks every byte (sizes and SHA-256 against
the manifests, every shard header against its manifest and the layout held before any
payload is decoded, the format), decodes and folds the transitions, and only then
touches the target. ``run`` is what the manifests and objects are read from: one
:class:`~bulletin.run.Run`, or several stores holding copies of the run
(:class:`~bulletin.sources.Sources`, the same reads with fallback). The target
checks base fingerprints, applies in place and verifies the result; the version
becomes current only when it matches the manifest's fingerprints exactly. The
version's model files (FORMAT.md 5.1) are staged on the target just before it is
activated (:meth:`~bulletin.target.WeightTarget.stage_files`), which downloads, checked,
only those it lacks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from bulletin.checkpoint import INDEX_NAME, Checkpoint
from bulletin.errors import (
    ChainMismatch,
    FingerprintMismatch,
    FormatError,
    IncompatibleTensors,
    InternalError,
    NotFound,
    RunRewound,
    VersionNotFound,
    WrongBase,
)
from bulletin.run import StoredManifest
from bulletin.sources import Reader
from bulletin.target import Held, WeightTarget, WriteKeyframe
from patcher.compression import CONTEXT_CODEC
from patcher.context_decode import decode_changes
from patcher.decode import decode_views, shard_views
from patcher.fingerprint import fingerprint, format_fingerprint
from patcher.fold import fold
from patcher.format import DEFAULT_LIMITS, ShardHeader, TensorInfo
from patcher.patch import Patch, TensorDelta, TensorSpec, check_layout
from schemas.manifest import FileRef, ObjectRef, PatchRefV2, manifest_files

__all__ = ["SyncPlan", "SyncReport", "check_chain", "execute", "plan"]

log = logging.getLogger("bulletin.sync")


@dataclass(frozen=True, slots=True)
class SyncPlan:
    """A keyframe to load (or None) and the transitions to apply after it, in order."""

    target: StoredManifest
    keyframe: StoredManifest | None
    patches: tuple[StoredManifest, ...]

    @property
    def download_bytes(self) -> int:
        kf = self.keyframe.manifest.stats.keyframe_bytes if self.keyframe else 0
        return kf + sum(p.manifest.stats.patch_bytes for p in self.patches)


@dataclass(slots=True)
class SyncReport:
    """What a sync did, for logs, metrics and the CLI's ``--json``."""

    from_version: int | None
    to_version: int
    keyframe: int | None = None
    transitions: int = 0
    bytes_downloaded: int = 0
    changed_elements: int = 0
    download_s: float = 0.0
    decode_s: float = 0.0
    apply_s: float = 0.0
    files_downloaded: int = 0
    """Model files downloaded (the target lacked them); their bytes count in ``bytes_downloaded``."""


def check_chain(run: Reader, held: Held, target: StoredManifest, *, tip: bool) -> None:
    """Refuse a run that no longer continues ``held``: no silent downgrade or chain switch.

    ``target`` is the version a sync is about to reach, ``tip`` whether it is the run's
    newest. ``RunRewound`` when the newest version is older than ``held``; ``ChainMismatch``
    when the manifest of ``held.version`` is gone while older ones remain, or is not the
    one held (its digest, or for a ``Held`` without one its fingerprints): the run was
    rolled back, rewritten or replaced. A held version below every manifest left in the
    bucket (garbage collected) cannot be checked and is let through. An older ``target``
    on the same chain, asked for explicitly, is not refused (a chosen downgrade).
    """
    where = f"{run.name}: version {held.version} held here"
    if tip and target.version < held.version:
        raise RunRewound(f"{where}, but the run's newest version is {target.version}: the run was rolled back")
    if held.manifest_digest is not None and target.manifest.parent_version == held.version:
        # One version behind (the steady state): the target's link says it all, no read.
        if target.manifest.parent_digest != held.manifest_digest:
            raise ChainMismatch(
                f"{where} came from manifest {held.manifest_digest[:16]}..., but version {target.version} "
                "chains to another one: the run was rewritten or replaced"
            )
        return
    if target.version == held.version:
        stored = target
    else:
        try:
            stored = run.read_manifest(held.version, known_digest=held.manifest_digest)
        except VersionNotFound:
            versions = run.versions()
            if not versions or versions[-1] < held.version:
                newest = versions[-1] if versions else "none"
                raise RunRewound(
                    f"{where}, but the run's newest version is {newest}: the run was rolled back"
                ) from None
            if versions[0] > held.version:
                return  # garbage-collected below the oldest version kept: nothing to check against
            raise ChainMismatch(
                f"{where} is gone from the run's chain, which still has versions {versions[0]}..{versions[-1]}: "
                "the run was rewritten"
            ) from None
    if held.manifest_digest is not None:
        if stored.digest != held.manifest_digest:
            raise ChainMismatch(
                f"{where} came from manifest {held.manifest_digest[:16]}..., the run's is now {stored.digest[:16]}...: "
                "the run was rewritten or replaced"
            )
    elif stored.manifest.fingerprints != held.fingerprints:
        raise ChainMismatch(f"{where} holds other bits than the run's version {held.version}: the run was replaced")


def _cheapest(target: StoredManifest, steps: Sequence[StoredManifest]) -> SyncPlan:
    """The cheaper of the two routes through ``steps`` (ascending, ending at ``target``):
    every patch (from the last version without one, when there is such a layout change),
    or the newest keyframe after that and the patches after it."""
    start = max((i for i, s in enumerate(steps) if s.manifest.patch is None), default=-1)
    patch_route = SyncPlan(target, steps[start] if start >= 0 else None, tuple(steps[start + 1 :]))
    keyframes = [i for i, s in enumerate(steps) if s.manifest.keyframe is not None and i > start]
    if keyframes:
        k = keyframes[-1]
        kf_route = SyncPlan(target, steps[k], tuple(steps[k + 1 :]))
        if kf_route.download_bytes < patch_route.download_bytes:
            return kf_route
    return patch_route


def _from_keyframe(target: StoredManifest, chain: Sequence[StoredManifest], k: int) -> SyncPlan:
    """Load ``chain[k]``'s keyframe, then apply the versions above it (``chain`` is newest first)."""
    return SyncPlan(target, chain[k], tuple(reversed(chain[:k])))


def plan(run: Reader, target: StoredManifest, held: Held | None) -> SyncPlan:
    """Choose the cheapest verified route from ``held`` to ``target``.

    Manifests are read down the chain from ``target`` (:meth:`Run.ancestors`: each one
    checked against the digest its child names before it is parsed, a few at a time),
    and only as far as a route can need: down to ``held``, to a version without a patch,
    or, once the newest keyframe is known, until the patches at and below it outweigh
    it (its route is then the cheaper whatever lies further down). Without a usable
    ``held``, down to the newest keyframe.
    """
    if held is not None and held.version == target.version:
        return SyncPlan(target, None, ())
    from_held = held is not None and held.version < target.version
    chain = [target]  # newest first
    kf: int | None = None  # where in ``chain`` the newest keyframe is
    outweighing = 0  # patch bytes at and below chain[kf]: what its keyframe would replace
    ancestors = run.ancestors(target, floor=held.version if held is not None and from_held else 1)
    reached_held = False
    stored: StoredManifest | None = target
    while stored is not None:
        if from_held and held is not None and stored.version == held.version:
            reached_held = True
            break
        if kf is None and stored.manifest.keyframe is not None:
            kf = len(chain) - 1
            if not from_held:
                return _from_keyframe(target, chain, kf)
        if kf is not None:
            outweighing += stored.manifest.stats.patch_bytes
            if chain[kf].manifest.stats.keyframe_bytes < outweighing:
                return _from_keyframe(target, chain, kf)
        if stored.manifest.patch is None:  # a layout change: no route goes below it
            return _cheapest(target, chain[::-1])
        stored = next(ancestors, None)
        if stored is not None:
            chain.append(stored)
    if reached_held and held is not None and chain[-1].manifest.fingerprints == held.fingerprints:
        return _cheapest(target, chain[-2::-1])  # every version after the one held
    if kf is not None:
        return _from_keyframe(target, chain, kf)
    if reached_held:
        # The bits held are not that version's: the route needs a keyframe, there or below.
        below = run.ancestors(chain[-1], floor=1)
        while stored is not None:
            if stored.manifest.keyframe is not None:
                return _from_keyframe(target, chain, len(chain) - 1)
            stored = next(below, None)
            if stored is not None:
                chain.append(stored)
    raise VersionNotFound(f"{run.name}: no keyframe at or below version {target.version} is left in the bucket")


def _keyframe_names(stored: StoredManifest) -> list[tuple[ObjectRef, str]]:
    """The keyframe's objects and the file name each takes in a model folder (its key's
    last part: ``model.safetensors``, ``model-0000i-of-0000n.safetensors``, the index)."""
    ref = stored.manifest.keyframe
    if ref is None:
        raise InternalError(f"version {stored.version} has no keyframe, yet a route was planned through it")
    out: list[tuple[ObjectRef, str]] = []
    for f in ref.files:
        name = f.key.rpartition("/")[2]
        if not f.key.startswith(ref.prefix.rstrip("/") + "/") or not _is_keyframe_file(name):
            raise FormatError(f"version {stored.version}: keyframe object {f.key!r} is not a checkpoint file")
        out.append((f, name))
    if len({name for _, name in out}) != len(out):
        raise FormatError(f"version {stored.version}: keyframe files have one name twice")
    return out


def _is_keyframe_file(name: str) -> bool:
    return not name.startswith(".") and (name.endswith(".safetensors") or name == INDEX_NAME)


def _verified_keyframe(folder: Path, stored: StoredManifest, names: Sequence[str]) -> Checkpoint:
    """The keyframe streamed into ``folder``, memory-mapped read-only: exactly the manifest's
    tensors (as the folder's index, if any, maps them: what an engine loads), each one's
    fingerprint computed once, from the maps, and checked."""
    where = f"version {stored.version}"
    try:
        ckpt = Checkpoint(folder)
    except NotFound as exc:
        raise FormatError(f"{where}: keyframe files do not form a checkpoint: {exc}") from exc
    try:
        specs = stored.manifest.specs
        if ckpt.specs != dict(specs) or {p.name for p in ckpt.files} != {n for n in names if n != INDEX_NAME}:
            raise FormatError(f"{where}: keyframe files do not hold exactly the manifest's tensors")
        expected = stored.manifest.fingerprints
        for name in specs:
            if fingerprint(ckpt.bits(name)) != expected[name]:
                raise FingerprintMismatch(f"{where}: keyframe tensor {name!r} fails its fingerprint")
    except BaseException:
        ckpt.close()
        raise
    return ckpt


def _keyframe_writer(
    run: Reader,
    stored: StoredManifest,
    report: SyncReport,
    on_bytes: Callable[[int], None] | None,
    *,
    keep_bits: dict[str, NDArray[np.unsignedinteger]] | None = None,
) -> WriteKeyframe:
    """What :meth:`WeightTarget.load_keyframe` calls: stream every keyframe file into the
    folder given (:meth:`Run.download_file`: in bounded memory, each checked against its
    size and SHA-256 as it arrives), then check the tensors (:func:`_verified_keyframe`).
    ``keep_bits`` receives read-only views of them, which outlive the folder (file pages,
    kept mapped): the base for decoding context-coded patches on a target with no bits
    of its own to show."""
    files = _keyframe_names(stored)

    def write(folder: Path) -> Checkpoint:
        t0 = time.perf_counter()
        for ref, name in files:
            run.download_file(ref, folder / name, on_bytes)
            report.bytes_downloaded += ref.size
        report.download_s += time.perf_counter() - t0
        ckpt = _verified_keyframe(folder, stored, [name for _, name in files])
        if keep_bits is not None:
            keep_bits.update({name: ckpt.bits(name) for name in ckpt.specs})
        return ckpt

    return write


def _check_transition(
    stored: StoredManifest,
    parent_fps: Mapping[str, int],
    infos: Mapping[str, TensorInfo],
    headers: Sequence[ShardHeader],
) -> None:
    """The patch's headers describe the manifest's transition: its layout (so every size they
    declare is bounded by the real tensors), from the parent's fingerprints to its own, with
    as many changes as it says. Checked before any payload is decompressed."""
    manifest = stored.manifest
    described = {name: info.spec for name, info in infos.items()}
    if described != dict(manifest.specs):
        listed = manifest.specs
        other = sorted(n for n in described.keys() & listed.keys() if described[n] != listed[n])
        raise FormatError(
            f"version {stored.version}: the patch's headers do not describe the manifest's tensors "
            f"(not in the manifest: {sorted(described.keys() - listed.keys())[:3]}, "
            f"left out: {sorted(listed.keys() - described.keys())[:3]}, another dtype or shape: {other[:3]})"
        )
    target_fps = manifest.fingerprints
    for name, info in infos.items():
        if info.base_fingerprint != parent_fps.get(name) or info.target_fingerprint != target_fps[name]:
            raise FingerprintMismatch(
                f"version {stored.version}: patch of {name!r} does not match the manifests' fingerprints"
            )
    codecs = {h.codec for h in headers}
    if manifest.patch is not None and codecs != {manifest.patch.codec}:
        raise FormatError(
            f"version {stored.version}: the patch's shards are coded with {sorted(codecs)}, "
            f"its manifest says {manifest.patch.codec}"
        )
    changed = sum(info.changed for info in infos.values())
    if manifest.patch is not None and changed != manifest.patch.changed_elements:
        raise FormatError(
            f"version {stored.version}: the patch's headers count {changed} changed elements, "
            f"its manifest {manifest.patch.changed_elements}"
        )


def _context_coded(steps: Sequence[StoredManifest]) -> bool:
    """Whether any of these versions' patches decodes against its base (FORMAT.md 3.15)."""
    return any(isinstance(step.manifest.patch, PatchRefV2) and step.manifest.patch.context for step in steps)


#: Decoded changes (indices and deltas) of transitions held before they are folded into
#: the route's running fold: with the fold itself and the compressed shards, the whole
#: working set of a catch-up, however many versions behind.
FOLD_BATCH_BYTES = 16 << 20

#: A catch-up goes in rounds of at most this share of the model's dense size in decoded
#: changes (see :func:`_rounds`); each round ends on an exact version, activated.
ROUND_SHARE = 0.05

#: One transition of a route, checked: its shards' views, headers and tensors.
_Checked = tuple[list[memoryview], list[ShardHeader], dict[str, TensorInfo]]


def _owned(patch: Patch) -> Patch:
    """``patch`` with arrays of its own: a fold passes through the arrays of a tensor that
    only one of its inputs changes, which are views into that input's decode arena (every
    tensor of it), and would keep the whole arena alive."""
    out: dict[str, TensorDelta] = {}
    for name, td in patch.tensors.items():
        shared = td.indices.base is not None or td.delta.base is not None
        out[name] = replace(td, indices=td.indices.copy(), delta=td.delta.copy()) if shared else td
    return Patch(out)


def _decoded_bytes(patch: Patch) -> int:
    return sum(td.indices.nbytes + td.delta.nbytes for td in patch)


def _decode_route(
    checked: list[_Checked | None],
    context: Mapping[str, NDArray[np.unsignedinteger]] | None,
    held_fps: Mapping[str, int],
    resolver: WeightTarget | None = None,
    *,
    batch_bytes: int | None = None,
) -> Patch:
    """The transitions of a route, decoded and folded into one patch, in a bounded working
    set: each transition is decoded in turn and its shards dropped (``checked[i]`` is set
    to None), and the decoded ones are folded into the running fold whenever they pass
    ``batch_bytes`` (:data:`FOLD_BATCH_BYTES` by default), tensor by tensor, so that what
    is held is the fold so far (at most the union of the changes), one batch and one
    tensor's merge, not every version's changes (:func:`_rounds` bounds the fold).

    A context-coded transition decodes against ``context`` (the bits held, whose record is
    ``held_fps``) read through the fold of the transitions before it, which are not
    applied yet; or, with a ``resolver`` (a target that
    :attr:`~WeightTarget.resolves_context`), is entropy-decoded here and resolved by the
    target against the bits where it holds them."""
    bound = FOLD_BATCH_BYTES if batch_bytes is None else batch_bytes
    folded: Patch | None = None
    pending: list[Patch] = []
    pending_bytes = 0

    def fold_pending() -> None:
        nonlocal folded, pending_bytes
        parts = [folded, *pending] if folded is not None else list(pending)
        pending.clear()
        pending_bytes = 0
        folded = _owned(fold(parts)) if len(parts) > 1 else parts[0]

    for i, item in enumerate(checked):
        if item is None:
            raise InternalError("a transition of the route was decoded twice")
        checked[i] = None  # its shards go once decoded
        views, headers, infos = item
        del item
        coded = any(h.codec == CONTEXT_CODEC for h in headers)
        if pending and coded:
            fold_pending()  # it decodes against everything before it, folded
        if resolver is not None and coded and all(h.codec == CONTEXT_CODEC for h in headers):
            changes = [c for view, header in zip(views, headers, strict=True) for c in decode_changes(view, header)]
            step = resolver.resolve_context(changes, infos, held_fps, pending=folded)
        else:
            step = decode_views(views, headers, infos, base=context, base_fingerprints=held_fps, pending=folded)
        del views, headers, infos
        pending.append(step)
        pending_bytes += _decoded_bytes(step)
        if pending_bytes > bound:
            fold_pending()
    if pending:
        fold_pending()
    if folded is None:
        raise InternalError("a patch route without a transition")
    return folded


def _check_held_layout(step: StoredManifest, layout: Mapping[str, TensorSpec] | None) -> None:
    """A patched version lists the tensors of the version before it, which the target holds."""
    if layout is not None and dict(step.manifest.specs) != dict(layout):
        check_layout(step.manifest.specs, layout)  # says which tensor differs
        raise IncompatibleTensors(f"version {step.version}: the manifest's tensors are not the ones held")


def _stage_files(
    run: Reader,
    stored: StoredManifest,
    target: WeightTarget,
    report: SyncReport,
    on_bytes: Callable[[int], None] | None,
) -> None:
    """Hand the target the model files of ``stored``'s version; what it fetches is
    downloaded checked (sizes and SHA-256 against the manifest) and counted."""

    def fetch(refs: Sequence[FileRef]) -> list[bytes]:
        t0 = time.perf_counter()
        blobs = run.download(refs, on_bytes)
        report.download_s += time.perf_counter() - t0
        report.bytes_downloaded += sum(len(b) for b in blobs)
        report.files_downloaded += len(blobs)
        return blobs

    target.stage_files(manifest_files(stored.manifest), fetch)


def _apply_and_activate(
    target: WeightTarget,
    stored: StoredManifest,
    apply: Callable[[], dict[str, int]],
    stage_files: Callable[[], None],
) -> None:
    """Apply, check the result against the manifest, stage the version's model files,
    activate; put the target back on failure."""
    try:
        new_fps = apply()
        expected = stored.manifest.fingerprints
        if new_fps != expected:
            bad = sorted(n for n in expected if new_fps.get(n) != expected[n])[:3]
            raise WrongBase(
                f"version {stored.version}: bits after apply do not match the manifest "
                f"({', '.join(bad)}; got {[format_fingerprint(new_fps.get(n, 0)) for n in bad]})"
            )
        stage_files()
        target.activate(stored.version, manifest_digest=stored.digest)
    except BaseException:
        target.abort()  # put back what the target held before
        raise


def execute(
    run: Reader,
    sync_plan: SyncPlan,
    target: WeightTarget,
    held: Held | None,
    *,
    on_bytes: Callable[[int], None] | None = None,
    on_activate: Callable[[StoredManifest], None] | None = None,
    on_lost: Callable[[], None] | None = None,
    scratch_dir: Path | None = None,
) -> SyncReport:
    """Carry out a plan. On failure the target keeps a verified version (see below).

    A keyframe is verified in full before it replaces anything and is activated at
    once, so a later failure leaves the node on that keyframe's version, which is
    older than asked but exact. Patches are verified (digests, format, fingerprint
    chain against the manifests) before the target sees them; the target restores
    its bits if the apply does not land on the manifest's fingerprints. A keyframe load
    that fails on a target that cannot restore loads (``restores_loads`` false) calls
    ``on_lost``: ``held`` is no longer what the target holds, and must not be reported.

    A keyframe is streamed from the store to files (:meth:`WeightTarget.load_keyframe`:
    into the target's own folder, or a temp folder under ``scratch_dir`` whose memory
    maps feed :meth:`~WeightTarget.load_full`), never held in memory, and each tensor is
    fingerprinted once. Patches are decoded and folded in a bounded working set
    (:func:`_decode_route`), in rounds (:func:`_rounds`) when many versions are due: each
    round lands on an exact version and is activated (``on_activate``) before the next
    one is downloaded, so a failure in a later round leaves the node on an earlier one.
    """
    if (
        sync_plan.keyframe is None
        and held is not None
        and _context_coded(sync_plan.patches)
        and not target.resolves_context
        and target.context_bits() is None
    ):
        # The patches decode against the bits held, which this target cannot show: start
        # from a keyframe instead, whose bits this sync downloads and decodes them against.
        log.warning(
            "%s: %s cannot show its bits to decode context-coded patches against; syncing from a keyframe",
            run.name,
            type(target).__name__,
        )
        sync_plan = plan(run, sync_plan.target, None)
    report = SyncReport(held.version if held else None, sync_plan.target.version)
    current = held
    keyframe_bits: dict[str, NDArray[np.unsignedinteger]] | None = None
    if sync_plan.keyframe is not None:
        kf = sync_plan.keyframe
        if _context_coded(sync_plan.patches) and not target.resolves_context:
            keyframe_bits = {}  # the base to decode against, should the target show none
        verified = False
        written = _keyframe_writer(run, kf, report, on_bytes, keep_bits=keyframe_bits)

        def write(folder: Path) -> Checkpoint:
            nonlocal verified
            ckpt = written(folder)
            verified = True  # from here on the target may change
            return ckpt

        t1 = time.perf_counter()
        try:
            target.load_keyframe(write, kf.manifest.fingerprints, scratch_dir=scratch_dir)
            _stage_files(run, kf, target, report, on_bytes)
            target.activate(kf.version, manifest_digest=kf.digest)
        except BaseException:
            target.abort()
            if verified and not target.restores_loads and on_lost is not None:
                on_lost()
            raise
        report.apply_s += time.perf_counter() - t1 - report.download_s
        report.keyframe = kf.version
        current = Held.at(kf)
        if on_activate is not None:
            on_activate(kf)
    if not sync_plan.patches:
        return report
    if current is None:
        raise InternalError("a patch route needs a held version or a keyframe")
    layout = target.layout()
    for step in sync_plan.patches:
        _check_held_layout(step, layout)
        if step.manifest.patch is None:
            raise InternalError(f"version {step.version} has no patch, yet a route was planned through it")
    # Without bits of its own to show, a target decodes context-coded patches against the
    # keyframe just loaded, which only the first round starts from: one round then.
    whole = keyframe_bits is not None and not target.resolves_context and target.context_bits() is None
    rounds = [sync_plan.patches] if whole else _rounds(sync_plan.patches)
    for patches in rounds:
        _apply_round(run, patches, target, current, report, on_bytes, keyframe_bits)
        current = Held.at(patches[-1])
        keyframe_bits = None
        if on_activate is not None:
            on_activate(patches[-1])
    return report


def _decoded_bound(step: StoredManifest) -> int:
    """The most bytes the decoded changes of ``step``'s patch take (int64 indices, deltas)."""
    width = max((spec.width for spec in step.manifest.specs.values()), default=1)
    changed = step.manifest.patch.changed_elements if step.manifest.patch is not None else 0
    return changed * (8 + width)


def _rounds(patches: Sequence[StoredManifest]) -> list[Sequence[StoredManifest]]:
    """``patches`` cut into consecutive rounds whose decoded changes stay under
    :data:`ROUND_SHARE` of the model's dense size (or :data:`FOLD_BATCH_BYTES`, whichever
    is more): a round is downloaded, folded, applied and activated before the next one
    is downloaded, so that a node far behind holds one round's changes, not every one's."""
    out: list[Sequence[StoredManifest]] = []
    first, total = 0, 0
    for i, step in enumerate(patches):
        bound = max(FOLD_BATCH_BYTES, ROUND_SHARE * step.manifest.stats.total_bytes)
        size = _decoded_bound(step)
        if i > first and total + size > bound:
            out.append(patches[first:i])
            first, total = i, 0
        total += size
    out.append(patches[first:])
    return out


def _apply_round(
    run: Reader,
    patches: Sequence[StoredManifest],
    target: WeightTarget,
    current: Held,
    report: SyncReport,
    on_bytes: Callable[[int], None] | None,
    keyframe_bits: Mapping[str, NDArray[np.unsignedinteger]] | None,
) -> None:
    """Download, check, decode and fold ``patches`` (consecutive, the first one patching
    ``current``), apply them in one go and activate the last one's version."""
    t0 = time.perf_counter()
    refs = [ref for step in patches for ref in (step.manifest.patch.shards if step.manifest.patch else ())]
    blobs = run.download(refs, on_bytes)
    report.download_s += time.perf_counter() - t0
    report.bytes_downloaded += sum(len(b) for b in blobs)
    t1 = time.perf_counter()
    held_fps = current.fingerprints
    reached = patches[-1]

    def stage() -> None:
        _stage_files(run, reached, target, report, on_bytes)

    counts = [len(step.manifest.patch.shards) if step.manifest.patch else 0 for step in patches]
    # Every transition's headers are read and checked against its manifest before any
    # payload is decompressed: nothing is sized by a header the manifests do not back.
    checked: list[_Checked | None] = []
    position = 0
    parent_fps: Mapping[str, int] = held_fps
    for step, count in zip(patches, counts, strict=True):
        views, headers, infos = shard_views(blobs[position : position + count], DEFAULT_LIMITS)
        _check_transition(step, parent_fps, infos, headers)
        checked.append((views, headers, infos))
        position += count
        parent_fps = step.manifest.fingerprints
    report.transitions += len(patches)
    if len(patches) == 1 and target.supports_shards:
        # One version behind (the steady state): the target applies straight from the
        # shards, which decode as they are applied (patcher.apply_shards).
        infos = checked[0][2] if checked[0] is not None else {}
        report.decode_s += time.perf_counter() - t1
        report.changed_elements += sum(info.changed for info in infos.values())
        t2 = time.perf_counter()
        _apply_and_activate(target, reached, lambda: target.apply_shards(blobs, held_fps), stage)
    else:
        del blobs  # each transition's shards go once it is decoded (the views hold them)
        resolver = target if target.resolves_context else None
        context = None if resolver is not None else target.context_bits() or keyframe_bits
        folded = _decode_route(checked, context, held_fps, resolver)
        report.decode_s += time.perf_counter() - t1
        report.changed_elements += folded.changed_elements
        t2 = time.perf_counter()
        _apply_and_activate(target, reached, lambda: target.apply(folded, held_fps), stage)
    report.apply_s += time.perf_counter() - t2
