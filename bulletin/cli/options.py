"""Options that several commands share, defined once.

``--store`` and ``--run`` name a run in a store for every command that reads or
writes one (``publish``, ``sync``, ``log``, ``status``, ``verify``, ``gc``, ``serve``).
The subscriber's commands (``sync``, ``status``, ``serve``) take ``--store`` repeated
(:func:`stores_options`): copies of the run in preference order, a region's mirror first
and the origin last (:mod:`bulletin.sources`).
S3 settings travel in the store URL's query (``?endpoint_url=...&region=...``, see
:mod:`bulletin.storage.url`) and the standard AWS environment, so no command repeats
them as flags.

``--trusted-key`` / ``--max-head-age`` (:func:`trust_options`) make a reader take only
signed versions (``sync``, ``serve``, ``log``, ``verify``, ``status``); ``--signing-key``
(:func:`signing_option`) makes ``publish`` sign what it writes (docs/SECURITY.md).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TypeVar

import click

__all__ = [
    "MAX_HEAD_AGE_ENV",
    "RUN_ENV",
    "SERVED_DTYPES",
    "SIGNING_KEY_FILE_ENV",
    "STORE_ENV",
    "TRUSTED_KEYS_ENV",
    "dtype_option",
    "files_options",
    "signing_option",
    "store_options",
    "stores_options",
    "trust_options",
]

F = TypeVar("F", bound=Callable[..., Any])

STORE_ENV: Final = "BULLETIN_STORE"
RUN_ENV: Final = "BULLETIN_RUN"
# The same names as bulletin.signing's (tests check it); not imported, so that the CLI
# starts without the crypto library.
TRUSTED_KEYS_ENV: Final = "BULLETIN_TRUSTED_KEYS"
MAX_HEAD_AGE_ENV: Final = "BULLETIN_MAX_HEAD_AGE"
SIGNING_KEY_FILE_ENV: Final = "BULLETIN_SIGNING_KEY_FILE"


#: What --store takes (bulletin/storage/url.py has the whole table).
_STORE_URLS: Final = (
    "Local directory, file://, s3://bucket/prefix, memory://name, or an fsspec URL "
    "(https://..., gs://..., az://..., hf://..., fsspec+<protocol>://...; read-only unless fsspec+s3://)"
)


def store_options(func: F) -> F:
    """``--store`` (or $BULLETIN_STORE) and ``--run`` (or $BULLETIN_RUN), passed as ``store`` and ``run``."""
    store = click.option(
        "--store",
        envvar=STORE_ENV,
        required=True,
        help=f"{_STORE_URLS} [env: {STORE_ENV}].",
    )
    run = click.option("--run", envvar=RUN_ENV, required=True, help=f"Run name inside the store [env: {RUN_ENV}].")
    return store(run(func))


def stores_options(func: F) -> F:
    """``--store`` repeatable (or $BULLETIN_STORE, URLs separated by spaces), ``--run`` and
    ``--lag-grace``, passed as ``store`` (a tuple of URLs, in preference order), ``run``
    and ``lag_grace``."""
    store = click.option(
        "--store",
        envvar=STORE_ENV,
        required=True,
        multiple=True,
        help=f"{_STORE_URLS}; repeat it for copies of the run "
        f"(a mirror first, the origin last): read in that order, with fallback [env: {STORE_ENV}].",
    )
    run = click.option("--run", envvar=RUN_ENV, required=True, help=f"Run name inside the store [env: {RUN_ENV}].")
    grace = click.option(
        "--lag-grace",
        type=click.FloatRange(min=0),
        default=30.0,
        show_default=True,
        metavar="SECONDS",
        help="With several --store: how long the first may lack a version a later one shows before the later "
        "one is read instead (the other heads are polled this often).",
    )
    return store(run(grace(func)))


def trust_options(func: F) -> F:
    """``--trusted-key PATH`` (repeatable, or $BULLETIN_TRUSTED_KEYS, paths separated by
    ``:``) and ``--max-head-age SECONDS`` (or $BULLETIN_MAX_HEAD_AGE), passed as
    ``trusted_keys`` (a tuple of paths) and ``max_head_age``; build the policy with
    ``bulletin.signing.load_trust``."""
    keys = click.option(
        "--trusted-key",
        "trusted_keys",
        multiple=True,
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        envvar=TRUSTED_KEYS_ENV,
        help="Public key whose signatures this node accepts (repeatable; during a rotation, give both). "
        f"With one, unsigned, wrongly signed and rolled-back versions are refused (exit 13) [env: {TRUSTED_KEYS_ENV}].",
    )
    age = click.option(
        "--max-head-age",
        type=click.FloatRange(min=0, min_open=True),
        envvar=MAX_HEAD_AGE_ENV,
        default=None,
        metavar="SECONDS",
        help="Refuse a signed head older than this (a frozen head: newer versions withheld); needs "
        f"--trusted-key [env: {MAX_HEAD_AGE_ENV}].",
    )
    return keys(age(func))


#: ``--dtype`` choices that cast floating tensors -> the served dtype (safetensors name);
#: ``keep`` serves a checkpoint's dtypes as they are. The same names as patcher.dtypes'
#: SERVED_FLOAT_DTYPES (tests check it), not imported, so that the CLI starts fast.
SERVED_DTYPES: Final = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}


def dtype_option(func: F) -> F:
    """``--dtype`` (bf16, fp16, fp32 or keep; default bf16), passed as ``dtype``."""
    return click.option(
        "--dtype",
        type=click.Choice([*SERVED_DTYPES, "keep"]),
        default="bf16",
        show_default=True,
        help="Serve floating tensors in this dtype, cast as the Python Publisher casts a state dict "
        "(round to nearest even), with config.json's torch_dtype/dtype set to it; keep: as stored. "
        "Keep it the same for the whole run: a version that changes a tensor's dtype is a layout change, "
        "published as a keyframe.",
    )(func)


def files_options(func: F) -> F:
    """``--files/--no-files``, ``--include-file GLOB`` and ``--exclude-file GLOB`` (repeatable),
    passed as ``files``, ``include_files`` and ``exclude_files``."""
    files = click.option(
        "--files/--no-files",
        default=True,
        show_default=True,
        help="Publish a checkpoint folder's model files (config, generation config, tokenizer, chat "
        "template) with the version; without, or when it has none, the version keeps the previous one's.",
    )
    include = click.option(
        "--include-file",
        "include_files",
        multiple=True,
        metavar="GLOB",
        help="Also publish the folder's top-level files matching GLOB that are left out by default "
        "(e.g. '*.py' for remote code).",
    )
    exclude = click.option(
        "--exclude-file",
        "exclude_files",
        multiple=True,
        metavar="GLOB",
        help="Leave out the folder's files matching GLOB.",
    )
    return files(include(exclude(func)))


def signing_option(func: F) -> F:
    """``--signing-key PATH`` (or $BULLETIN_SIGNING_KEY_FILE), passed as ``signing_key``; without
    it, $BULLETIN_SIGNING_KEY (the key itself) still applies (``bulletin.signing.Signer.from_env``)."""
    return click.option(
        "--signing-key",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        envvar=SIGNING_KEY_FILE_ENV,
        default=None,
        help="Private key that signs every manifest and head written (bulletin keygen makes one) "
        f"[env: {SIGNING_KEY_FILE_ENV}, or BULLETIN_SIGNING_KEY holding the key].",
    )(func)
