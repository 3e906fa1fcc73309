"""``bulletin mirror``: replicate a run into another store (:mod:`bulletin.mirror`)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import click

from bulletin.cli.bucket import _existing_store
from bulletin.cli.options import RUN_ENV, trust_options
from bulletin.cli.output import Output, human_bytes, json_option, pass_output

__all__ = ["mirror_command"]


@contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """An event set by the first SIGINT or SIGTERM (the copy in progress then ends after
    its current version); a second one is the default again (it interrupts at once)."""
    stop = threading.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in signals}

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()
        for sig, old in previous.items():
            signal.signal(sig, old)

    for sig in signals:
        signal.signal(sig, handler)
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@click.command("mirror")
@click.option("--from", "origin", required=True, metavar="URL", help="Store the run is copied from (only read).")
@click.option("--to", "destination", required=True, metavar="URL", help="Store the run is copied into.")
@click.option("--run", envvar=RUN_ENV, required=True, help=f"Run name inside both stores [env: {RUN_ENV}].")
@click.option(
    "--keep",
    type=click.IntRange(min=1),
    default=None,
    help="Keep only the newest KEEP versions (and the keyframe they start from) in the mirror.",
)
@click.option("--follow", is_flag=True, help="Keep polling the origin and copying new versions until SIGINT/SIGTERM.")
@click.option("--interval", type=click.FloatRange(min=0.05), default=2.0, show_default=True, help="Seconds per poll.")
@trust_options
@json_option
@pass_output
def mirror_command(
    out: Output,
    origin: str,
    destination: str,
    run: str,
    keep: int | None,
    follow: bool,
    interval: float,
    trusted_keys: tuple[Path, ...],
    max_head_age: float | None,
) -> None:
    """Copy a run verbatim into another store: objects checked, then signature and manifest
    (create-only, in version order), the head last. Resumes where a killed copy stopped."""
    from bulletin.mirror import Mirror, MirrorReport
    from bulletin.signing import load_trust
    from bulletin.storage import open_store

    trust = load_trust(trusted_keys, max_head_age)

    def emit(report: MirrorReport) -> None:
        def human() -> None:
            copied = f"versions {report.versions[0]}..{report.versions[-1]}" if report.versions else "nothing new"
            click.echo(
                f"{run}: {copied} -> {report.destination} ({report.objects_copied} objects, "
                f"{human_bytes(report.bytes_copied)} copied, {report.objects_checked} found and checked; "
                f"pruned {report.pruned_versions} versions) in {report.seconds:.2f}s; "
                f"head {report.head_version or 'none'}"
            )

        out.emit(report, human)

    with (
        Mirror(_existing_store(origin), open_store(destination), run, keep=keep, trust=trust) as mirror,
        _stop_on_signals() as stop,
    ):
        emit(mirror.sync(stop=stop))
        if not follow:
            return
        for report in mirror.follow(
            interval=interval, stop=stop, on_error=lambda exc: click.echo(f"warning: {exc}", err=True)
        ):
            emit(report)
