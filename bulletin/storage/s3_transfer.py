"""Large objects on S3: create-only multipart uploads and parallel ranged downloads.

Both run on the store's own transfer pool (``transfer_workers`` threads, one request
each, inside the store's connection pool), with at most a window of parts held in
memory: O(part size x workers), never the whole object.

**Uploads** (``put_if_absent`` / ``put_file_if_absent`` above ``multipart_threshold``):

1. ``CreateMultipartUpload`` with the write id in the object's metadata (as every
   conditional PUT of :mod:`bulletin.storage.s3`) and ``ChecksumAlgorithm=CRC32``;
2. ``UploadPart`` in parallel, each part with its ``x-amz-checksum-crc32``: a part
   damaged in flight is refused by the server (``BadDigest``) and sent again;
3. ``CompleteMultipartUpload`` with ``If-None-Match: *`` (AWS S3 since 2024-11;
   LocalStack 4.13 honours it too, ``412`` for an existing key), so the object appears
   whole or not at all and exactly one writer creates it. Its outcome is settled by
   the lost-response rule of :class:`~bulletin.storage.s3.S3Store`: after a ``412`` or
   a transport failure the object is read back, and it is this write's if it carries
   this write id. A ``409 ConditionalRequestConflict`` (another conditional write on
   the key in flight) starts a new upload, as AWS asks, unless the key exists by then.
4. Anything else that fails (a part, the completion, an interrupt) aborts the upload
   (``AbortMultipartUpload``), so no incomplete upload is left to bill for; so does a
   lost race. Only an abort that itself cannot reach S3 leaves one: a bucket lifecycle
   rule (``AbortIncompleteMultipartUpload``) is the backstop (docs/STORAGE.md).

Parts are ``part_size`` bytes, larger when needed to fit S3's 10,000 parts (a 5 TB
object takes 525 MiB parts), at most 5 GiB; a larger object is ``InvalidInput``.

**Downloads** (``get_to_file``): one ranged ``GetObject`` for the first part gives the
object's size (``Content-Range``) and ETag; an object over ``max_bytes`` is refused
there, its body unread. The other parts are ranged GETs with ``If-Match`` on that ETag
(an object replaced meanwhile fails instead of mixing two versions), written at their
offsets as they arrive and hashed in order (SHA-256) on the calling thread. A part
whose body breaks off is fetched again (``max_attempts``).
"""

from __future__ import annotations

import base64
import logging
import random
import re
import time
import uuid
import zlib
from pathlib import Path
from typing import Any, Final, Protocol

import botocore.exceptions as bx

from bulletin.errors import AccessDenied, InvalidInput, StorageUnavailable
from bulletin.storage.base import Downloaded, Updated, WriteResult
from bulletin.storage.files import CHUNK, FileSink, run_window
from bulletin.storage.keys import join_key, too_large
from bulletin.storage.s3 import (
    _CONDITIONAL_CONFLICT,
    _STREAM_ERRORS,
    WRITE_ID_METADATA,
    S3Store,
    _code,
    _status,
    translate_error,
)

__all__ = ["MAX_PARTS", "MAX_PART_SIZE", "MIN_PART_SIZE", "download", "part_size_for", "upload"]

log = logging.getLogger("bulletin.storage")

#: S3's limits on multipart uploads (every part but the last at least 5 MiB).
MIN_PART_SIZE: Final = 5 << 20
MAX_PART_SIZE: Final = 5 << 30
MAX_PARTS: Final = 10_000
_MIB: Final = 1 << 20
#: Part answers worth sending again: the bytes arrived damaged.
_DAMAGED: Final = frozenset({"BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch", "XAmzContentSHA256Mismatch"})
_CONTENT_RANGE: Final = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


class Source(Protocol):
    """What an upload reads its parts from: a local file or bytes in memory."""

    @property
    def size(self) -> int: ...

    def read_at(self, offset: int, length: int) -> bytes: ...


