"""Commands on a run in a store: publish, sync, log, status, verify, gc.

The library is imported inside each command, so that ``bulletin --help`` and the
other commands start without loading the storage and sync stack.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import click

from bulletin.cli.options import (
    SERVED_DTYPES,
    dtype_option,
    files_options,
    signing_option,
    store_options,
    stores_options,
    trust_options,
)
from bulletin.cli.output import Output, human_bytes, json_option, pass_output
from bulletin.errors import ConfigError, InvalidInput
from patcher.compression import AUTO_CODEC, PUBLISH_CODECS

if TYPE_CHECKING:
    from bulletin.run import StoredManifest
    from bulletin.sources import Reader
    from bulletin.storage import Store
    from bulletin.target import Held

__all__ = [
    "gc_command",
    "log_command",
    "publish_command",
    "status_command",
    "sync_command",
    "verify_command",
]


def _existing_store(url: str) -> Store:
    """The store ``url`` names, for a command that only reads it: a local directory that
    does not exist is a mistake (a typo, a wrong mount), not an empty run."""
    from bulletin.errors import NotFound
    from bulletin.storage import open_store
    from bulletin.storage.local import LocalStore

    store = open_store(url)
    if isinstance(store, LocalStore) and not Path(store.root).is_dir():
        raise NotFound(f"no store at {store.root}: the directory does not exist")
    return store


@contextmanager
def _byte_progress(out: Output, label: str) -> Iterator[Callable[[int], None] | None]:
    """A running byte count on stderr when it is a terminal (never under --json)."""
    if not out.progress:
        yield None
        return
    lock = threading.Lock()
    state = {"total": 0, "shown": 0.0}
    err = sys.stderr

    def on_bytes(n: int) -> None:
        with lock:
            state["total"] += n
            now = time.monotonic()
            if now - state["shown"] >= 0.1:
                state["shown"] = now
                err.write(f"\r{label}: {human_bytes(state['total'])}   ")
                err.flush()

    try:
        yield on_bytes
    finally:
        if state["total"]:
            err.write(f"\r{label}: {human_bytes(state['total'])}   \n")
            err.flush()


def _age(created: datetime) -> str:
    seconds = (datetime.now(UTC) - created).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


@click.command("publish")
@click.argument("checkpoint", type=click.Path(exists=True, path_type=Path))
@store_options
@click.option("--keyframe-every", type=click.IntRange(min=1), default=10, show_default=True)
@click.option(
    "--codec",
    type=click.Choice(PUBLISH_CODECS),
    default=AUTO_CODEC,
    show_default=True,
    help="Patch codec: auto (context, the smallest, unless zstd is smaller), context, zstd or lz4.",
)
@click.option("--meta", multiple=True, metavar="KEY=VALUE", help="Annotation stored in the manifest.")
@dtype_option
@files_options
@signing_option
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the last published version's bits are kept between publishes, memory-mapped "
    "[default: $BULLETIN_CACHE_DIR or ~/.cache/bulletin, under publisher/<store>/<run>].",
)
@json_option
@pass_output
def publish_command(
    out: Output,
    checkpoint: Path,
    store: str,
    run: str,
    keyframe_every: int,
    codec: str,
    meta: tuple[str, ...],
    dtype: str,
    files: bool,
    include_files: tuple[str, ...],
    exclude_files: tuple[str, ...],
    signing_key: Path | None,
    cache_dir: Path | None,
) -> None:
    """Publish a safetensors checkpoint (file or directory) as the run's next version.

    A directory's model files (config, generation config, tokenizer files, chat
    template) are published with it, once: every node folder then holds them beside
    the tensors. Files left out (pickled weights, code, ...) are listed. The checkpoint
    is read through memory maps, and diffed tensor by tensor against the last published
    version's bits, kept between publishes in --cache-dir (verified against the run,
    rebuilt from it when missing or stale)."""
    from bulletin.model_files import TENSORS, select_model_files
    from bulletin.publisher import Publisher
    from bulletin.signing import load_signer

    metadata = {}
    for item in meta:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidInput(f"--meta wants KEY=VALUE, got {item!r}")
        metadata[key] = value
    selected = (
        select_model_files(checkpoint, include=include_files, exclude=exclude_files)
        if files and checkpoint.is_dir()
        else None
    )
    skipped = dict(selected.skipped) if selected is not None else {}
    t0 = time.perf_counter()
    with _byte_progress(out, "uploading") as on_bytes:
        pub = Publisher(
            store,
            run,
            dtype=SERVED_DTYPES.get(dtype, "BF16"),  # keep: nothing is cast
            keyframe_every=keyframe_every,
            codec=codec,
            on_bytes=on_bytes,
            signing_key=load_signer(signing_key),
            cache_dir=cache_dir,
        )
        # No files (--no-files, a single file, a weights-only folder): the previous version's.
        given = selected if selected is not None and len(selected) else None
        result = pub.publish_checkpoint(
            checkpoint, metadata=metadata, files=given, keep_files=given is None, cast=dtype != "keep"
        )
        pub.close()
    data = {
        "run": run,
        "seconds": time.perf_counter() - t0,
        "version": result.version,
        "keyframe": result.keyframe,
        "changed_elements": result.changed_elements,
        "total_elements": result.total_elements,
        "patch_bytes": result.patch_bytes,
        "keyframe_bytes": result.keyframe_bytes,
        "manifest_digest": result.manifest_digest,
        "dtype": dtype,
        "files": list(result.files),
        "files_uploaded": result.files_uploaded,
        "files_skipped": skipped,
        "notes": list(result.notes),
    }

    def human() -> None:
        kind = "keyframe" if result.keyframe else "patch"
        pct = 100 * result.changed_elements / result.total_elements if result.total_elements else 0.0
        click.echo(
            f"{run}: published version {result.version} ({kind}; patch {human_bytes(result.patch_bytes)}, "
            f"keyframe {human_bytes(result.keyframe_bytes)}; {pct:.3f}% changed) in {data['seconds']:.2f}s"
        )
        if result.files:
            uploaded = human_bytes(result.files_uploaded) if result.files_uploaded else "nothing new"
            click.echo(f"  model files ({len(result.files)}; {uploaded} uploaded): {', '.join(result.files)}")
        for note in result.notes:
            click.echo(f"  note: {note}")
        for reason, names in _by_reason(skipped).items():
            if reason != TENSORS:  # the tensors are what was published
                click.echo(f"  left out ({reason}): {', '.join(names)}")

    out.emit(data, human)


def _by_reason(skipped: dict[str, str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for name, reason in skipped.items():
        grouped.setdefault(reason, []).append(name)
    return grouped


@click.command("sync")
@stores_options
@click.option("--to", "local_dir", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--version", type=click.IntRange(min=1), default=None, help="Version to reach [default: newest].")
@click.option("--follow", is_flag=True, help="Keep polling and applying new versions until interrupted.")
@click.option("--interval", type=click.FloatRange(min=0.05), default=2.0, show_default=True)
@click.option(
    "--allow-reset",
    is_flag=True,
    help="Follow the run if it was rolled back or rewritten since DIR's version (DIR may move to an "
    "older version or another chain); without it such a run is refused (exit 10).",
)
@click.option(
    "--no-verify",
    is_flag=True,
    help="Skip re-hashing DIR's bits against its version before syncing (reads the whole model once); "
    "damaged bits are rebuilt from a keyframe, never patched onto.",
)
@click.option(
    "--layout",
    type=click.Choice(["dense", "log"]),
    default="dense",
    show_default=True,
    help="How DIR keeps its bits: dense (DIR/current, a loadable folder rewritten per version) or log "
    "(a base folder and a log of verified patches: about a patch written per version; DIR/current "
    "exists only while the base is the version, see --materialize). docs/FORMAT.md 9.1.",
)
@click.option(
    "--materialize",
    is_flag=True,
    help="With --layout log: compact DIR after the sync, so that DIR/current is the version (O(model) writes).",
)
@trust_options
@json_option
@pass_output
def sync_command(
    out: Output,
    store: tuple[str, ...],
    run: str,
    lag_grace: float,
    local_dir: Path,
    version: int | None,
    follow: bool,
    interval: float,
    allow_reset: bool,
    no_verify: bool,
    layout: Literal["dense", "log"],
    materialize: bool,
    trusted_keys: tuple[Path, ...],
    max_head_age: float | None,
) -> None:
    """Bring a local directory to a version of the run (safetensors under DIR/current)."""
    from bulletin.replica_log import LogDirTarget
    from bulletin.signing import load_trust
    from bulletin.subscriber import Subscriber
    from bulletin.target import LocalDirTarget

    if materialize and layout != "log":
        raise ConfigError("--materialize applies to --layout log (a dense DIR/current is always the version)")
    trust = load_trust(trusted_keys, max_head_age)  # a bad key file fails before DIR is opened
    with (
        _byte_progress(out, "downloading") as on_bytes,
        Subscriber(
            store,
            run,
            local_dir,
            on_bytes=on_bytes,
            allow_reset=allow_reset,
            trust=trust,
            lag_grace=lag_grace,
            layout=layout,
        ) as sub,
    ):
        before = sub.current_version
        check = None if no_verify else sub.verify(repair=False)  # damaged: the sync takes a keyframe route
        t0 = time.perf_counter()
        reached = sub.sync(version)
        report = sub.stats.last_report
        if materialize and isinstance(sub.target, LogDirTarget):
            sub.target.compact()
        seconds = time.perf_counter() - t0
        written = None
        if isinstance(sub.target, LogDirTarget):
            # A compaction started by this sync finishes before the process ends (close
            # waits for it): its writes are this command's, reported apart from the versions'.
            sub.target.wait_for_compaction()
            written = dict(sub.target.written)
        downloaded = report.bytes_downloaded if report else 0
        path = local_dir / LocalDirTarget.CURRENT if os.path.lexists(local_dir / LocalDirTarget.CURRENT) else local_dir
        data = {
            "run": run,
            "from_version": before,
            "version": reached,
            "path": str(path),
            "seconds": seconds,
            "bytes_downloaded": downloaded,
            "keyframe": report.keyframe if report else None,
            "transitions": report.transitions if report else 0,
            "files_downloaded": report.files_downloaded if report else 0,
            "changed_elements": report.changed_elements if report else 0,
            "download_s": report.download_s if report else 0.0,
            "decode_s": report.decode_s if report else 0.0,
            "apply_s": report.apply_s if report else 0.0,
            "verified": None if check is None or check.version is None else check,
            "repaired": check is not None and not check.ok,
            "reset": sub.stats.last_reset,
            "written": written,
        }

        def human() -> None:
            click.echo(
                f"{run}: {before or 'nothing'} -> {reached} in {seconds:.2f}s "
                f"({human_bytes(downloaded)} downloaded) at {path}"
            )
            if check is not None and not check.ok:
                names = ", ".join(check.mismatched[:3]) + (", ..." if len(check.mismatched) > 3 else "")
                click.echo(
                    f"  repaired: the bits held for version {check.version} did not match its fingerprints "
                    f"({len(check.mismatched)} tensor(s): {names}); rebuilt from a keyframe"
                )
            if sub.stats.last_reset is not None:
                click.echo(f"  reset (--allow-reset): {sub.stats.last_reset}")

        out.emit(data, human)
        if not follow:
            return
        for reached in sub.follow(interval=interval, on_error=lambda exc: click.echo(f"warning: {exc}", err=True)):
            last = sub.stats.last_report
            line = f"{run}: now at version {reached}"
            out.emit(
                {"run": run, "version": reached, "bytes_downloaded": last.bytes_downloaded if last else 0},
                lambda line=line: click.echo(line),  # type: ignore[misc]
            )


@click.command("log")
@store_options
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Newest versions shown.")
@trust_options
@json_option
@pass_output
def log_command(
    out: Output, store: str, run: str, limit: int | None, trusted_keys: tuple[Path, ...], max_head_age: float | None
) -> None:
    """The run's chain, newest first: version, kind, bytes, changed %, age."""
    from bulletin.maintenance import log
    from bulletin.run import Run
    from bulletin.signing import load_trust

    entries = log(Run(_existing_store(store), run, trust=load_trust(trusted_keys, max_head_age)), limit=limit)

    def human() -> None:
        click.echo(f"{'version':>8}  {'kind':<15} {'bytes':>12} {'changed %':>10} {'age':>7}")
        for e in entries:
            size = e.patch_bytes + e.keyframe_bytes
            pct = f"{100 * e.changed_fraction:.3f}" if e.changed_fraction is not None else "-"
            click.echo(f"{e.version:>8}  {e.kind:<15} {human_bytes(size):>12} {pct:>10} {_age(e.created_at):>7}")

    out.emit([asdict(e) | {"changed_fraction": e.changed_fraction} for e in entries], human)


