"""Operations on a whole run: its log, a full verification, and garbage collection."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from bulletin import keyspace
from bulletin.errors import BulletinError, InvalidInput, UntrustedVersion, VersionNotFound
from bulletin.keyspace import version_of_data_key
from bulletin.run import Run, StoredManifest, sha256_hex
from bulletin.storage import get_many, require_writable
from bulletin.sync import SyncPlan, execute
from bulletin.target import ArrayTarget, Held
from schemas.common import MAX_DOCUMENT_BYTES
from schemas.manifest import FileRef, manifest_files

__all__ = ["GcReport", "LogEntry", "VerifyReport", "collect_garbage", "log", "verify"]


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One version as ``bulletin log`` shows it."""

    version: int
    kind: str  # "keyframe", "patch" or "keyframe+patch"
    created_at: datetime
    patch_bytes: int
    keyframe_bytes: int
    changed_elements: int | None
    total_elements: int
    total_bytes: int
    writer: str
    metadata: dict[str, str]

    @property
    def changed_fraction(self) -> float | None:
        if self.changed_elements is None or not self.total_elements:
            return None
        return self.changed_elements / self.total_elements


def _entry(stored: StoredManifest) -> LogEntry:
    m = stored.manifest
    kind = "+".join(k for k, present in (("keyframe", m.keyframe), ("patch", m.patch)) if present)
    return LogEntry(
        version=m.version,
        kind=kind,
        created_at=m.created_at,
        patch_bytes=m.stats.patch_bytes,
        keyframe_bytes=m.stats.keyframe_bytes,
        changed_elements=m.patch.changed_elements if m.patch else None,
        total_elements=m.stats.total_elements,
        total_bytes=m.stats.total_bytes,
        writer=m.writer,
        metadata=dict(m.metadata),
    )


def log(run: Run, *, limit: int | None = None) -> list[LogEntry]:
    """The chain, newest first (``limit`` newest versions). Under ``run``'s trust policy a
    version shown must be signed by a trusted key (``UntrustedVersion`` otherwise)."""
    versions = run.versions()
    if limit is not None:
        versions = versions[-limit:] if limit > 0 else []
    return [_entry(s) for s in reversed(run.read_manifests(versions))]


