"""Open a store from a URL.

==========================================================  =================================
URL                                                         store
==========================================================  =================================
``/abs/path``, ``rel/path``, ``file:///abs/path``           :class:`LocalStore` (the default)
``memory://name[/prefix]``                                  :class:`MemoryStore`, shared per
                                                            name within one process
``s3://bucket[/prefix][?endpoint_url=...&region=...]``      :class:`S3Store`
``fsspec+s3://bucket[/prefix][?option=value&...]``          :class:`S3fsStore` (s3fs)
``http(s)://host/path``, ``fsspec+http(s)://host/path``     :class:`HttpStore`, read-only
``fsspec+<protocol>://path[?option=value&...]``; ``gs://``,  :class:`FsspecStore`, read-only
``gcs://``, ``az://``, ``abfs://``, ``abfss://``, ``hf://``
==========================================================  =================================

S3 query parameters: ``endpoint_url``, ``region``, ``profile``, ``addressing_style``
(auto, path, virtual), ``max_attempts``, ``retry_mode`` (standard, adaptive),
``connect_timeout``, ``read_timeout`` (seconds), ``max_pool_connections``,
``page_size``, ``multipart_threshold``, ``part_size`` (bytes), ``transfer_workers``.
Credentials never go in the URL: the standard AWS environment (``AWS_ACCESS_KEY_ID``,
``AWS_PROFILE``, ...) provides them.

fsspec URLs: the query holds the filesystem's storage options, each value read as JSON
where it is JSON (``anon=true``, ``client_kwargs={"region_name":"eu-west-1"}``, a quoted
``"1"``) and as text otherwise. An option whose name says it is a secret (``key``,
``secret``, ``token``, ``password``, ``credential``, ``auth``, ``sas``, ``signature``,
``cookie``, ``connection_string``, at any depth) is refused there: secrets come from
fsspec's own configuration (``FSSPEC_<PROTOCOL>`` JSON in the environment, files in
``FSSPEC_CONFIG_DIR``) or the backend's usual environment.
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import SplitResult, parse_qsl, quote, unquote, urlsplit

from bulletin.errors import ConfigError
from bulletin.storage.base import Store
from bulletin.storage.local import LocalStore
from bulletin.storage.memory import MemoryStore

if TYPE_CHECKING:
    from bulletin.storage.s3 import S3Store

__all__ = ["open_store"]

_SCHEME_RE: Final = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
#: Schemes that go to fsspec without the ``fsspec+`` mark (``s3://`` stays boto3's).
_FSSPEC_SCHEMES: Final = frozenset({"http", "https", "gs", "gcs", "az", "abfs", "abfss", "hf"})
_FSSPEC_MARK: Final = "fsspec+"
_KNOWN_SCHEMES: Final = frozenset({"file", "memory", "s3", "s3a"} | _FSSPEC_SCHEMES)
#: Storage option names that carry secrets: refused in a URL, at any depth.
_SECRET_OPTION_RE: Final = re.compile(
    r"key|secret|token|passw|credential|auth|sas|signature|cookie|connection_string", re.IGNORECASE
)
#: Where a ``user@`` in the authority names an account or container, not a credential.
_ACCOUNT_IN_AUTHORITY: Final = frozenset({"az", "abfs", "abfss"})


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
    "multipart_threshold": int,
    "part_size": int,
    "transfer_workers": int,
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


def _query(parts: SplitResult, url: str) -> list[tuple[str, str]]:
    """The query's ``(name, value)`` pairs, each name once; ``ConfigError`` if malformed."""
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as exc:
        raise ConfigError(f"malformed query in store URL {url!r}: {exc}") from None
    names = [name for name, _ in pairs]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"URL parameter {name!r} given twice in {url!r}")
    return pairs


