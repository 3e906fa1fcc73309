"""Options that several commands share, defined once.

``--store`` and ``--run`` name a run in a store for every command that reads or
writes one (``publish``, ``sync``, ``log``, ``status``, ``verify``, ``gc``, ``serve``).
S3 settings travel in the store URL's query (``?endpoint_url=...&region=...``, see
:mod:`bulletin.storage.url`) and the standard AWS environment, so no command repeats
them as flags.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar

import click

__all__ = ["RUN_ENV", "STORE_ENV", "store_options"]

F = TypeVar("F", bound=Callable[..., Any])

STORE_ENV: Final = "BULLETIN_STORE"
RUN_ENV: Final = "BULLETIN_RUN"


def store_options(func: F) -> F:
    """``--store`` (or $BULLETIN_STORE) and ``--run`` (or $BULLETIN_RUN), passed as ``store`` and ``run``."""
    store = click.option(
        "--store",
        envvar=STORE_ENV,
        required=True,
        help=f"Local directory, file://, s3://bucket/prefix or memory://name [env: {STORE_ENV}].",
    )
    run = click.option("--run", envvar=RUN_ENV, required=True, help=f"Run name inside the store [env: {RUN_ENV}].")
    return store(run(func))
