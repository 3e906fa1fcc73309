"""HTTP(S) sites and CDNs as read-only stores (``https://host/path``), through fsspec's
``HTTPFileSystem``: its aiohttp session, ``client_kwargs`` and request options
(``headers``, ``ssl``, ``auth``...).

The requests are this module's own, sent on that session: fsspec's ``info`` turns
every failure (unreachable, ``403``, ``5xx``) into ``FileNotFoundError`` and its
``cat_file`` cannot send a conditional GET (fsspec 2026.9.0,
``fsspec/implementations/http.py``, ``HTTPFileSystem._info`` / ``_cat_file``). So:

- ``get``: one GET. A ``Content-Length`` over ``max_bytes`` is refused before the body
  is read (unless the body is content-encoded: then the bound applies to the decoded
  bytes as they stream in). The ETag is the server's, or the SHA-256 of the bytes
  where it sends none.
- ``get_if_changed``: one GET with ``If-None-Match: <etag>``; an unchanged object is a
  ``304`` with no body. Without a server ETag the object is read whole and compared.
- ``stat``: one HEAD.
- ``list``: the server's directory index pages (links in HTML; a link ending in ``/``,
  or whose text does, is a subdirectory), one GET per directory, then one HEAD per
  object for its size. A server without indexes (most CDNs) serves ``sync`` but not
  ``log`` / ``verify``: a directory it answers ``404`` lists as empty, ``403`` is
  ``AccessDenied``.

Connection errors, timeouts, ``429`` and ``5xx`` are retried (3 attempts, jittered
backoff); ``404`` / ``410`` are ``NotFound``, ``401`` / ``403`` ``AccessDenied``. Every
write is refused (``StoreNotWritable``): HTTP gives no create-only or compare-and-swap
that a static site honours.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from html.parser import HTMLParser
from typing import TYPE_CHECKING, Any, Final, TypeVar
from urllib.parse import quote, unquote, urljoin, urlsplit

import aiohttp
import yarl

from bulletin.errors import AccessDenied, BulletinError, ConfigError, NotFound, StorageUnavailable
from bulletin.storage.base import Downloaded, ObjectData, ObjectInfo
from bulletin.storage.files import FileSink, check_path, check_sha256
from bulletin.storage.fsspec_store import DIGEST_ETAG_PREFIX, FsspecStore, content_etag, fs_error, listable_key
from bulletin.storage.keys import check_key, check_max_bytes, too_large

if TYPE_CHECKING:
    from fsspec.implementations.http import HTTPFileSystem

__all__ = ["HttpStore"]

_ATTEMPTS: Final = 3
#: Objects whose size a listing asks for at once (one HEAD each).
_HEADS_AT_ONCE: Final = 32
#: Bytes per read of a bounded body, and the most a directory index page may hold.
_CHUNK: Final = 1 << 20
_INDEX_BYTES: Final = 64 << 20
#: Unless the filesystem's options set their own: no total limit (a keyframe may be GBs).
_TIMEOUT: Final = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60)

_T = TypeVar("_T")


class _Retryable(Exception):
    """An answer worth asking again (429, 5xx); ``status`` is read by ``fs_error``."""

    def __init__(self, status: int, context: str) -> None:
        super().__init__(f"{context}: HTTP {status}")
        self.status = status


@dataclass(frozen=True, slots=True)
class _Answer:
    status: int
    data: bytes
    headers: Mapping[str, str]


class _Links(HTMLParser):
    """Every ``<a href>`` of a page, and whether it names a directory (it or its text ends in ``/``)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[tuple[str, bool]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")
            self._text = []

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._href is not None:
            self.links.append((self._href, self._href.endswith("/") or "".join(self._text).strip().endswith("/")))
            self._href = None


def _status_error(status: int, context: str) -> BulletinError | _Retryable:
    if status in {404, 410}:
        return NotFound(f"{context}: no such object (HTTP {status})")
    if status in {401, 403}:
        return AccessDenied(f"{context}: HTTP {status} (check the credentials or headers in the storage options)")
    if status == 429 or status >= 500:
        return _Retryable(status, context)
    return StorageUnavailable(f"{context}: unexpected HTTP {status}")


def _http_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        parsed = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return parsed.astimezone(UTC) if parsed.tzinfo else parsed.replace(tzinfo=UTC)


class HttpStore(FsspecStore):
    """A read-only store at an ``http(s)://`` URL (a static site, a CDN, a bucket's website).

    ``fs`` is an fsspec ``HTTPFileSystem``: its session and request options are used for
    every request. Safe to share between threads; creating it sends nothing.
    """

    __slots__ = ("_session",)

    def __init__(self, fs: HTTPFileSystem, root: str, *, url: str | None = None) -> None:
        parts = urlsplit(root)
        if parts.scheme not in {"http", "https"} or not parts.hostname:
            raise ConfigError(f"not an http(s) URL with a host: {root!r}")
        if parts.username is not None or parts.password is not None:
            raise ConfigError("HTTP store URLs must not carry credentials; put headers or auth in the storage options")
        if parts.query or parts.fragment:
            raise ConfigError(f"an HTTP store's root takes no query or fragment: {root!r}")
        super().__init__(fs, root, url=url if url is not None else root.rstrip("/"))
        self._session: aiohttp.ClientSession | None = None

    def close(self) -> None:
        """Close the filesystem's HTTP session (if a request opened it). Idempotent."""
        if not self._closed and self._session is not None:
            type(self._fs).close_session(self._fs.loop, self._session)
        super().close()

    # -- plumbing ---------------------------------------------------------------------

    def _url_of(self, key: str) -> str:
        return f"{self._root}/{quote(check_key(key), safe='/')}"

    def _run(self, context: str, request: Callable[..., Coroutine[Any, Any, _T]], *args: Any) -> _T:
        """``request(*args)`` on the filesystem's event loop, retried while worth it, translated."""
        from fsspec.asyn import sync

        attempt = 1
        while True:
            try:
                return sync(self._fs.loop, request, *args)  # type: ignore[no-any-return]
            except BulletinError:
                raise
            except aiohttp.ClientSSLError as exc:  # retrying cannot help
                raise StorageUnavailable(
                    f"{context}: TLS failed: {exc} (a private CA: set SSL_CERT_FILE, or ssl= in the options)"
                ) from exc
            except (_Retryable, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
                if attempt >= _ATTEMPTS:
                    raise fs_error(exc, context) from exc
            except aiohttp.ClientError as exc:
                raise fs_error(exc, context) from exc
            time.sleep(random.uniform(0, 0.1 * 2**attempt))
            attempt += 1

    def _options(self, headers: Mapping[str, str]) -> dict[str, Any]:
        """The filesystem's request options with ``headers`` added."""
        options = dict(self._fs.kwargs)
        merged = dict(options.pop("headers", None) or {})
        merged.update(headers)
        options.setdefault("timeout", _TIMEOUT)
        options["headers"] = merged
        return options

    async def _open_session(self) -> aiohttp.ClientSession:
        session: aiohttp.ClientSession = await self._fs.set_session()
        self._session = session
        return session

    async def _get(self, url: str, context: str, if_none_match: str | None, max_bytes: int | None) -> _Answer:
        session = await self._open_session()
        headers = {} if if_none_match is None else {"If-None-Match": if_none_match}
        async with session.get(yarl.URL(url, encoded=True), **self._options(headers)) as response:
            if response.status == 304:
                return _Answer(304, b"", response.headers)
            if response.status != 200:
                raise _status_error(response.status, context)  # the body is dropped unread
            identity = response.headers.get("Content-Encoding", "identity").strip().lower() in {"", "identity"}
            length = response.content_length if identity else None  # else the encoded length
            if max_bytes is not None and length is not None and length > max_bytes:
                raise too_large(context, length, max_bytes)
            if max_bytes is None or length is not None:  # aiohttp never reads past Content-Length
                return _Answer(200, await response.read(), response.headers)
            chunks: list[bytes] = []
            total = 0
            async for chunk in response.content.iter_chunked(_CHUNK):
                total += len(chunk)
                if total > max_bytes:
                    raise too_large(context, None, max_bytes)
                chunks.append(chunk)
            return _Answer(200, b"".join(chunks), response.headers)

    async def _stream(self, url: str, context: str, sink: FileSink) -> str | None:
        """One GET whose body streams into ``sink`` (its writes off the event loop); the
        response's ETag. Each attempt starts the file again from its first byte."""
        session = await self._open_session()
        sink.reset()
        async with session.get(yarl.URL(url, encoded=True), **self._options({})) as response:
            if response.status != 200:
                raise _status_error(response.status, context)
            identity = response.headers.get("Content-Encoding", "identity").strip().lower() in {"", "identity"}
            length = response.content_length if identity else None
            if sink.max_bytes is not None and length is not None and length > sink.max_bytes:
                raise too_large(context, length, sink.max_bytes)
            async for chunk in response.content.iter_chunked(_CHUNK):
                await asyncio.to_thread(sink.write, chunk)
            return response.headers.get("ETag")

    async def _head(self, url: str, context: str) -> _Answer:
        session = await self._open_session()
        options = self._options({"Accept-Encoding": "identity"})  # the stored size, not an encoding's
        async with session.head(yarl.URL(url, encoded=True), allow_redirects=True, **options) as response:
            if response.status != 200:
                raise _status_error(response.status, context)
            return _Answer(200, b"", response.headers)

    async def _heads(self, targets: list[tuple[str, str]]) -> list[_Answer | None]:
        """HEADs at once; None for an object gone since the listing."""
        answers = await asyncio.gather(*(self._head(url, context) for url, context in targets), return_exceptions=True)
        out: list[_Answer | None] = []
        for answer in answers:
            if isinstance(answer, NotFound):
                out.append(None)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                out.append(answer)
        return out

    def _info_of(self, key: str, headers: Mapping[str, str]) -> ObjectInfo:
        length = headers.get("Content-Length", "")
        if not length.isdigit():
            raise StorageUnavailable(f"{self._where(key)}: the server sent no Content-Length for it")
        return ObjectInfo(key, int(length), headers.get("ETag"), _http_time(headers.get("Last-Modified")))

    # -- reads ------------------------------------------------------------------------

    def _read(self, key: str, if_changed_from: str | None, max_bytes: int | None) -> ObjectData | None:
        self._check_open()
        context = self._where(key)
        # Our own (content) ETags mean nothing to the server: those are compared after reading.
        ask = None if if_changed_from is None or if_changed_from.startswith(DIGEST_ETAG_PREFIX) else if_changed_from
        answer = self._run(context, self._get, self._url_of(key), context, ask, max_bytes)
        if answer.status == 304:
            if ask is None:
                raise StorageUnavailable(f"{context}: 'not modified' answered to an unconditional GET")
            return None
        etag = answer.headers.get("ETag") or content_etag(answer.data)
        if etag == if_changed_from:  # also a server that ignores If-None-Match
            return None
        return ObjectData(answer.data, etag)

    def get_to_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        sha256: str | None = None,
        max_bytes: int | None = None,
    ) -> Downloaded:
        """One GET streamed to ``path`` (``Content-Length`` over ``max_bytes`` refused before
        the body), hashed as it arrives; the ETag is the server's or the SHA-256."""
        self._check_open()
        expected = check_sha256(sha256)
        bound = check_max_bytes(max_bytes)
        target = check_path(path)
        context = self._where(key)
        with FileSink(target, context=context, max_bytes=bound) as sink:
            etag = self._run(context, self._stream, self._url_of(key), context, sink)
            done = sink.finish(etag or "", sha256=expected)
        return done if done.etag else Downloaded(done.size, DIGEST_ETAG_PREFIX + done.sha256, done.sha256)

    def stat(self, key: str) -> ObjectInfo:
        """Size, ETag and modification time from one HEAD; ``NotFound`` if absent."""
        self._check_open()
        context = self._where(key)
        answer = self._run(context, self._head, self._url_of(key), context)
        return self._info_of(key, answer.headers)

    def _list(self, prefix: str, after: str | None) -> Iterator[ObjectInfo]:
        keys = sorted(k for k in self._walk(prefix.rpartition("/")[0]) if k.startswith(prefix))
        keys = [k for k in keys if after is None or k > after]
        for first in range(0, len(keys), _HEADS_AT_ONCE):
            batch = keys[first : first + _HEADS_AT_ONCE]
            targets = [(self._url_of(key), self._where(key)) for key in batch]
            answers = self._run(f"{self.url}: listing {prefix!r}", self._heads, targets)
            for key, answer in zip(batch, answers, strict=True):
                if answer is not None:
                    yield self._info_of(key, answer.headers)

    def _walk(self, directory: str) -> set[str]:
        """Every key below ``directory`` (``""``: the root), from the index pages."""
        keys: set[str] = set()
        pending, seen = [directory], set()
        while pending:
            current = pending.pop()
            if current in seen:
                continue
            seen.add(current)
            for name, is_directory in self._index(current):
                child = f"{current}/{name}" if current else name
                if is_directory:
                    pending.append(child)
                elif listable_key(child):
                    keys.add(child)
        return keys

    def _index(self, directory: str) -> list[tuple[str, bool]]:
        """The entries ``(name, is a directory)`` of one directory's index page; none if it is absent."""
        page = f"{self._root}/{quote(directory, safe='/')}/" if directory else f"{self._root}/"
        context = f"{self.url}: the index of {directory or '/'!r}"
        try:
            answer = self._run(context, self._get, page, context, None, _INDEX_BYTES)
        except NotFound:
            return []  # as S3 lists a prefix nothing is under
        except AccessDenied as exc:
            raise AccessDenied(
                f"{exc} (the server refuses directory listings: sync works, log and verify do not)"
            ) from exc
        kind = answer.headers.get("Content-Type", "text/html").split(";")[0].strip().lower()
        if kind != "text/html":
            raise StorageUnavailable(f"{context}: not a directory index (Content-Type {kind})")
        parser = _Links()
        parser.feed(answer.data.decode("utf-8", errors="replace"))
        base = urlsplit(page)
        base_path = unquote(base.path)
        entries = []
        for href, is_directory in parser.links:
            target = urlsplit(urljoin(page, href))
            path = unquote(target.path)
            if (target.scheme, target.netloc) != (base.scheme, base.netloc) or not path.startswith(base_path):
                continue  # another site, or a parent ("../")
            rest = path[len(base_path) :]
            name = rest.strip("/")
            if name and "/" not in name:  # an index lists its own entries only
                entries.append((name, is_directory or rest.endswith("/")))
        return entries
