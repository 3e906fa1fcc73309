"""Output for people and for machines (``--json``), and the one place errors become one line.

Every command prints through the :class:`Output` held in the click context
(``ctx.obj``): the group's ``--json`` and each command's ``--json`` set it, so both
``bulletin --json log ...`` and ``bulletin log ... --json`` work. :func:`exit_status`
maps the library's exceptions to exit statuses; a ``MemoryError`` is reported as
:class:`~bulletin.errors.OutOfMemory` (:func:`as_bulletin_error`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, is_dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final, TypeVar

import click

from bulletin.errors import (
    BulletinError,
    ChainMismatch,
    Conflict,
    CorruptData,
    EngineError,
    InternalError,
    InvalidInput,
    LocalStorageError,
    NotFound,
    OutOfMemory,
    StorageUnavailable,
    UntrustedVersion,
    WrongBase,
)

__all__ = [
    "EXIT_CODES",
    "Output",
    "as_bulletin_error",
    "exit_status",
    "human_bytes",
    "json_option",
    "pass_output",
    "to_jsonable",
]

F = TypeVar("F", bound=Callable[..., Any])

#: Exit status by what the caller does about it (most specific first).
EXIT_CODES: Final[tuple[tuple[type[BulletinError], int], ...]] = (
    (InvalidInput, 2),
    (NotFound, 3),
    (Conflict, 4),
    (CorruptData, 5),
    (WrongBase, 6),
    (StorageUnavailable, 7),
    (EngineError, 8),
    (InternalError, 9),
    (ChainMismatch, 10),
    (LocalStorageError, 11),
    (OutOfMemory, 12),
    (UntrustedVersion, 13),
    (BulletinError, 1),
)


def as_bulletin_error(exc: BulletinError | MemoryError) -> BulletinError:
    """``exc`` as a kind of the tree: a ``MemoryError`` (raised anywhere, by NumPy or
    Python itself) becomes :class:`~bulletin.errors.OutOfMemory`."""
    if isinstance(exc, BulletinError):
        return exc
    detail = f" ({exc})" if str(exc) else ""
    error = OutOfMemory(f"out of memory{detail}: free memory, lower the parallelism or use a larger machine")
    error.__cause__ = exc
    return error


def exit_status(exc: BulletinError | MemoryError) -> int:
    """The exit status for ``exc`` (see :data:`EXIT_CODES`; a ``MemoryError`` exits as
    :class:`~bulletin.errors.OutOfMemory`)."""
    error = as_bulletin_error(exc)
    return next(code for kind, code in EXIT_CODES if isinstance(error, kind))


def to_jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(asdict(value))
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Path):
        return str(value)
    return value


@dataclass(slots=True)
class Output:
    """How one invocation prints: text for people, or JSON documents on stdout.

    Mutable on purpose: the group creates it, and a command's own ``--json`` may
    switch it on after the group has run.
    """

    json: bool = False

    def emit(self, data: Any, human: Callable[[], None]) -> None:
        """JSON on stdout under ``--json``, else whatever ``human`` prints."""
        if self.json:
            click.echo(json.dumps(to_jsonable(data), indent=2, sort_keys=True))
        else:
            human()

    def say(self, line: str) -> None:
        """A progress line for people; nothing under ``--json`` (stdout holds the document)."""
        if not self.json:
            click.echo(line)

    def error(self, exc: BulletinError | MemoryError) -> int:
        """Print ``exc`` as one line (stderr, or a JSON document on stdout); return the exit status."""
        exc = as_bulletin_error(exc)
        message = str(exc).replace("\n", " ")
        if self.json:
            click.echo(json.dumps({"error": {"code": exc.code, "type": type(exc).__name__, "message": message}}))
        else:
            click.echo(f"error: {exc.code}: {message}", err=True)
        return exit_status(exc)

    @property
    def progress(self) -> bool:
        """Whether running counters may be drawn on stderr (a terminal, and not ``--json``)."""
        return not self.json and sys.stderr.isatty()


#: Passes the invocation's :class:`Output` as a command's first argument.
pass_output = click.make_pass_decorator(Output, ensure=True)


def _set_json(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    # Only ever switch on: a command without --json keeps the group's --json.
    if value:
        ctx.ensure_object(Output).json = True


def json_option(func: F) -> F:
    """``--json``: print one JSON document on stdout instead of text (group or command)."""
    return click.option(
        "--json",
        is_flag=True,
        is_eager=True,
        expose_value=False,
        callback=_set_json,
        help="Print machine-readable JSON on stdout.",
    )(func)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover
