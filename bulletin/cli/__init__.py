"""The ``bulletin`` command. Thin: the library does the work.

Errors from the library become one line on stderr (``error: <code>: <message>``)
and an exit status per kind of error (:mod:`bulletin.cli.output`); under ``--json``
the error is printed as JSON on stdout instead. ``BULLETIN_DEBUG=1`` brings
tracebacks back.

Each invocation holds one :class:`~bulletin.cli.output.Output` in the click context
(``ctx.obj``); ``--json`` is accepted by the group and by every command. Commands
import the library when they run, so ``bulletin --help`` and every command but
``serve`` start without the server stack (aiohttp).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import click

from bulletin import __version__
from bulletin.cli.bucket import (
    gc_command,
    log_command,
    publish_command,
    status_command,
    sync_command,
    verify_command,
)
from bulletin.cli.demo import demo_command
from bulletin.cli.mirror import mirror_command
from bulletin.cli.offline import apply_command, diff_command, inspect_command
from bulletin.cli.output import EXIT_CODES, Output, json_option, pass_output
from bulletin.errors import BulletinError

__all__ = ["EXIT_CODES", "cli", "main"]

#: Commands defined outside this package, imported when first listed or run: the
#: sidecar's command module imports this package's options, so an eager import
#: here would be circular.
LAZY_COMMANDS: Final[Mapping[str, str]] = {"serve": "bulletin.sidecar.cli:serve"}


class _Group(click.Group):
    """A group whose :data:`LAZY_COMMANDS` are imported on demand."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        where = LAZY_COMMANDS.get(cmd_name)
        if where is not None and cmd_name not in self.commands:
            module, _, name = where.partition(":")
            command = getattr(importlib.import_module(module), name)
            if not isinstance(command, click.Command):  # pragma: no cover - a wiring bug
                raise TypeError(f"{where} is not a click command")
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="bulletin")
@json_option
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Ship RL policy weights as lossless bit-level patches through an S3-compatible bucket.

    --store takes a local directory (a bare path or file://), s3://bucket/prefix
    (the standard AWS_* environment applies, with AWS_ENDPOINT_URL_S3 for MinIO or
    LocalStack) or memory://name; it defaults to $BULLETIN_STORE.
    """
    ctx.ensure_object(Output)


@click.command("keygen")
@click.argument("private_key", type=click.Path(dir_okay=False, path_type=Path))
@json_option
@pass_output
def keygen_command(out: Output, private_key: Path) -> None:
    """Write a new Ed25519 signing key to PRIVATE_KEY (mode 0600) and its public key to
    PRIVATE_KEY.pub; never overwrites. Trainers sign with the first (publish --signing-key),
    nodes trust the second (--trusted-key); see docs/SECURITY.md."""
    from bulletin.signing import generate_key_files

    public_key = private_key.with_name(private_key.name + ".pub")
    key_id = generate_key_files(private_key, public_key)
    data = {"key_id": key_id, "private_key": str(private_key), "public_key": str(public_key)}
    out.emit(data, lambda: click.echo(f"key {key_id}: private {private_key} (keep it secret), public {public_key}"))


for command in (
    diff_command,
    apply_command,
    inspect_command,
    publish_command,
    sync_command,
    log_command,
    status_command,
    verify_command,
    gc_command,
    mirror_command,
    demo_command,
    keygen_command,
):
    cli.add_command(command)


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    # Created here rather than by the group so that errors raised after the command's
    # context is gone still print in the format --json asked for.
    output = Output()
    try:
        # Without standalone mode click returns a command's `Exit` code instead of exiting.
        result = cli.main(args=argv, prog_name="bulletin", standalone_mode=False, obj=output)
    except (BulletinError, MemoryError) as exc:  # a MemoryError prints as OutOfMemory
        if os.environ.get("BULLETIN_DEBUG"):
            raise
        return output.error(exc)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return 130
    return result if isinstance(result, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