def _open_s3(parts: SplitResult, url: str) -> S3Store:
    if "@" in parts.netloc:
        raise ConfigError("S3 URLs must not carry credentials; use AWS_ACCESS_KEY_ID / AWS_PROFILE / roles")
    if not parts.netloc:
        raise ConfigError(f"S3 URLs need a bucket (s3://bucket/prefix): {url!r}")
    if parts.fragment:
        raise ConfigError(f"S3 URLs take no fragment: {url!r}")
    options: dict[str, Any] = {}
    for name, value in _query(parts, url):
        kind = _S3_PARAMS.get(name)
        if kind is None:
            known = ", ".join(sorted(_S3_PARAMS))
            raise ConfigError(f"unknown S3 URL parameter {name!r} (known: {known})")
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


def _option_value(text: str) -> Any:
    """A storage option from a URL query: JSON where it parses as JSON, else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _option_text(value: Any) -> str:
    """The inverse of :func:`_option_value`, for the canonical URL."""
    if isinstance(value, str) and not isinstance(_option_value(value), str):
        return json.dumps(value)  # text that would read back as JSON: quoted
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), sort_keys=True)


def _check_no_secrets(options: Any, url: str, path: str = "") -> None:
    if isinstance(options, dict):
        for name, value in options.items():
            where = f"{path}.{name}" if path else str(name)
            if _SECRET_OPTION_RE.search(str(name)):
                raise ConfigError(
                    f"store URLs must not carry secrets: storage option {where!r} in {url!r}; "
                    "set it in FSSPEC_<PROTOCOL> (JSON) or the backend's own environment"
                )
            _check_no_secrets(value, url, where)
    elif isinstance(options, list):
        for item in options:
            _check_no_secrets(item, url, path)
    elif isinstance(options, str) and "://" in options and "@" in urlsplit(options).netloc:
        raise ConfigError(f"store URLs must not carry credentials: storage option {path!r} in {url!r}")


def _fsspec_options(parts: SplitResult, url: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for name, text in _query(parts, url):
        if name == "skip_instance_cache":
            raise ConfigError("skip_instance_cache is Bulletin's to set (every store has its own filesystem)")
        options[name] = _option_value(text)
    _check_no_secrets(options, url)
    return options


def _open_fsspec(parts: SplitResult, url: str) -> Store:
    scheme = parts.scheme.lower()
    protocol = scheme.removeprefix(_FSSPEC_MARK)
    if not re.fullmatch(r"[a-z][a-z0-9.-]*", protocol):
        raise ConfigError(f"fsspec store URLs look like fsspec+<protocol>://...: {url!r}")
    user, at, _ = parts.netloc.rpartition("@")
    if at and (protocol not in _ACCOUNT_IN_AUTHORITY or ":" in user):
        raise ConfigError(f"store URLs must not carry credentials: {url!r}")
    if parts.fragment or "::" in url:
        raise ConfigError(f"fsspec store URLs take no fragment and no chained filesystems (::): {url!r}")
    options = _fsspec_options(parts, url)
    location = f"{parts.netloc}{parts.path}".rstrip("/")
    query = "&".join(f"{quote(k, safe='')}={quote(_option_text(v), safe=':/')}" for k, v in sorted(options.items()))
    canonical = f"{scheme}://{location}" + (f"?{query}" if query else "")

    from bulletin.storage.fsspec_store import open_fsspec  # fsspec (and s3fs) only when needed

    return open_fsspec(f"{protocol}://{location}", options, canonical=canonical)


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
        if scheme_match and (
            scheme_match.group(1).lower() in _KNOWN_SCHEMES or scheme_match.group(1).lower().startswith(_FSSPEC_MARK)
        ):
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
    if scheme.startswith(_FSSPEC_MARK) or scheme in _FSSPEC_SCHEMES:
        return _open_fsspec(parts, url)
    raise ConfigError(
        f"unsupported store URL scheme {parts.scheme!r} in {url!r} (use a path, file:///abs/path, "
        "memory://name, s3://bucket/prefix, https://host/path, or fsspec+<protocol>://... for any fsspec filesystem)"
    )
