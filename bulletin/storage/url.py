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


#: S3 URL parameters and the type each one is parsed as.
_S3_PARAMS: Final[dict[str, type[str] | type[int] | type[float]]] = {
    "endpoint_url": str,
    "region": str,
    "profile": str,
    "addressing_style": str,
    "retry_mode": str,
    "max_attempts": int,
    "max_pool_connections": int,
    "page_size": int,
    "connect_timeout": float,
    "read_timeout": float,
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
        raise ConfigError("S3 URLs must not carry credentials; use AWS_ACCESS_KEY_ID / AWS_PROFILE / roles")
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
        kind = _S3_PARAMS.get(name)
        if kind is None:
            known = ", ".join(sorted(_S3_PARAMS))
            raise ConfigError(f"unknown S3 URL parameter {name!r} (known: {known})")
        if name in options:
            raise ConfigError(f"S3 URL parameter {name!r} given twice")
        if not value:
            raise ConfigError(f"S3 URL parameter {name!r} is empty")
        try:
            options[name] = kind(value)
        except ValueError:
            raise ConfigError(
                f"S3 URL parameter {name} must be {'an integer' if kind is int else 'a number'}, got {value!r}"
            ) from None

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
