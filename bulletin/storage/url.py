"""Open a store from a URL.

==========================================================  =================================
URL                                                         store
==========================================================  =================================
``/abs/path``, ``rel/path``, ``file:///abs/path``           :class:`LocalStore` (the default)
``memory://name[/prefix]``                                  :class:`MemoryStore`, shared per
                                                            name within one process
``s3://bucket[/prefix][?endpoint_url=...&region=...]``      :class:`S3Store`
==========================================================  =================================

S3 query parameters: ``endpoint_url``, ``region``, ``profile``, ``addressing_style``
(auto, path, virtual), ``max_attempts``, ``retry_mode`` (standard, adaptive),
``connect_timeout``, ``read_timeout`` (seconds), ``max_pool_connections``,
``page_size``. Credentials never go in the URL: the standard AWS environment
(``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ...) provides them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from bulletin.errors import ConfigError
from bulletin.storage.base import Store
from bulletin.storage.local import LocalStore
from bulletin.storage.memory import MemoryStore

if TYPE_CHECKING:
    from bulletin.storage.s3 import S3Store

__all__ = ["open_store"]

_SCHEME_RE: Final = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_KNOWN_SCHEMES: Final = frozenset({"file", "memory", "s3", "s3a", "http", "https", "gs", "az"})


def _text(name: str) -> Callable[[str], str]:
    return lambda v: v


def _int(name: str) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"S3 URL parameter {name} must be an integer, got {value!r}") from None

    return parse


def _float(name: str) -> Callable[[str], float]:
    def parse(value: str) -> float:
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"S3 URL parameter {name} must be a number, got {value!r}") from None

    return parse


_S3_PARAMS: Final[dict[str, Callable[[str], Any]]] = {
    "endpoint_url": _text("endpoint_url"),
    "region": _text("region"),
    "profile": _text("profile"),
    "addressing_style": _text("addressing_style"),
    "retry_mode": _text("retry_mode"),
    "max_attempts": _int("max_attempts"),
    "max_pool_connections": _int("max_pool_connections"),
    "page_size": _int("page_size"),
    "connect_timeout": _float("connect_timeout"),
    "read_timeout": _float("read_timeout"),
}


def _no_query(parts: SplitResult, url: str) -> None:
    if parts.query or parts.fragment:
        raise ConfigError(f"{parts.scheme}:// store URLs take no query or fragment: {url!r}")


def _open_file(parts: SplitResult, url: str) -> LocalStore:
    _no_query(parts, url)
    if parts.netloc not in {"", "localhost"}:
        raise ConfigError(f"file:// URLs must name a local absolute path (file:///...): {url!r}")
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise ConfigError(f"file:// URLs must name an absolute path: {url!r}")
    return LocalStore(path)


def _open_memory(parts: SplitResult, url: str) -> MemoryStore:
    _no_query(parts, url)
    if not parts.netloc:
        raise ConfigError(f"memory:// URLs need a name (memory://name): {url!r}")
    return MemoryStore(unquote(parts.netloc), unquote(parts.path))


def _open_s3(parts: SplitResult, url: str) -> S3Store:
    if "@" in parts.netloc:
        raise ConfigError(
            "S3 URLs must not carry credentials; use AWS_ACCESS_KEY_ID / AWS_PROFILE / roles"
        )
    if not parts.netloc:
        raise ConfigError(f"S3 URLs need a bucket (s3://bucket/prefix): {url!r}")
    if parts.fragment:
        raise ConfigError(f"S3 URLs take no fragment: {url!r}")
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as exc:
        raise ConfigError(f"malformed query in S3 URL {url!r}: {exc}") from None
    options: dict[str, Any] = {}
    for name, value in pairs:
        parse = _S3_PARAMS.get(name)
        if parse is None:
            known = ", ".join(sorted(_S3_PARAMS))
            raise ConfigError(f"unknown S3 URL parameter {name!r} (known: {known})")
        if name in options:
            raise ConfigError(f"S3 URL parameter {name!r} given twice")
        if not value:
            raise ConfigError(f"S3 URL parameter {name!r} is empty")
        options[name] = parse(value)

    from bulletin.storage.s3 import S3Store  # boto3 is slow to import: only when needed

    return S3Store(parts.netloc, unquote(parts.path), **options)


def open_store(url: str | os.PathLike[str]) -> Store:
    """Open the store that ``url`` names (see the module's table); ``ConfigError`` if it cannot.

    Opening sends no request and creates nothing: a missing bucket or a directory
    that cannot be written shows on first use.
    """
    if isinstance(url, os.PathLike):
        return LocalStore(url)
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"a store URL must be a non-empty string or a path, got {url!r}")
    scheme_match = _SCHEME_RE.match(url)
    if "://" not in url:
        # "s3:bucket" or "memory:x" would otherwise quietly become a local directory.
        if scheme_match and scheme_match.group(1).lower() in _KNOWN_SCHEMES:
            raise ConfigError(f"malformed store URL {url!r} (expected {scheme_match.group(1)}://...)")
        return LocalStore(url)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        return _open_file(parts, url)
    if scheme == "memory":
        return _open_memory(parts, url)
    if scheme == "s3":
        return _open_s3(parts, url)
    raise ConfigError(
        f"unsupported store URL scheme {parts.scheme!r} in {url!r} "
        "(use a path, file:///abs/path, memory://name or s3://bucket/prefix)"
    )
