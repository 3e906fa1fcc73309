"""``bulletin demo``."""

from __future__ import annotations

from pathlib import Path

import click

from bulletin.cli.output import Output, json_option, pass_output

__all__ = ["demo_command"]


@click.command("demo")
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bulletin-demo"),
    show_default=True,
    help="Where the local bucket and the replica go.",
)
@click.option("--params", type=click.IntRange(min=100_000), default=24_000_000, show_default=True)
@click.option("--versions", type=click.IntRange(min=2), default=8, show_default=True)
@click.option("--keyframe-every", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=1e-6, show_default=True)
@json_option
@pass_output
def demo_command(out: Output, directory: Path, params: int, versions: int, keyframe_every: int, lr: float) -> None:
    """Publish a realistic run to a local directory bucket and sync a replica from it."""
    from bulletin.demo import run_demo

    report = run_demo(
        directory,
        params=params,
        versions=versions,
        keyframe_every=keyframe_every,
        lr=lr,
        say=out.say,
    )
    out.emit(report, lambda: None)
