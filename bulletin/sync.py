"""Bringing a target from the version it holds to another one.

Planning reads manifests only; executing downloads what the plan needs, checks
every byte (sizes and SHA-256 against the manifests, the hash chain, the format),
decodes and folds the transitions, and only then touches the target. The target
checks base fingerprints, applies in place and verifies the result; the version
becomes current only when it matches the manifest's fingerprints exactly.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from bulletin.checkpoint import INDEX_NAME, parse_safetensors_header
from bulletin.errors import (
    CorruptData,
    FingerprintMismatch,
    FormatError,
    InternalError,
    VersionNotFound,
    WrongBase,
)
from bulletin.run import Run, StoredManifest
from bulletin.target import Held, WeightTarget
from patcher.decode import decode, shard_views
from patcher.fingerprint import fingerprint, format_fingerprint
from patcher.fold import fold
from patcher.format import DEFAULT_LIMITS, TensorInfo
from patcher.patch import Patch, check_layout

__all__ = ["SyncPlan", "SyncReport", "execute", "plan"]

#: Manifests fetched per round trip when walking back to a keyframe.
_WALK_BATCH = 8


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
    timings: dict[str, float] = field(default_factory=dict)


def _check_link(parent: StoredManifest, child: StoredManifest) -> None:
    if child.manifest.parent_digest != parent.digest:
        raise CorruptData(
            f"{child.manifest.run}: version {child.version} does not chain to version {parent.version} "
            "(parent digest mismatch): the bucket was rewritten or forked"
        )


def _walk_to_keyframe(run: Run, newest: StoredManifest, floor: int) -> list[StoredManifest]:
    """Manifests from the newest keyframe at or below ``newest`` up to ``newest``, ascending."""
    chain = [newest]
    while chain[0].manifest.keyframe is None:
        low = chain[0].version - 1
        if low < floor:
            raise VersionNotFound(f"{run.name}: no keyframe at or below version {newest.version} is left in the bucket")
        versions = list(range(max(floor, low - _WALK_BATCH + 1), low + 1))
        try:
            older = run.read_manifests(versions)
        except VersionNotFound:
            # Garbage collection removed the oldest ones: take what is left, newest first.
            older = []
            for version in reversed(versions):
                try:
                    older.insert(0, run.read_manifest(version))
                except VersionNotFound:
                    break
            if not older:
                raise VersionNotFound(
                    f"{run.name}: no keyframe at or below version {newest.version} is left in the bucket"
                ) from None
            floor = older[0].version  # nothing below a missing version can be reached
        for stored in reversed(older):
            _check_link(stored, chain[0])
            chain.insert(0, stored)
            if stored.manifest.keyframe is not None:
                break
    return chain


def plan(run: Run, target: StoredManifest, held: Held | None) -> SyncPlan:
    """Choose the cheapest verified route from ``held`` to ``target``."""
    if held is not None and held.version == target.version:
        return SyncPlan(target, None, ())
    if held is not None and held.version < target.version:
        try:
            span = run.read_manifests(list(range(held.version, target.version)))
        except VersionNotFound:
            span = []  # garbage-collected: start from a keyframe
        if span and span[0].manifest.fingerprints == held.fingerprints:
            chain = [*span, target]
            for parent, child in itertools.pairwise(chain):
                _check_link(parent, child)
            steps = chain[1:]
            # A layout change has no patch: the route must start at its keyframe.
            start = max((i for i, s in enumerate(steps) if s.manifest.patch is None), default=-1)
            patch_route = SyncPlan(target, steps[start] if start >= 0 else None, tuple(steps[start + 1 :]))
            keyframes = [i for i, s in enumerate(steps) if s.manifest.keyframe is not None and i > start]
            if keyframes:
                k = keyframes[-1]
                kf_route = SyncPlan(target, steps[k], tuple(steps[k + 1 :]))
                if kf_route.download_bytes < patch_route.download_bytes:
                    return kf_route
            return patch_route
    chain = _walk_to_keyframe(run, target, floor=1)
    return SyncPlan(target, chain[0], tuple(chain[1:]))


def _keyframe_tensors(
    run: Run, stored: StoredManifest, on_bytes: Callable[[int], None] | None
) -> tuple[dict[str, NDArray[np.unsignedinteger]], int]:
    ref = stored.manifest.keyframe
    if ref is None:
        raise InternalError(f"version {stored.version} has no keyframe, yet a route was planned through it")
    files = [f for f in ref.files if not f.key.endswith(INDEX_NAME)]
    blobs = run.download(files, on_bytes)
    specs = stored.manifest.specs
    out: dict[str, NDArray[np.unsignedinteger]] = {}
    for f, data in zip(files, blobs, strict=True):
        header = parse_safetensors_header(data, len(data), source=f.key)
        buffer = np.frombuffer(data, dtype=np.uint8)
        for name, (begin, end) in header.offsets.items():
            if name not in specs or header.specs[name] != specs[name] or name in out:
                raise FormatError(f"{f.key}: tensor {name!r} is not what the manifest lists")
            raw = buffer[header.data_start + begin : header.data_start + end]
            out[name] = raw.view(specs[name].bits_dtype).reshape(specs[name].shape)
    if out.keys() != specs.keys():
        raise FormatError(f"version {stored.version}: keyframe files do not hold every tensor")
    expected = stored.manifest.fingerprints
    for name, bits in out.items():
        if fingerprint(bits) != expected[name]:
            raise FingerprintMismatch(f"version {stored.version}: keyframe tensor {name!r} fails its fingerprint")
    return out, sum(len(b) for b in blobs)


def _check_transition(stored: StoredManifest, parent_fps: Mapping[str, int], infos: Mapping[str, TensorInfo]) -> None:
    """The patch's tensors are the manifest's layout, from the parent's fingerprints to its own."""
    manifest = stored.manifest
    check_layout({name: info.spec for name, info in infos.items()}, manifest.specs)
    target_fps = manifest.fingerprints
    for name, info in infos.items():
        if info.base_fingerprint != parent_fps.get(name) or info.target_fingerprint != target_fps[name]:
            raise FingerprintMismatch(
                f"version {stored.version}: patch of {name!r} does not match the manifests' fingerprints"
            )


def _transition(stored: StoredManifest, parent_fps: Mapping[str, int], shards: Sequence[bytes]) -> Patch:
    patch = decode(shards)
    infos = {td.spec.name: TensorInfo(td.spec, td.base_fingerprint, td.target_fingerprint, td.changed) for td in patch}
    _check_transition(stored, parent_fps, infos)
    return patch


def _apply_and_activate(target: WeightTarget, stored: StoredManifest, apply: Callable[[], dict[str, int]]) -> None:
    """Apply, check the result against the manifest, activate; put the target back on failure."""
    try:
        new_fps = apply()
        expected = stored.manifest.fingerprints
        if new_fps != expected:
            bad = sorted(n for n in expected if new_fps.get(n) != expected[n])[:3]
            raise WrongBase(
                f"version {stored.version}: bits after apply do not match the manifest "
                f"({', '.join(bad)}; got {[format_fingerprint(new_fps.get(n, 0)) for n in bad]})"
            )
        target.activate(stored.version)
    except BaseException:
        target.abort()  # put back what the target held before
        raise


def execute(
    run: Run,
    sync_plan: SyncPlan,
    target: WeightTarget,
    held: Held | None,
    *,
    on_bytes: Callable[[int], None] | None = None,
    on_activate: Callable[[StoredManifest], None] | None = None,
) -> SyncReport:
    """Carry out a plan. On failure the target keeps a verified version (see below).

    A keyframe is verified in full before it replaces anything and is activated at
    once, so a later failure leaves the node on that keyframe's version, which is
    older than asked but exact. Patches are verified (digests, format, fingerprint
    chain against the manifests) before the target sees them; the target restores
    its bits if the apply does not land on the manifest's fingerprints.
    """
    report = SyncReport(held.version if held else None, sync_plan.target.version)
    current = held
    if sync_plan.keyframe is not None:
        t0 = time.perf_counter()
        tensors, nbytes = _keyframe_tensors(run, sync_plan.keyframe, on_bytes)
        report.download_s += time.perf_counter() - t0
        report.bytes_downloaded += nbytes
        t1 = time.perf_counter()
        try:
            target.load_full(tensors, sync_plan.keyframe.manifest.specs)
            target.activate(sync_plan.keyframe.version)
        except BaseException:
            target.abort()
            raise
        report.apply_s += time.perf_counter() - t1
        report.keyframe = sync_plan.keyframe.version
        current = Held(sync_plan.keyframe.version, dict(sync_plan.keyframe.manifest.fingerprints))
        if on_activate is not None:
            on_activate(sync_plan.keyframe)
    if not sync_plan.patches:
        return report
    if current is None:
        raise InternalError("a patch route needs a held version or a keyframe")
    t0 = time.perf_counter()
    refs = [ref for step in sync_plan.patches for ref in (step.manifest.patch.shards if step.manifest.patch else ())]
    blobs = run.download(refs, on_bytes)
    report.download_s += time.perf_counter() - t0
    report.bytes_downloaded += sum(len(b) for b in blobs)
    t1 = time.perf_counter()
    held_fps = current.fingerprints
    counts: list[int] = []  # shards of each transition
    for step in sync_plan.patches:
        if step.manifest.patch is None:
            raise InternalError(f"version {step.version} has no patch, yet a route was planned through it")
        counts.append(len(step.manifest.patch.shards))
    if len(sync_plan.patches) == 1 and target.supports_shards:
        # One version behind (the steady state): the target applies straight from the
        # shards once their headers agree with the manifests (patcher.apply_shards).
        step = sync_plan.patches[0]
        infos = shard_views(blobs, DEFAULT_LIMITS)[2]
        _check_transition(step, held_fps, infos)
        report.decode_s = time.perf_counter() - t1
        report.transitions = 1
        report.changed_elements = sum(info.changed for info in infos.values())
        t2 = time.perf_counter()
        _apply_and_activate(target, sync_plan.target, lambda: target.apply_shards(blobs, held_fps))
    else:
        patches: list[Patch] = []
        position = 0
        parent_fps: Mapping[str, int] = current.fingerprints
        for step, count in zip(sync_plan.patches, counts, strict=True):
            patches.append(_transition(step, parent_fps, blobs[position : position + count]))
            position += count
            parent_fps = step.manifest.fingerprints
        folded = fold(patches) if len(patches) > 1 else patches[0]
        report.decode_s = time.perf_counter() - t1
        report.transitions = len(patches)
        report.changed_elements = folded.changed_elements
        t2 = time.perf_counter()
        _apply_and_activate(target, sync_plan.target, lambda: target.apply(folded, held_fps))
    report.apply_s += time.perf_counter() - t2
    if on_activate is not None:
        on_activate(sync_plan.target)
    return report