@click.command("status")
@stores_options
@click.option("--local", "local_dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option(
    "--verify",
    "verify_local",
    is_flag=True,
    help="Also re-hash the local copy's bits against its version (reads the whole model; exit 6 if "
    "damaged). Run it between syncs: an apply in progress reads as damage.",
)
@trust_options
@json_option
@pass_output
def status_command(
    out: Output,
    store: tuple[str, ...],
    run: str,
    lag_grace: float,
    local_dir: Path | None,
    verify_local: bool,
    trusted_keys: tuple[Path, ...],
    max_head_age: float | None,
) -> None:
    """The run's head and newest version, and a local copy's version, lag, and whether the
    run still continues it. With several --store, each one's head too; the newest is what a
    subscriber reading them in that order would take."""
    from bulletin.signing import load_trust
    from bulletin.sources import Sources
    from bulletin.storage import open_store
    from bulletin.target import LocalDirTarget

    trust = load_trust(trusted_keys, max_head_age)
    # A store not there yet shows as empty.
    remote = Sources([open_store(url) for url in store], run, trust=trust, lag_grace=lag_grace)
    head = remote.poll()
    tip = remote.tip()
    urls = [each.store.url for each in remote.runs]
    data: dict[str, Any] = {
        "run": run,
        "store": urls[0],
        "stores": [
            {"url": url, "head_version": seen.head.version if seen else None}
            for url, seen in zip(urls, remote.heads(), strict=True)
        ],
        "head_version": head.head.version if head else None,
        "head_updated_at": head.head.updated_at if head else None,
        "newest_version": tip.version if tip else None,
    }
    if local_dir is not None:
        restored = LocalDirTarget.peek(local_dir, run=run)  # read only: no lock, no recovery
        data["local_version"] = restored.version if restored else None
        data["lag"] = (tip.version - restored.version) if tip and restored else None
        data["local_manifest_digest"] = restored.manifest_digest if restored else None
        data["local_chain"] = _local_chain(remote, restored, tip) if restored else None
        data["local_verify"] = _rehash_local(local_dir, run) if verify_local and restored else None

    def human() -> None:
        click.echo(f"run {run} in {', '.join(urls)}")
        if len(urls) > 1:
            heads = ", ".join(f"{s['url']}: {s['head_version'] or 'none'}" for s in data["stores"])
            click.echo(f"  heads: {heads}")
        click.echo(f"  head: {data['head_version'] or 'none'}  newest committed: {data['newest_version'] or 'none'}")
        if local_dir is not None:
            click.echo(f"  local {local_dir}: {data['local_version'] or 'empty'} (lag {data['lag']})")
            chain = data.get("local_chain")
            if chain is not None and not chain["ok"]:
                click.echo(f"  the run no longer continues it ({chain['code']}): {chain['message']}")
            checked = data.get("local_verify")
            if checked is not None:
                state = "bits intact" if checked["ok"] else f"DAMAGED: {', '.join(checked['mismatched'][:3])}"
                click.echo(f"  verified version {checked['version']} in {checked['seconds']:.2f}s: {state}")

    out.emit(data, human)
    checked = data.get("local_verify")
    if checked is not None and not checked["ok"]:
        raise click.exceptions.Exit(6)