@dataclass(slots=True)
class VerifyReport:
    """The outcome of :func:`verify`; ``ok`` when ``problems`` is empty."""

    versions: int = 0
    keyframes: int = 0
    transitions: int = 0
    files: int = 0
    """Model file objects checked (each distinct one once: size and SHA-256)."""
    bytes_read: int = 0
    head_version: int | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(run: Run, *, progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Check the whole run: every digest, every link of the hash chain, the head, and
    every version's bits (rebuilt from the oldest keyframe, fingerprints recomputed in
    full) and model files (each object read and checked once). Under ``run``'s trust
    policy, also the head's signature and every manifest's own (an audit: each version
    is checked by itself, not through the chain). Problems are collected, not raised;
    reconstruction restarts at the next keyframe after a broken version."""
    report = VerifyReport()
    trust, run = run.trust, Run(run.store, run.name, max_workers=run.max_workers)  # read all; judge below
    versions = run.versions()
    if not versions:
        raise VersionNotFound(f"{run.name}: the run has no version")
    manifests = run.read_manifests(versions)
    report.versions = len(manifests)
    head = run.read_head()
    if trust is not None:
        for stored in manifests:
            try:
                source = run.key(keyspace.manifest_key(stored.version))
                trust.verify_manifest(run.name, stored.digest, run.read_signature(stored.digest), source=source)
            except UntrustedVersion as exc:
                report.problems.append(f"version {stored.version}: {exc.code}: {exc}")
        if head is not None:
            try:
                trust.verify_head(run.name, head.head, source=run.key(keyspace.HEAD))
            except UntrustedVersion as exc:
                report.problems.append(f"head: {exc.code}: {exc}")
    if head is None:
        report.problems.append("the run has versions but no head")
    else:
        report.head_version = head.head.version
        by_version = {s.version: s for s in manifests}
        pointed = by_version.get(head.head.version)
        if pointed is None:
            report.problems.append(f"head points at version {head.head.version}, which is missing")
        elif pointed.digest != head.head.manifest_digest:
            report.problems.append(f"head digest does not match version {head.head.version}'s manifest")
    previous: StoredManifest | None = None
    for stored in manifests:
        if previous is not None and previous.version + 1 != stored.version:
            report.problems.append(f"versions {previous.version + 1}..{stored.version - 1} are missing")
        elif previous is not None and stored.manifest.parent_digest != previous.digest:
            report.problems.append(f"version {stored.version} does not chain to version {previous.version}")
        previous = stored
    target = ArrayTarget()
    held: Held | None = None
    checked_files: dict[str, str | None] = {}
    for stored in manifests:
        try:
            if held is not None and stored.manifest.patch is not None and held.version == stored.version - 1:
                report.bytes_read += execute(run, SyncPlan(stored, None, (stored,)), target, held).bytes_downloaded
                report.transitions += 1
                held = Held.at(stored)
                if stored.manifest.keyframe is not None:  # check the keyframe copy on its own too
                    report.bytes_read += execute(
                        run, SyncPlan(stored, stored, ()), ArrayTarget(), None
                    ).bytes_downloaded
                    report.keyframes += 1
            elif stored.manifest.keyframe is not None:
                report.bytes_read += execute(run, SyncPlan(stored, stored, ()), target, None).bytes_downloaded
                report.keyframes += 1
                held = Held.at(stored)
            else:
                report.problems.append(f"version {stored.version}: cannot be rebuilt (no base before it)")
                continue
            recomputed = target.full_fingerprints()
            if recomputed != held.fingerprints:
                bad = sorted(n for n in held.fingerprints if recomputed.get(n) != held.fingerprints[n])
                report.problems.append(f"version {stored.version}: rebuilt bits differ in {bad[:3]}")
                held = None
        except BulletinError as exc:
            report.problems.append(f"version {stored.version}: {exc.code}: {exc}")
            held = None
        _verify_files(run, stored, report, checked_files)
        if progress is not None:
            progress(stored.version)
    return report


def _verify_files(run: Run, stored: StoredManifest, report: VerifyReport, checked: dict[str, str | None]) -> None:
    """Read and check the model file objects of ``stored`` not checked yet (``checked``:
    key -> the problem found, or None)."""
    refs: dict[str, FileRef] = {}
    for ref in manifest_files(stored.manifest):
        if ref.key not in checked:
            refs.setdefault(ref.key, ref)
    for key, ref in refs.items():
        try:
            report.bytes_read += len(run.download([ref])[0])
            checked[key] = None
        except BulletinError as exc:
            checked[key] = f"{exc.code}: {exc}"
        report.files += 1
    for ref in manifest_files(stored.manifest):
        problem = checked.get(ref.key)
        if problem is not None:
            report.problems.append(f"version {stored.version}: file {ref.path!r}: {problem}")


@dataclass(slots=True)
class GcReport:
    """What :func:`collect_garbage` removed (or would remove, in a dry run)."""

    floor: int
    tip: int
    deleted_manifests: list[str] = field(default_factory=list)
    deleted_objects: list[str] = field(default_factory=list)
    deleted_bytes: int = 0
    dry_run: bool = False


def collect_garbage(
    run: Run,
    *,
    keep: int,
    dry_run: bool = False,
    grace: timedelta = timedelta(hours=1),
) -> GcReport:
    """Keep the newest ``keep`` versions syncable; remove everything older.

    The kept range is widened down to the newest keyframe at or below its oldest
    version, so a fresh node can always start. Model file objects a kept manifest names
    are kept whatever version first uploaded them. Objects no kept manifest names
    (left by crashed or losing publishers) are removed once older than ``grace``,
    so a publish in flight is never touched. Manifests go before the data they name,
    and before their detached signatures (removed with them, and when orphaned by a
    losing commit, once older than ``grace``).
    """
    if keep < 1:
        raise InvalidInput("keep must be at least 1")
    if not dry_run:
        require_writable(run.store, "gc")  # before a single object is listed or deleted
    versions = run.versions()
    if not versions:
        raise VersionNotFound(f"{run.name}: the run has no version")
    tip = versions[-1]
    want = max(versions[0], tip - keep + 1)
    floor = want
    while True:
        stored = run.read_manifest(floor)
        if stored.manifest.keyframe is not None:
            break
        if floor == versions[0]:
            raise VersionNotFound(f"{run.name}: no keyframe at or below version {want}; nothing is safe to remove")
        floor -= 1
    kept = run.read_manifests([v for v in versions if v >= floor])
    referenced: set[str] = set()
    for s in kept:
        m = s.manifest
        referenced.update(run.key(r.key) for r in (m.patch.shards if m.patch else ()))
        referenced.update(run.key(r.key) for r in (m.keyframe.files if m.keyframe else ()))
        referenced.update(run.key(r.key) for r in manifest_files(m))
    report = GcReport(floor=floor, tip=tip, dry_run=dry_run)
    report.deleted_manifests = [run.key(f"manifests/{v:020d}.json") for v in versions if v < floor]
    cutoff = datetime.now(UTC) - grace
    for prefix in (keyspace.PATCHES, keyspace.KEYFRAMES, keyspace.FILES):
        for info in run.objects(prefix):
            if info.key in referenced:
                continue
            version = version_of_data_key(info.key[len(run.root) :])
            old_enough = info.last_modified is not None and info.last_modified < cutoff
            if (version is not None and version < floor) or old_enough:
                report.deleted_objects.append(info.key)
                report.deleted_bytes += info.size
    _signatures_to_delete(run, report, kept, cutoff)
    if not dry_run:
        for key in report.deleted_manifests:
            run.store.delete(key)
        for key in report.deleted_objects:
            run.store.delete(key)
    return report


def _signatures_to_delete(run: Run, report: GcReport, kept: list[StoredManifest], cutoff: datetime) -> None:
    """Add to ``report`` the signatures of the manifests it deletes, and those no manifest
    has (a losing or crashed commit) once older than ``cutoff``; never a kept version's."""
    signatures = list(run.objects(keyspace.SIGNATURES))
    if not signatures:  # an unsigned run: one listing, nothing read
        return
    keep = {run.key(keyspace.signature_key(s.digest)) for s in kept}
    removed = get_many(run.store, report.deleted_manifests, max_workers=run.max_workers, max_bytes=MAX_DOCUMENT_BYTES)
    going = {run.key(keyspace.signature_key(sha256_hex(data))) for data in removed.values()}
    for info in signatures:
        old_enough = info.last_modified is not None and info.last_modified < cutoff
        if info.key not in keep and (info.key in going or old_enough):
            report.deleted_objects.append(info.key)
            report.deleted_bytes += info.size
