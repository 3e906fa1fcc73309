"""Output for people and for machines (``--json``), and the one-line error format."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import click

from bulletin.errors import BulletinError

__all__ = ["emit", "emit_error", "human_bytes", "json_option", "to_jsonable"]

F = TypeVar("F", bound=Callable[..., Any])

_state = {"json": False}


def _set_json(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    _state["json"] = bool(value)
    return bool(value)


def json_option(func: F) -> F:
    """``--json``: print one JSON document on stdout instead of text."""
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        is_eager=True,
        callback=_set_json,
        help="Print machine-readable JSON on stdout.",
    )(func)


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


def emit(data: Any, human: Callable[[], None]) -> None:
    """JSON on stdout under ``--json``, else whatever ``human`` prints."""
    if _state["json"]:
        click.echo(json.dumps(to_jsonable(data), indent=2, sort_keys=True))
    else:
        human()


def emit_error(exc: BulletinError) -> None:
    message = str(exc).replace("\n", " ")
    if _state["json"]:
        click.echo(json.dumps({"error": {"code": exc.code, "type": type(exc).__name__, "message": message}}))
    else:
        click.echo(f"error: {exc.code}: {message}", err=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def progress_enabled() -> bool:
    return not _state["json"] and sys.stderr.isatty()