def _local_chain(remote: Reader, held: Held, tip: StoredManifest | None) -> dict[str, Any]:
    """Whether the run still continues the local copy's version (``check_chain``)."""
    from bulletin.errors import ChainMismatch, RunRewound
    from bulletin.sync import check_chain

    try:
        if tip is None:
            raise RunRewound(f"{remote.name}: version {held.version} held here, but the run has no version left")
        check_chain(remote, held, tip, tip=True)
    except ChainMismatch as exc:
        return {"ok": False, "code": exc.code, "message": str(exc)}
    return {"ok": True, "code": None, "message": None}


def _rehash_local(local_dir: Path, run: str) -> dict[str, Any] | None:
    """The local copy's bits re-hashed against ``state.json``, reading only (no lock: a
    sync applying in place at the same moment reads as damage; run it between syncs)."""
    import hashlib

    from bulletin.checkpoint import Checkpoint
    from bulletin.target import read_local_state
    from patcher.fingerprint import fingerprint, parse_fingerprint
    from schemas.local_state import local_state_files

    state = read_local_state(local_dir, run=run)
    if state is None:
        return None
    t0 = time.perf_counter()
    with Checkpoint(local_dir / state.model_dir) as ckpt:
        found = {name: fingerprint(ckpt.bits(name)) for name in ckpt.specs}
    expected = {name: parse_fingerprint(fp) for name, fp in state.fingerprints.items()}
    bad = sorted(n for n in expected.keys() | found.keys() if found.get(n) != expected.get(n))
    for path, digest in local_state_files(state).items():  # model files, byte for byte
        file = local_dir / state.model_dir / path
        if not file.is_file() or hashlib.sha256(file.read_bytes()).hexdigest() != digest:
            bad.append(f"file {path}")
    return {"version": state.version, "ok": not bad, "mismatched": bad, "seconds": time.perf_counter() - t0}


