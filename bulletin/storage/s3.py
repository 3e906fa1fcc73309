"""S3 store (``s3://bucket/prefix``) through boto3: AWS S3, MinIO, LocalStack, any endpoint.

Conditional writes go straight to S3's own preconditions, never check-then-write:
``put_if_absent`` is ``PutObject`` with ``If-None-Match: *`` and ``put_if_match`` is
``PutObject`` with ``If-Match: <etag>``; ``get_if_changed`` sends ``If-None-Match`` and
takes a ``304`` as "unchanged".

**The lost-response rule.** botocore re-sends a request whose connection failed,
conditional PUTs included. When the first attempt was applied but its response was
lost, the re-sent PUT fails its precondition (``412``) against our *own* object.
So every conditional PUT stamps a fresh write id in the object's metadata
(``x-amz-meta-bulletin-write-id``); on ``412``, or when the retries end in a
connection error, the object is read back (``HeadObject``) and the write is
``Updated`` if the stored write id is ours.

**Large objects** (:mod:`bulletin.storage.s3_transfer`): an object over
``multipart_threshold`` (64 MiB by default) is sent as a multipart upload completed with
``If-None-Match: *`` under the same write-id rule, and ``get_to_file`` reads objects by
parallel ranged GETs; both on the store's pool of ``transfer_workers`` threads.

One boto3 client is shared by all threads (boto3 clients are thread-safe); its
connection pool should be at least as large as the number of threads using it.
Throttling (``SlowDown``/``503``), ``5xx`` and connection errors are retried with
exponential backoff by botocore (``retry_mode`` standard or adaptive, up to
``max_attempts``). Credentials come from the standard AWS chain (environment,
profile, instance role); endpoints from ``endpoint_url`` or, as boto3 does itself,
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``.
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar
from urllib.parse import quote, urlencode, urlsplit

import boto3
import botocore.exceptions as bx
from botocore.config import Config
from botocore.handlers import set_list_objects_encoding_type_url
from urllib3.exceptions import HTTPError as Urllib3HTTPError

from bulletin import __version__
from bulletin.errors import (
    AccessDenied,
    BulletinError,
    ConfigError,
    InvalidInput,
    NotFound,
    StorageUnavailable,
)
from bulletin.storage.base import (
    Conflicted,
    Downloaded,
    ObjectData,
    ObjectInfo,
    StoreBase,
    Updated,
    WriteResult,
)
from bulletin.storage.files import FileRange, SourceFile, check_path, check_sha256, raise_source_failure
from bulletin.storage.keys import (
    check_data,
    check_etag,
    check_key,
    check_max_bytes,
    check_prefix,
    check_start_after,
    check_store_prefix,
    join_key,
    too_large,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

__all__ = ["WRITE_ID_METADATA", "S3Store", "translate_error"]

#: Metadata key (sent as ``x-amz-meta-bulletin-write-id``) of a conditional PUT's write id.
WRITE_ID_METADATA: Final = "bulletin-write-id"

AddressingStyle = Literal["auto", "path", "virtual"]
RetryMode = Literal["standard", "adaptive"]

_BUCKET_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]")
_REGION_RE: Final = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")

_DENIED_CODES: Final = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "AccountProblem",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidToken",
        "SignatureDoesNotMatch",
        "TokenRefreshRequired",
        "UnrecognizedClientException",
    }
)
_REGION_CODES: Final = frozenset(
    {"AuthorizationHeaderMalformed", "IllegalLocationConstraintException", "PermanentRedirect"}
)
_TOO_LARGE_CODES: Final = frozenset({"EntityTooLarge", "KeyTooLongError", "MetadataTooLarge"})
#: S3 answers 409 when two conditional writes on one key overlap; nothing was applied.
_CONDITIONAL_CONFLICT: Final = "ConditionalRequestConflict"

#: Errors raised while a response body streams in, after botocore's retries are over.
_STREAM_ERRORS: Final = (bx.BotoCoreError, Urllib3HTTPError, OSError)

#: Bytes per read of a body that came without a ``Content-Length`` (bounded reads only).
_CHUNK: Final = 1 << 20

#: Large-object defaults: objects above the threshold go as multipart uploads of parts of
#: this size, and every transfer of parts runs on this many threads per store.
DEFAULT_MULTIPART_THRESHOLD: Final = 64 << 20
DEFAULT_PART_SIZE: Final = 16 << 20
DEFAULT_TRANSFER_WORKERS: Final = 8
#: S3's least part size (every part but the last), and its most.
_MIN_PART: Final = 5 << 20
_MAX_PART: Final = 5 << 30

_T = TypeVar("_T")


def _status(exc: bx.ClientError) -> int | None:
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def _code(exc: bx.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def translate_error(exc: BaseException, context: str) -> BulletinError:
    """The :mod:`bulletin.errors` exception for a boto3/botocore error (set ``from exc``).

    ``NoSuchKey`` and other ``404`` s become ``NotFound``; a missing bucket, missing or
    wrong credentials and ``403`` s ``AccessDenied``; a bucket in another region or a
    server that does not implement a request ``ConfigError``; connection failures,
    throttling and ``5xx`` that outlived the retries ``StorageUnavailable``.
    """
    error: BulletinError
    if isinstance(exc, bx.ClientError):
        code, status = _code(exc), _status(exc)
        message = exc.response.get("Error", {}).get("Message", "") or ""
        detail = f"{context}: {code or status} {message}".rstrip()
        if code == "NoSuchBucket":
            error = AccessDenied(f"{context}: the bucket does not exist ({code})")
        elif code in _DENIED_CODES or status == 403:
            error = AccessDenied(f"{detail} (check the AWS credentials and the bucket's policy)")
        elif code in _REGION_CODES or status == 301:
            error = ConfigError(f"{detail} (the bucket lives in another region: set region=)")
        elif code == "InvalidBucketName":
            error = ConfigError(detail)
        elif code in {"NotImplemented", "NotImplementedError"} or status == 501:
            error = ConfigError(f"{detail} (the server does not implement this request)")
        elif code in _TOO_LARGE_CODES:
            error = InvalidInput(detail)
        elif code == "NoSuchKey" or status == 404:
            error = NotFound(detail)
        else:
            error = StorageUnavailable(detail)
    elif isinstance(
        exc,
        bx.NoCredentialsError
        | bx.PartialCredentialsError
        | bx.CredentialRetrievalError
        | bx.NoAuthTokenError
        | bx.TokenRetrievalError,
    ):
        error = AccessDenied(f"{context}: no usable AWS credentials ({exc})")
    elif isinstance(
        exc,
        bx.ProfileNotFound
        | bx.ConfigParseError
        | bx.NoRegionError
        | bx.InvalidRegionError
        | bx.InvalidConfigError
        | bx.InvalidRetryConfigurationError
        | bx.UnknownEndpointError,
    ):
        error = ConfigError(f"{context}: {exc}")
    elif isinstance(exc, bx.ParamValidationError):
        error = InvalidInput(f"{context}: {exc}")
    else:  # connection errors, timeouts, anything else from the transport
        error = StorageUnavailable(f"{context}: {type(exc).__name__}: {exc}")
    return error


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_positive(name: str, value: float, *, integer: bool, upper: float | None = None) -> None:
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type or not value > 0 or (upper is not None and value > upper):
        bound = "" if upper is None else f" and at most {upper:g}"
        raise ConfigError(f"{name} must be a positive {'int' if integer else 'number'}{bound}, got {value!r}")


def _check_endpoint(endpoint_url: str) -> str:
    parts = urlsplit(endpoint_url)
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise ConfigError(f"endpoint_url must be an http(s) URL with a host, got {endpoint_url!r}")
    if parts.username is not None or parts.password is not None:
        raise ConfigError("endpoint_url must not carry credentials; use the AWS environment")
    if parts.query or parts.fragment:
        raise ConfigError(f"endpoint_url must not have a query or fragment: {endpoint_url!r}")
    return endpoint_url.rstrip("/")


class S3Store(StoreBase):
    """A bucket (and optional key prefix) on any S3-compatible server.

    Args:
        bucket: the bucket's name; it must exist (a missing one is ``AccessDenied``).
        prefix: put before every key, transparently (``"runs/a"`` stores key ``x``
            at ``runs/a/x``).
        endpoint_url: for MinIO, LocalStack or any non-AWS server; else boto3's own
            resolution (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, then AWS).
        region: the bucket's region; else ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` / profile.
        profile: a named profile of the AWS config files; else ``AWS_PROFILE``.
        addressing_style: ``path`` or ``virtual`` hosting; boto3 picks when unset
            (path style for custom endpoints).
        max_attempts: attempts per request, the first included, before giving up.
        retry_mode: botocore's ``standard`` backoff, or ``adaptive`` (also rate-limits
            this client after throttling).
        connect_timeout, read_timeout: seconds.
        max_pool_connections: HTTP connections kept; at least the number of threads.
        page_size: keys per listing request (S3 caps it at 1000).
        multipart_threshold: objects larger than this (bytes) are sent as multipart
            uploads (create-only all the same); at most 5 GiB, S3's limit on one PUT.
        part_size: bytes per part of a multipart upload (5 MiB to 5 GiB; larger when
            10,000 parts would not hold the object) and per ranged GET of ``get_to_file``.
        transfer_workers: parts sent or fetched at once, on one pool per store; keep it
            at most ``max_pool_connections`` (less the bulk transfers run beside it).
        session: a ready boto3 session (for example with assumed-role credentials);
            ``profile`` must then be unset.

    Creating the store sends no request; a bad bucket or credentials show on first use.
    """

    __slots__ = (
        "_bucket",
        "_bucket_seen",
        "_client",
        "_max_attempts",
        "_multipart_threshold",
        "_page_size",
        "_part_size",
        "_pool",
        "_pool_lock",
        "_prefix",
        "_transfer_workers",
    )

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        addressing_style: AddressingStyle | None = None,
        max_attempts: int = 5,
        retry_mode: RetryMode = "standard",
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        max_pool_connections: int = 16,
        page_size: int = 1000,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
        part_size: int = DEFAULT_PART_SIZE,
        transfer_workers: int = DEFAULT_TRANSFER_WORKERS,
        session: boto3.session.Session | None = None,
    ) -> None:
        if not isinstance(bucket, str) or not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
            raise ConfigError(f"not a valid S3 bucket name: {bucket!r}")
        if endpoint_url is not None:
            endpoint_url = _check_endpoint(endpoint_url)
        if region is not None and not _REGION_RE.fullmatch(region):
            raise ConfigError(f"not a valid AWS region name: {region!r}")
        if addressing_style is not None:
            _check_choice("addressing_style", addressing_style, ("auto", "path", "virtual"))
        _check_choice("retry_mode", retry_mode, ("standard", "adaptive"))
        _check_positive("max_attempts", max_attempts, integer=True, upper=20)
        _check_positive("connect_timeout", connect_timeout, integer=False)
        _check_positive("read_timeout", read_timeout, integer=False)
        _check_positive("max_pool_connections", max_pool_connections, integer=True)
        _check_positive("page_size", page_size, integer=True, upper=1000)
        if session is not None and profile is not None:
            raise ConfigError("give either a boto3 session or a profile, not both")

        self._bind(
            bucket,
            check_store_prefix(prefix),
            max_attempts=max_attempts,
            page_size=page_size,
            multipart_threshold=multipart_threshold,
            part_size=part_size,
            transfer_workers=transfer_workers,
        )

        params: dict[str, str] = {}
        for name, value, default in (
            ("endpoint_url", endpoint_url, None),
            ("region", region, None),
            ("profile", profile, None),
            ("addressing_style", addressing_style, None),
            ("max_attempts", max_attempts, 5),
            ("retry_mode", retry_mode, "standard"),
            ("connect_timeout", connect_timeout, 5.0),
            ("read_timeout", read_timeout, 60.0),
            ("max_pool_connections", max_pool_connections, 16),
            ("page_size", page_size, 1000),
            ("multipart_threshold", multipart_threshold, DEFAULT_MULTIPART_THRESHOLD),
            ("part_size", part_size, DEFAULT_PART_SIZE),
            ("transfer_workers", transfer_workers, DEFAULT_TRANSFER_WORKERS),
        ):
            if value is not None and value != default:
                params[name] = f"{value:g}" if isinstance(value, float) else str(value)
        url = f"s3://{bucket}/{quote(self._prefix.rstrip('/'), safe='/')}".rstrip("/")
        super().__init__(url + (f"?{urlencode(sorted(params.items()), safe=':/')}" if params else ""))

        config = Config(
            retries={"mode": retry_mode, "total_max_attempts": max_attempts},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=max_pool_connections,
            tcp_keepalive=True,
            # A short agent keeps an idle poll (one conditional GET of the head) under 1 KB.
            user_agent=f"bulletin/{__version__}",
            s3={"addressing_style": addressing_style} if addressing_style else None,
        )
        try:
            boto_session = session if session is not None else boto3.session.Session(profile_name=profile)
            self._client: S3Client = boto_session.client(
                "s3", endpoint_url=endpoint_url, region_name=region, config=config
            )
        except (bx.BotoCoreError, ValueError) as exc:
            raise ConfigError(f"cannot configure an S3 client for {self.url}: {exc}") from exc
        # botocore asks for URL-encoded keys in listings by default. Our keys are
        # XML-safe (no control characters), so plain keys suffice, and some servers
        # mishandle the encoding: LocalStack 4.13 compares encoded keys with the raw
        # StartAfter / continuation token and silently drops non-ASCII keys.
        self._client.meta.events.unregister(
            "before-parameter-build.s3.ListObjectsV2", set_list_objects_encoding_type_url
        )

    def _bind(
        self,
        bucket: str,
        prefix: str,
        *,
        max_attempts: int,
        page_size: int,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
        part_size: int = DEFAULT_PART_SIZE,
        transfer_workers: int = DEFAULT_TRANSFER_WORKERS,
    ) -> None:
        """The state every request reads, apart from the client: one place for every way of
        making the store (boto3 here, s3fs in :mod:`bulletin.storage.fsspec_s3`)."""
        _check_positive("multipart_threshold", multipart_threshold, integer=True, upper=_MAX_PART)
        _check_positive("transfer_workers", transfer_workers, integer=True, upper=256)
        if isinstance(part_size, bool) or not isinstance(part_size, int) or not _MIN_PART <= part_size <= _MAX_PART:
            raise ConfigError(
                f"part_size must be an int from {_MIN_PART} (5 MiB) to {_MAX_PART} (5 GiB), got {part_size!r}"
            )
        self._bucket = bucket
        self._prefix = prefix
        self._max_attempts = max_attempts
        self._page_size = page_size
        self._multipart_threshold = multipart_threshold
        self._part_size = part_size
        self._transfer_workers = transfer_workers
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._bucket_seen = False  # set by any answer that proves the bucket exists

    def _transfers(self) -> ThreadPoolExecutor:
        """The store's pool for parts, made on first use: every large transfer shares it,
        so parts in flight never exceed ``transfer_workers`` however many callers."""
        with self._pool_lock:
            self._check_open()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._transfer_workers, thread_name_prefix="bulletin-s3-parts")
            return self._pool

    @property
    def bucket(self) -> str:
        """The bucket's name."""
        return self._bucket

    @property
    def prefix(self) -> str:
        """The key prefix, ``""`` or ending in ``/``."""
        return self._prefix

    @property
    def region(self) -> str | None:
        """The region requests are signed for (after boto3's own resolution)."""
        region = self._client.meta.region_name
        return None if region is None else str(region)

    @property
    def endpoint_url(self) -> str:
        """The endpoint requests actually go to (after boto3's own resolution)."""
        return str(self._client.meta.endpoint_url)

    def close(self) -> None:
        """Close the client's connection pool and the transfer threads. Idempotent."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if not self._closed:
            self._client.close()
        super().close()

    # -- plumbing ---------------------------------------------------------------------

    def _where(self, key: str) -> str:
        return f"{self.url}: {key!r}"

    def _call(self, context: str, fn: Callable[..., _T], **kwargs: Any) -> _T:
        """One client call; every exception translated, except conditional ``ClientError`` s."""
        try:
            result = fn(Bucket=self._bucket, **kwargs)
        except bx.ClientError:
            raise  # callers look at 304 / 404 / 409 / 412 first, then call _error
        except (bx.BotoCoreError, Urllib3HTTPError, OSError) as exc:
            raise translate_error(exc, context) from exc
        self._bucket_seen = True
        return result

    def _error(self, exc: bx.ClientError, context: str) -> BulletinError:
        """Translate a ``ClientError``, telling a missing bucket from a missing key."""
        if _status(exc) == 404 and _code(exc) not in {"NoSuchKey", "NoSuchBucket"}:
            # A HEAD response has no body, so its bare 404 names neither.
            if self._bucket_missing():
                return AccessDenied(f"{self.url}: the bucket {self._bucket!r} does not exist")
            return NotFound(f"{context}: no such object")
        return translate_error(exc, context)

    def _bucket_missing(self) -> bool:
        """Whether a bare ``404`` (HEAD has no error body) meant the bucket, not the key."""
        if self._bucket_seen:
            return False
        try:
            self._client.head_bucket(Bucket=self._bucket)
        except bx.ClientError as exc:
            if _status(exc) == 404:
                return True
            raise translate_error(exc, f"{self.url}: checking the bucket") from exc
        except (bx.BotoCoreError, Urllib3HTTPError, OSError) as exc:
            raise translate_error(exc, f"{self.url}: checking the bucket") from exc
        self._bucket_seen = True
        return False

    # -- reads ------------------------------------------------------------------------

    def _read(self, key: str, if_none_match: str | None, max_bytes: int | None) -> ObjectData | None:
        extra = {} if if_none_match is None else {"IfNoneMatch": if_none_match}
        got = self._fetch(key, extra, max_bytes, quiet=(304,))
        return None if isinstance(got, int) else ObjectData(*got)

    def _read_range(self, key: str, start: int, stop: int) -> bytes:
        # 416: the range starts at or past the object's end (an empty object included).
        got = self._fetch(key, {"Range": f"bytes={start}-{stop - 1}"}, stop - start, quiet=(416,))
        return b"" if isinstance(got, int) else got[0]

    def _fetch(
        self, key: str, extra: dict[str, str], max_bytes: int | None, *, quiet: tuple[int, ...]
    ) -> tuple[bytes, str] | int:
        """``GetObject``'s body and ETag, or the status of an answer in ``quiet``."""
        self._check_open()
        full = join_key(self._prefix, key)
        context = self._where(key)
        # botocore retries the request, not the body that streams in after it: a
        # connection dropped mid-body is retried here, as many times.
        attempt = 1
        while True:
            try:
                response = self._call(context, self._client.get_object, Key=full, **extra)
            except bx.ClientError as exc:
                status = _status(exc)
                if status in quiet:
                    return status
                raise self._error(exc, context) from exc
            try:
                with response["Body"] as body:
                    data = self._body(body, response.get("ContentLength"), max_bytes, context)
            except _STREAM_ERRORS as exc:
                if attempt >= self._max_attempts:
                    raise translate_error(exc, f"{context}: reading the body") from exc
                time.sleep(random.uniform(0, 0.1 * 2**attempt))
                attempt += 1
                continue
            return data, str(response["ETag"])

    @staticmethod
    def _body(body: Any, length: object, max_bytes: int | None, context: str) -> bytes:
        """The response body, refused unread (leaving the body to ``close``, which drops the
        connection) when its ``Content-Length`` is over ``max_bytes``, and read in chunks up
        to the bound when the server sent no length."""
        if max_bytes is None:
            return bytes(body.read())
        if isinstance(length, int) and not isinstance(length, bool):
            if length > max_bytes:
                raise too_large(context, length, max_bytes)
            return bytes(body.read())  # the transport never reads past Content-Length
        chunks: list[bytes] = []
        total = 0
        while chunk := body.read(min(_CHUNK, max_bytes + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise too_large(context, None, max_bytes)
        return b"".join(chunks)

    def _head(self, key: str, full: str) -> dict[str, Any] | None:
        """``HeadObject``'s answer, or ``None`` if the key is absent."""
        context = self._where(key)
        try:
            head = self._call(context, self._client.head_object, Key=full)
        except bx.ClientError as exc:
            error = self._error(exc, context)
            if isinstance(error, NotFound):
                return None
            raise error from exc
        return dict(head)

    def stat(self, key: str) -> ObjectInfo:
        """Size, ETag and modification time (``HeadObject``); ``NotFound`` if absent."""
        self._check_open()
        head = self._head(key, join_key(self._prefix, key))
        if head is None:
            raise NotFound(f"{self._where(key)}: no such object")
        return ObjectInfo(key, int(head["ContentLength"]), head.get("ETag"), head["LastModified"].astimezone(UTC))

    # -- conditional writes -----------------------------------------------------------

    def _put(self, key: str, body: bytes | FileRange, condition: dict[str, str]) -> WriteResult:
        """A conditional PUT, with the lost-response rule applied to its outcome. ``body`` is
        bytes (checked here) or a :class:`FileRange`, streamed from its file (and sent again
        from its start by botocore's retries); a failing file raises its own error."""
        full = join_key(self._prefix, key)
        payload = body if isinstance(body, FileRange) else check_data(body)
        context = self._where(key)
        write_id = uuid.uuid4().hex
        expected = condition.get("IfMatch")
        for attempt in range(1, self._max_attempts + 1):
            if isinstance(payload, FileRange):
                payload.seek(0)  # an attempt before (a 409) read it to its end
            try:
                response = self._call(
                    context,
                    self._client.put_object,
                    Key=full,
                    Body=payload,
                    Metadata={WRITE_ID_METADATA: write_id},
                    **condition,
                )
            except bx.ClientError as exc:
                status, code = _status(exc), _code(exc)
                if status == 412 or code == "PreconditionFailed":
                    return self._settle(key, full, write_id, expected, exc)
                if code == _CONDITIONAL_CONFLICT and attempt < self._max_attempts:
                    time.sleep(random.uniform(0, 0.05 * 2**attempt))
                    continue
                if code == "NoSuchKey" and expected is not None:
                    return Conflicted(None)  # If-Match on an absent key
                raise self._error(exc, context) from exc
            except StorageUnavailable as exc:
                if isinstance(exc, AccessDenied):
                    raise
                # The retries ended in a transport error: some attempt may have
                # been applied. Only the object itself can tell.
                return self._settle(key, full, write_id, expected, exc)
            except Exception as exc:
                raise_source_failure(payload, exc)
                raise
            return Updated(response["ETag"])
        raise StorageUnavailable(f"{context}: conditional writes kept colliding ({_CONDITIONAL_CONFLICT})")

    def _settle(
        self,
        key: str,
        full: str,
        write_id: str,
        expected: str | None,
        failure: Exception,
    ) -> WriteResult:
        """Decide a conditional PUT whose outcome is in doubt by reading the object back."""
        try:
            head = self._head(key, full)
        except BulletinError:
            if isinstance(failure, BulletinError):
                raise failure from failure.__cause__  # the first failure says more
            raise
        ambiguous = not isinstance(failure, bx.ClientError)  # a transport error, not a 412
        if head is None:
            if ambiguous and expected is None:
                # Nothing there: our create-only write was not applied. Not a lost race.
                raise failure
            return Conflicted(None)
        etag = head.get("ETag")
        if head.get("Metadata", {}).get(WRITE_ID_METADATA) == write_id:
            return Updated(str(etag))
        if ambiguous and expected is not None and etag == expected:
            raise failure  # the precondition still holds: our write simply did not land
        return Conflicted(None if etag is None else str(etag))

    def put_if_absent(self, key: str, data: bytes) -> WriteResult:
        """Create the object unless the key exists (``If-None-Match: *``; above the multipart
        threshold, a multipart upload completed so)."""
        self._check_open()
        payload = check_data(data)
        if len(payload) > self._multipart_threshold:
            from bulletin.storage.s3_transfer import BytesSource, upload

            check_key(key)
            return upload(self, key, BytesSource(payload))
        return self._put(key, payload, {"IfNoneMatch": "*"})

    def put_file_if_absent(self, key: str, path: str | os.PathLike[str], *, link: bool = False) -> WriteResult:
        """Create the object from a local file unless the key exists: one conditional PUT up
        to the multipart threshold, a create-only multipart upload above it; both stream the
        file (the memory held is botocore's small reads, whatever the file's size)."""
        self._check_open()
        check_key(key)
        with SourceFile(path) as source:
            if source.size > self._multipart_threshold:
                from bulletin.storage.s3_transfer import FileSource, upload

                return upload(self, key, FileSource(source))
            # Streamed from the page cache as botocore reads it: never the whole file in memory.
            return self._put(key, FileRange(source, 0, source.size), {"IfNoneMatch": "*"})

    def get_to_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        sha256: str | None = None,
        max_bytes: int | None = None,
    ) -> Downloaded:
        """Write the object to ``path`` by parallel ranged GETs of one version (``If-Match``),
        hashed as they arrive; see :meth:`Store.get_to_file`."""
        from bulletin.storage.s3_transfer import download

        self._check_open()
        check_key(key)
        return download(self, key, check_path(path), check_sha256(sha256), check_max_bytes(max_bytes))

    def put_if_match(self, key: str, data: bytes, etag: str) -> WriteResult:
        """Replace the object only while it carries ``etag`` (``If-Match``)."""
        self._check_open()
        return self._put(key, data, {"IfMatch": check_etag(etag)})

    # -- listing and deleting ---------------------------------------------------------

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Objects under ``prefix`` after ``start_after`` in key order, one request per page."""
        self._check_open()
        full_prefix = self._prefix + check_prefix(prefix)
        after = check_start_after(start_after)
        return self._list(prefix, full_prefix, None if after is None else self._prefix + after)

    def _list(self, prefix: str, full_prefix: str, full_after: str | None) -> Iterator[ObjectInfo]:
        context = f"{self.url}: listing {prefix!r}"
        kwargs: dict[str, Any] = {"Prefix": full_prefix, "MaxKeys": self._page_size}
        if full_after is not None:
            kwargs["StartAfter"] = full_after
        strip = len(self._prefix)
        while True:
            self._check_open()
            try:
                page = self._call(context, self._client.list_objects_v2, **kwargs)
            except bx.ClientError as exc:
                raise self._error(exc, context) from exc
            for obj in page.get("Contents", ()):
                modified = obj.get("LastModified")
                yield ObjectInfo(
                    obj["Key"][strip:],
                    int(obj.get("Size", 0)),
                    obj.get("ETag"),
                    None if modified is None else modified.astimezone(UTC),
                )
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            kwargs.pop("StartAfter", None)  # the token carries the position from here on
            kwargs["ContinuationToken"] = token

    def delete(self, key: str) -> None:
        """Remove the object (``DeleteObject``; absent keys are fine)."""
        self._check_open()
        full = join_key(self._prefix, key)
        context = self._where(key)
        try:
            self._call(context, self._client.delete_object, Key=full)
        except bx.ClientError as exc:
            if _code(exc) == "NoSuchKey":
                return
            raise self._error(exc, context) from exc
