"""The ``bulletin`` command. Thin: the library does the work.

Errors from the library become one line on stderr (``error: <code>: <message>``)
and an exit status per kind of error; ``--json`` commands print the error as JSON
on stdout instead. ``BULLETIN_DEBUG=1`` brings tracebacks back.
"""

from __future__ import annotations

import os
import sys
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
from bulletin.cli.offline import apply_command, diff_command, inspect_command
from bulletin.cli.output import emit_error
from bulletin.errors import (
    BulletinError,
    Conflict,
    CorruptData,
    EngineError,
    InvalidInput,
    NotFound,
    StorageUnavailable,
    WrongBase,
)
from bulletin.sidecar.cli import serve

__all__ = ["EXIT_CODES", "cli", "main"]

#: Exit status by what the caller does about it (most specific first).
EXIT_CODES: Final[tuple[tuple[type[BulletinError], int], ...]] = (
    (InvalidInput, 2),
    (NotFound, 3),
    (Conflict, 4),
    (CorruptData, 5),
    (WrongBase, 6),
    (StorageUnavailable, 7),
    (EngineError, 8),
    (BulletinError, 1),
)


def exit_code(exc: BulletinError) -> int:
    return next(code for kind, code in EXIT_CODES if isinstance(exc, kind))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="bulletin")
def cli() -> None:
    """Ship RL policy weights as lossless bit-level patches through an S3-compatible bucket.

    --store takes a local directory (a bare path or file://), s3://bucket/prefix
    (the standard AWS_* environment applies, with AWS_ENDPOINT_URL_S3 for MinIO or
    LocalStack) or memory://name; it defaults to $BULLETIN_STORE.
    """


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
    demo_command,
    serve,
):
    cli.add_command(command)


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    try:
        # Without standalone mode click returns a command's `Exit` code instead of exiting.
        result = cli.main(args=argv, prog_name="bulletin", standalone_mode=False)
    except BulletinError as exc:
        if os.environ.get("BULLETIN_DEBUG"):
            raise
        emit_error(exc)
        return exit_code(exc)
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