class BytesSource:
    """Bytes in memory as a :class:`Source` (each part a slice, copied as it is sent)."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    @property
    def size(self) -> int:
        return len(self._data)

    def read_at(self, offset: int, length: int) -> bytes:
        return self._data[offset : offset + length]


def part_size_for(size: int, part_size: int) -> int:
    """The part size an upload of ``size`` bytes uses: ``part_size``, or the smallest whole
    number of MiB that fits S3's 10,000 parts; ``InvalidInput`` past 10,000 x 5 GiB."""
    needed = -(-size // MAX_PARTS)
    chosen = max(part_size, -(-needed // _MIB) * _MIB)
    if chosen > MAX_PART_SIZE:
        raise InvalidInput(f"an object of {size} bytes is larger than S3 takes ({MAX_PARTS} parts of 5 GiB)")
    return chosen


def _backoff(attempt: int) -> None:
    time.sleep(random.uniform(0, 0.05 * 2**attempt))


# -- uploads ------------------------------------------------------------------------------


def upload(store: S3Store, key: str, source: Source) -> WriteResult:
    """Create ``key`` from ``source`` with a multipart upload completed create-only."""
    full = join_key(store.prefix, key)
    context = store._where(key)
    part = part_size_for(source.size, store._part_size)
    count = max(1, -(-source.size // part))
    write_id = uuid.uuid4().hex  # one per call: any of its uploads that landed is ours
    for attempt in range(1, store._max_attempts + 1):
        upload_id = _create(store, full, context, write_id)
        try:
            parts = _send_parts(store, full, upload_id, source, part, count, context)
            outcome = _complete(store, key, full, upload_id, parts, write_id, context)
        except BaseException:
            _abort(store, full, upload_id, context)
            raise
        if outcome is None:  # 409: another conditional write overlapped; nothing applied
            _abort(store, full, upload_id, context)
            _backoff(attempt)
            continue
        if not isinstance(outcome, Updated):
            _abort(store, full, upload_id, context)  # a lost race leaves the upload (and its parts) behind
        return outcome
    raise StorageUnavailable(f"{context}: conditional writes kept colliding ({_CONDITIONAL_CONFLICT})")


def _create(store: S3Store, full: str, context: str, write_id: str) -> str:
    try:
        response = store._call(
            context,
            store._client.create_multipart_upload,
            Key=full,
            Metadata={WRITE_ID_METADATA: write_id},
            ChecksumAlgorithm="CRC32",
        )
    except bx.ClientError as exc:
        raise store._error(exc, context) from exc
    return str(response["UploadId"])


def _send_parts(
    store: S3Store, full: str, upload_id: str, source: Source, part: int, count: int, context: str
) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []

    def send(index: int) -> dict[str, Any]:
        offset = index * part
        data = source.read_at(offset, min(part, source.size - offset))
        checksum = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
        where = f"{context}: part {index + 1} of {count}"
        for attempt in range(1, store._max_attempts + 1):
            try:
                response = store._call(
                    where,
                    store._client.upload_part,
                    Key=full,
                    UploadId=upload_id,
                    PartNumber=index + 1,
                    Body=data,
                    ChecksumCRC32=checksum,
                )
            except bx.ClientError as exc:
                if _code(exc) in _DAMAGED and attempt < store._max_attempts:
                    _backoff(attempt)
                    continue
                raise store._error(exc, where) from exc
            return {"PartNumber": index + 1, "ETag": response["ETag"], "ChecksumCRC32": checksum}
        raise StorageUnavailable(f"{where}: kept arriving damaged")  # unreachable: the loop raises

    # Queued parts hold nothing (each reads its bytes when it runs): the window only
    # keeps this upload from flooding a pool that other transfers share.
    run_window(store._transfers(), count, send, 2 * store._transfer_workers, lambda _, p: parts.append(p))
    return parts


def _complete(
    store: S3Store,
    key: str,
    full: str,
    upload_id: str,
    parts: list[dict[str, Any]],
    write_id: str,
    context: str,
) -> WriteResult | None:
    """The completion's outcome, settled; None after a ``409`` with the key still free."""
    try:
        response = store._call(
            context,
            store._client.complete_multipart_upload,
            Key=full,
            UploadId=upload_id,
            MultipartUpload={"Parts": parts},
            IfNoneMatch="*",
        )
    except bx.ClientError as exc:
        status, code = _status(exc), _code(exc)
        if status == 412 or code == "PreconditionFailed":
            return store._settle(key, full, write_id, None, exc)
        if code == _CONDITIONAL_CONFLICT:
            if store._head(key, full) is None:
                return None
            return store._settle(key, full, write_id, None, exc)
        if code == "NoSuchUpload":
            # A completion sent again after the first was applied (its answer lost), or
            # an upload aborted behind our back: only the object can tell.
            failure = StorageUnavailable(f"{context}: the multipart upload vanished before it completed")
            failure.__cause__ = exc
            return store._settle(key, full, write_id, None, failure)
        raise store._error(exc, context) from exc
    except StorageUnavailable as exc:
        if isinstance(exc, AccessDenied):
            raise
        return store._settle(key, full, write_id, None, exc)  # the answer was lost: the object tells
    return Updated(str(response["ETag"]))


def _abort(store: S3Store, full: str, upload_id: str, context: str) -> None:
    """Abort the upload, best effort: a failure here is logged, never raised over the first."""
    try:
        store._client.abort_multipart_upload(Bucket=store.bucket, Key=full, UploadId=upload_id)
    except bx.ClientError as exc:
        if _code(exc) != "NoSuchUpload":
            log.warning("%s: could not abort multipart upload %s: %s", context, upload_id, exc)
    except Exception as exc:  # the transport: the bucket's lifecycle rule is the backstop
        log.warning("%s: could not abort multipart upload %s: %s: %s", context, upload_id, type(exc).__name__, exc)


# -- downloads ----------------------------------------------------------------------------


def download(store: S3Store, key: str, target: Path, sha256: str | None, max_bytes: int | None) -> Downloaded:
    """Write ``key`` to ``target`` by parallel ranged reads (see the module's docstring)."""
    full = join_key(store.prefix, key)
    context = store._where(key)
    part = store._part_size
    with FileSink(target, context=context, max_bytes=max_bytes) as sink:
        first = _first_range(store, full, context, part)
        if first is None:  # 416: nothing at offset 0, so an empty object
            return _sequential(store, full, context, sink, sha256)
        content_range = _CONTENT_RANGE.fullmatch(str(first.get("ContentRange", "")))
        if content_range is None:  # the server ignored Range: the whole object in one body
            return _stream_body(first, context, sink, sha256)
        total = int(content_range.group(3))
        etag = str(first["ETag"])
        if max_bytes is not None and total > max_bytes:
            first["Body"].close()  # unread: drops the connection
            raise too_large(context, total, max_bytes)
        count = -(-total // part)

        def fetch(index: int) -> bytes:
            start = index * part
            end = min(start + part, total) - 1
            data: bytes | None = None
            if index == 0:
                try:
                    with first["Body"] as body:
                        data = bytes(body.read())
                except _STREAM_ERRORS:
                    data = None  # fetched again below, now with If-Match
            if data is None or len(data) != end - start + 1:
                data = _read_range(store, full, context, start, end, etag)
            sink.write_at(start, data)
            return data

        try:
            # Results wait in the window until hashed: memory is (workers + 2) parts at most.
            run_window(store._transfers(), count, fetch, store._transfer_workers + 2, lambda _, d: sink.update(d))
        finally:
            first["Body"].close()
        return sink.finish(etag, sha256=sha256, size=total)


def _first_range(store: S3Store, full: str, context: str, part: int) -> dict[str, Any] | None:
    try:
        return dict(store._call(context, store._client.get_object, Key=full, Range=f"bytes=0-{part - 1}"))
    except bx.ClientError as exc:
        if _status(exc) == 416 or _code(exc) == "InvalidRange":
            return None
        raise store._error(exc, context) from exc


def _read_range(store: S3Store, full: str, context: str, start: int, end: int, etag: str) -> bytes:
    """Bytes ``start..end`` of the version ``etag`` of the object, fetched again while the
    body breaks off (``max_attempts``)."""
    from bulletin.storage.s3 import _STREAM_ERRORS, translate_error

    where = f"{context}: bytes {start}-{end}"
    for attempt in range(1, store._max_attempts + 1):
        try:
            response = store._call(
                where, store._client.get_object, Key=full, Range=f"bytes={start}-{end}", IfMatch=etag
            )
        except bx.ClientError as exc:
            if _status(exc) == 412:
                raise StorageUnavailable(
                    f"{context}: the object was replaced while it was read; read it again"
                ) from exc
            raise store._error(exc, where) from exc
        try:
            with response["Body"] as body:
                data = bytes(body.read())
        except _STREAM_ERRORS as exc:
            if attempt >= store._max_attempts:
                raise translate_error(exc, f"{where}: reading the body") from exc
            _backoff(attempt)
            continue
        if len(data) == end - start + 1:
            return data
        if attempt >= store._max_attempts:
            raise StorageUnavailable(f"{where}: {len(data)} bytes arrived")
        _backoff(attempt)
    raise StorageUnavailable(f"{where}: no attempts left")  # unreachable: the loop returns or raises


def _sequential(store: S3Store, full: str, context: str, sink: FileSink, sha256: str | None) -> Downloaded:
    try:
        response = dict(store._call(context, store._client.get_object, Key=full))
    except bx.ClientError as exc:
        raise store._error(exc, context) from exc
    return _stream_body(response, context, sink, sha256)


def _stream_body(response: dict[str, Any], context: str, sink: FileSink, sha256: str | None) -> Downloaded:
    """One response's whole body into ``sink``, in chunks (refused once past the bound)."""
    length = response.get("ContentLength")
    if sink.max_bytes is not None and isinstance(length, int) and length > sink.max_bytes:
        response["Body"].close()
        raise too_large(context, length, sink.max_bytes)
    try:
        with response["Body"] as body:
            while chunk := body.read(CHUNK):
                sink.write(chunk)
    except _STREAM_ERRORS as exc:
        raise translate_error(exc, f"{context}: reading the body") from exc
    return sink.finish(str(response["ETag"]), sha256=sha256, size=length if isinstance(length, int) else None)
