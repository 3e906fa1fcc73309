"""S3 through s3fs (``fsspec+s3://bucket/prefix``): the S3 store's protocol, sent by s3fs.

Everything :class:`~bulletin.storage.s3.S3Store` guarantees holds here, because its code
runs unchanged: create-only ``PutObject`` with ``If-None-Match: *``, compare-and-swap
with ``If-Match``, the write id in the object's metadata that settles a lost response,
polls with ``If-None-Match`` answered ``304``, paged listings. Only the client differs:
requests go through an ``s3fs.S3FileSystem`` (its ``call_s3``: its aiobotocore session
and credentials, ``client_kwargs`` / ``config_kwargs``, ``requester_pays``,
``s3_additional_kwargs`` and its retries) instead of boto3. Use it where s3fs's
configuration is the one at hand (``FSSPEC_S3`` in the environment, storage options);
``s3://`` (boto3) is otherwise the same store.

Two facts of s3fs this relies on (s3fs 2026.9.0, ``s3fs/core.py``, ``s3fs/errors.py``):

- ``call_s3`` silently drops every argument the client's service model does not name
  (``ParamKwargsHelper.filter_dict``): under a botocore too old to know ``IfMatch`` /
  ``IfNoneMatch``, a conditional PUT would become a plain overwrite. The client's model
  is checked on first use, and such a client is refused (``ConfigError``).
- s3fs turns a ``ClientError`` into an ``OSError`` (``FileExistsError`` for a failed
  ``If-None-Match``, a bare ``EINVAL`` for a failed ``If-Match``, ``EIO`` for a ``304``)
  and keeps the ``ClientError`` as ``__cause__``: that ``ClientError`` is handed back, so
  the S3 store reads its status and code exactly as from boto3.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Final, cast

import aiohttp
from botocore.exceptions import BotoCoreError, ClientError
from botocore.handlers import set_list_objects_encoding_type_url

from bulletin.errors import ConfigError
from bulletin.storage.base import StoreBase
from bulletin.storage.keys import check_store_prefix
from bulletin.storage.s3 import (
    _BUCKET_RE,
    DEFAULT_MULTIPART_THRESHOLD,
    DEFAULT_PART_SIZE,
    DEFAULT_TRANSFER_WORKERS,
    S3Store,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from s3fs import S3FileSystem

__all__ = ["S3fsClient", "S3fsStore", "check_conditional_support"]

#: The request parameters the store's guarantees rest on, by operation.
_CONDITIONAL_PARAMETERS: Final = {
    "PutObject": ("IfMatch", "IfNoneMatch"),
    "GetObject": ("IfNoneMatch", "IfMatch", "Range"),
    "CompleteMultipartUpload": ("IfNoneMatch",),
    "UploadPart": ("ChecksumCRC32",),
}


def check_conditional_support(service_model: Any) -> None:
    """``ConfigError`` unless the client's S3 model has the conditional request parameters
    (s3fs would drop unknown ones without a word)."""
    for operation, names in _CONDITIONAL_PARAMETERS.items():
        members = service_model.operation_model(operation).input_shape.members
        missing = [name for name in names if name not in members]
        if missing:
            raise ConfigError(
                f"this botocore does not know {' and '.join(missing)} on {operation}: s3fs would drop them "
                "and conditional writes would overwrite; upgrade s3fs (and with it aiobotocore and botocore)"
            )


class _TransportError(OSError):
    """aiohttp's own failure of a request or body (not an ``OSError``), as the S3 store expects one."""