@click.command("verify")
@store_options
@trust_options
@json_option
@pass_output
def verify_command(
    out: Output, store: str, run: str, trusted_keys: tuple[Path, ...], max_head_age: float | None
) -> None:
    """Recompute the whole chain: digests, links, head, and every version's bits (and,
    with --trusted-key, every signature)."""
    from bulletin.maintenance import verify
    from bulletin.run import Run
    from bulletin.signing import load_trust

    report = verify(Run(_existing_store(store), run, trust=load_trust(trusted_keys, max_head_age)))
    data = {
        "ok": report.ok,
        "versions": report.versions,
        "keyframes": report.keyframes,
        "transitions": report.transitions,
        "files": report.files,
        "bytes_read": report.bytes_read,
        "head_version": report.head_version,
        "problems": report.problems,
    }

    def human() -> None:
        state = "OK" if report.ok else f"{len(report.problems)} problem(s)"
        click.echo(
            f"{run}: {state}: {report.versions} versions, {report.keyframes} keyframes, "
            f"{report.transitions} transitions, {report.files} model files checked "
            f"({human_bytes(report.bytes_read)} read)"
        )
        for problem in report.problems:
            click.echo(f"  - {problem}")

    out.emit(data, human)
    if not report.ok:
        raise click.exceptions.Exit(5)


@click.command("gc")
@store_options
@click.option("--keep", type=click.IntRange(min=1), required=True, help="Newest versions kept syncable.")
@click.option("--dry-run", is_flag=True, help="Only list what would be deleted.")
@click.option(
    "--grace-minutes",
    type=click.IntRange(min=0),
    default=60,
    show_default=True,
    help="Unreferenced objects younger than this are kept (publishes in flight).",
)
@json_option
@pass_output
def gc_command(out: Output, store: str, run: str, keep: int, dry_run: bool, grace_minutes: int) -> None:
    """Delete versions older than the newest KEEP (never what a keyframe chain needs)."""
    from bulletin.maintenance import collect_garbage
    from bulletin.run import Run

    report = collect_garbage(
        Run(_existing_store(store), run), keep=keep, dry_run=dry_run, grace=timedelta(minutes=grace_minutes)
    )

    def human() -> None:
        verb = "would delete" if dry_run else "deleted"
        click.echo(
            f"{run}: kept versions {report.floor}..{report.tip}; {verb} {len(report.deleted_manifests)} "
            f"manifests and {len(report.deleted_objects)} objects ({human_bytes(report.deleted_bytes)})"
        )

    out.emit(report, human)