class _Body:
    """aiobotocore's streaming body, read from the calling thread on the filesystem's loop."""

    def __init__(self, body: Any, loop: Any) -> None:
        self._body = body
        self._loop = loop

    def read(self, amt: int | None = None) -> bytes:
        from fsspec.asyn import sync

        try:
            return bytes(sync(self._loop, self._body.read, amt))
        except aiohttp.ClientError as exc:
            raise _TransportError(f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Release the body; drops the connection if it was not read to its end."""
        self._body.close()

    def __enter__(self) -> _Body:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class S3fsClient:
    """The calls :class:`S3Store` makes of a boto3 client, sent through s3fs's ``call_s3`` and
    answering as boto3 does (the same dicts, the same ``ClientError`` s)."""

    def __init__(self, fs: S3FileSystem) -> None:
        self._fs = fs
        self._lock = threading.Lock()
        self._aio: Any = None

    def _connect(self) -> Any:
        """The filesystem's aiobotocore client, made (no request sent) and checked once."""
        with self._lock:
            if self._aio is None:
                try:
                    aio = self._fs.connect()
                except (BotoCoreError, ValueError) as exc:
                    raise ConfigError(f"s3fs cannot configure an S3 client: {exc}") from exc
                check_conditional_support(aio.meta.service_model)
                # As S3Store does for boto3: plain keys in listings (S3Store.__init__ says why).
                aio.meta.events.unregister(
                    "before-parameter-build.s3.ListObjectsV2", set_list_objects_encoding_type_url
                )
                self._aio = aio
            return self._aio

    @property
    def meta(self) -> Any:
        """The client's ``meta`` (region, endpoint), as boto3's."""
        return self._connect().meta

    def _call(self, operation: str, **kwargs: Any) -> dict[str, Any]:
        self._connect()
        try:
            return dict(self._fs.call_s3(operation, **kwargs))
        except (ClientError, BotoCoreError):
            raise
        except OSError as exc:
            if isinstance(exc.__cause__, ClientError):
                raise exc.__cause__ from None  # the answer itself: status, code, condition
            raise
        except aiohttp.ClientError as exc:
            raise _TransportError(f"{type(exc).__name__}: {exc}") from exc

    def get_object(self, **kwargs: Any) -> dict[str, Any]:
        response = self._call("get_object", **kwargs)
        response["Body"] = _Body(response["Body"], self._fs.loop)
        return response

    def head_object(self, **kwargs: Any) -> dict[str, Any]:
        return self._call("head_object", **kwargs)

    def head_bucket(self, **kwargs: Any) -> dict[str, Any]:
        return self._call("head_bucket", **kwargs)

    def put_object(self, **kwargs: Any) -> dict[str, Any]:
        return self._call("put_object", **kwargs)

    def list_objects_v2(self, **kwargs: Any) -> dict[str, Any]:
        return self._call("list_objects_v2", **kwargs)

    def delete_object(self, **kwargs: Any) -> dict[str, Any]:
        return self._call("delete_object", **kwargs)

    def create_multipart_upload(self, **kwargs: Any) -> dict[str, Any]:
        return self._call("create_multipart_upload", **kwargs)

    def upload_part(self, **kwargs: Any) -> dict[str, Any]:
        return self._call("upload_part", **kwargs)

    def complete_multipart_upload(self, **kwargs: Any) -> dict[str, Any]:
        return self._call("complete_multipart_upload", **kwargs)

    def abort_multipart_upload(self, **kwargs: Any) -> dict[str, Any]:
        return self._call("abort_multipart_upload", **kwargs)

    def close(self) -> None:
        """Close the aiobotocore client's connections, if one was made."""
        from fsspec.asyn import sync

        with self._lock:
            aio, self._aio = self._aio, None
        if aio is not None:
            sync(self._fs.loop, aio.close)


class S3fsStore(S3Store):
    """A bucket (and optional key prefix) through an ``s3fs.S3FileSystem``: read-write, with
    every guarantee of :class:`S3Store` (its code, over :class:`S3fsClient`).

    Creating it sends no request; a bad bucket, credentials or botocore show on first use.
    ``multipart_threshold``, ``part_size`` and ``transfer_workers`` are the S3 store's.
    """

    __slots__ = ("_fs",)

    def __init__(
        self,
        fs: S3FileSystem,
        bucket: str,
        prefix: str = "",
        *,
        url: str | None = None,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
        part_size: int = DEFAULT_PART_SIZE,
        transfer_workers: int = DEFAULT_TRANSFER_WORKERS,
    ) -> None:
        if not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
            raise ConfigError(f"not a valid S3 bucket name: {bucket!r}")
        normalised = check_store_prefix(prefix)
        # S3Store.__init__ builds a boto3 client: only its URL and state are wanted here.
        StoreBase.__init__(self, url if url is not None else f"fsspec+s3://{bucket}/{normalised}".rstrip("/"))
        self._bind(
            bucket,
            normalised,
            max_attempts=5,
            page_size=1000,
            multipart_threshold=multipart_threshold,
            part_size=part_size,
            transfer_workers=transfer_workers,
        )
        self._client = cast("S3Client", S3fsClient(fs))
        self._fs = fs

    @property
    def fs(self) -> S3FileSystem:
        """The s3fs filesystem the requests go through."""
        return self._fs
