"""Large objects on S3: create-only multipart uploads and parallel ranged downloads.

Both run on the store's own transfer pool (``transfer_workers`` threads, one request
each, inside the store's connection pool). Neither holds a part in memory: an upload's
parts stream from the file (:class:`~bulletin.storage.files.FileRange`), a download's
land in the temp file through one 1 MiB buffer per thread, so memory is
O(workers x 1 MiB) whatever the part size (as boto3's transfer manager).

**Uploads** (``put_if_absent`` / ``put_file_if_absent`` above ``multipart_threshold``):

1. ``CreateMultipartUpload`` with the write id in the object's metadata (as every
   conditional PUT of :mod:`bulletin.storage.s3`) and ``ChecksumAlgorithm=CRC32``;
2. ``UploadPart`` in parallel, each part with its ``x-amz-checksum-crc32``, computed by
   botocore as the part is read (``ChecksumAlgorithm``: an ``aws-chunked`` trailer over
   HTTPS, as boto3's ``upload_file`` sends it, so a part is read once; a header over plain
   HTTP); a part damaged in flight is refused by the server (``BadDigest``) and sent again,
   and the completion lists the checksum each part's answer reports;
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
offsets as they arrive (``pwrite``, writeback started per part) and hashed in order
(SHA-256) on the calling thread, read back from the temp file's page cache while the
next parts arrive. A part whose body breaks off is fetched again (``max_attempts``).
"""

from __future__ import annotations

import base64
import http.client
import logging
import random
import re
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Final, Protocol

import botocore.exceptions as bx
from botocore.response import StreamingBody

from bulletin.errors import AccessDenied, BulletinError, InvalidInput, StorageUnavailable
from bulletin.storage.base import Downloaded, Updated, WriteResult
from bulletin.storage.files import (
    CHUNK,
    FileRange,
    FileSink,
    SourceFailed,
    SourceFile,
    raise_source_failure,
    run_window,
)
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

__all__ = [
    "MAX_PARTS",
    "MAX_PART_SIZE",
    "MIN_PART_SIZE",
    "BytesSource",
    "FileSource",
    "download",
    "part_size_for",
    "upload",
]

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

    def part(self, offset: int, length: int) -> bytes | FileRange:
        """The body of one part, sent as it is read."""
        ...


class BytesSource:
    """Bytes in memory as a :class:`Source` (each part a slice, copied as it is sent)."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    @property
    def size(self) -> int:
        return len(self._data)

    def part(self, offset: int, length: int) -> bytes | FileRange:
        return self._data[offset : offset + length]


class FileSource:
    """A local file as a :class:`Source`: each part a :class:`FileRange`, streamed from the
    page cache by botocore (small reads), so no part is ever held in memory."""

    def __init__(self, source: SourceFile) -> None:
        self._source = source

    @property
    def size(self) -> int:
        return self._source.size

    def part(self, offset: int, length: int) -> bytes | FileRange:
        return FileRange(self._source, offset, length)


def _crc32(body: bytes | FileRange) -> str:
    """A part's CRC-32 as S3 writes it (base64 of the big-endian value)."""
    if isinstance(body, FileRange):
        try:
            crc = body.crc32()
        except SourceFailed as exc:
            raise exc.error from exc.error.__cause__
    else:
        crc = zlib.crc32(body)
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


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
        length = min(part, source.size - offset)
        body = source.part(offset, length)
        where = f"{context}: part {index + 1} of {count}"
        for attempt in range(1, store._max_attempts + 1):
            if isinstance(body, FileRange):
                body.seek(0)
            try:
                response = store._call(
                    where,
                    store._client.upload_part,
                    Key=full,
                    UploadId=upload_id,
                    PartNumber=index + 1,
                    Body=body,
                    ContentLength=length,
                    # botocore computes it as it sends (a trailer over HTTPS, so the part is
                    # read once, its payload unsigned, as boto3's upload_file; a header read
                    # first over plain HTTP); the server checks it against what arrived.
                    ChecksumAlgorithm="CRC32",
                )
            except bx.ClientError as exc:
                if _code(exc) in _DAMAGED and attempt < store._max_attempts:
                    _backoff(attempt)
                    continue
                raise store._error(exc, where) from exc
            except Exception as exc:
                # The local file failed under botocore: its own error, not the transport's.
                raise_source_failure(body, exc)
                raise
            # The server's checksum of what it stored (one it did not send is computed here).
            checksum = response.get("ChecksumCRC32") or _crc32(body)
            return {"PartNumber": index + 1, "ETag": response["ETag"], "ChecksumCRC32": checksum}
        raise StorageUnavailable(f"{where}: kept arriving damaged")  # unreachable: the loop raises

    # Queued parts hold nothing (each opens its range when it runs), and a running one
    # holds only botocore's small reads: the window only keeps this upload from flooding
    # a pool that other transfers share.
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

        def fetch(index: int) -> int:
            start = index * part
            end = min(start + part, total) - 1
            received = -1
            if index == 0:
                try:
                    received = _receive(first["Body"], sink, start, end - start + 1)
                except BulletinError:
                    raise  # the local disk's (LocalStorageError is an OSError too)
                except _RECEIVE_ERRORS:
                    pass  # fetched again below, now with If-Match
                finally:
                    first["Body"].close()
            if received != end - start + 1:
                _read_range(store, full, context, start, end, etag, sink)
            sink.written(start, end - start + 1)
            return end - start + 1

        try:
            # Parts land in the temp file; this thread hashes them in order from the page
            # cache. A part in flight holds one receive buffer: memory is the threads'
            # buffers, whatever the part size or how far the hashing lags.
            run_window(store._transfers(), count, fetch, 2 * store._transfer_workers, lambda _, n: sink.absorb(n))
        finally:
            first["Body"].close()
        return sink.finish(etag, sha256=sha256, size=total)


#: Bytes per read of a part's body into the receiving thread's buffer.
_RECEIVE: Final = 1 << 20
#: Errors of a body read straight from http.client (urllib3's wrappers are skipped).
_RECEIVE_ERRORS: Final = (*_STREAM_ERRORS, http.client.HTTPException)
_buffers = threading.local()


def _receive(body: Any, sink: FileSink, offset: int, length: int) -> int:
    """Up to ``length`` bytes of a response body written at ``offset`` of ``sink``, through
    this thread's buffer; the number received (less than ``length``: the body broke off).

    botocore's plain body wraps urllib3's, which wraps http.client's; reading into the
    buffer from the last saves urllib3's ``readinto`` (a ``read``, then a copy) and an
    allocation per read, about a third of the client's CPU time here. botocore asks for
    the raw bytes (``decode_content=False``), so both give the same bytes; a body that
    validates a checksum (botocore's ``StreamingChecksumBody``) is read through its own
    ``readinto``. A connection read to its end goes back to urllib3's pool.
    """
    view: memoryview | None = getattr(_buffers, "view", None)
    if view is None:
        view = _buffers.view = memoryview(bytearray(_RECEIVE))
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    direct = type(body) is StreamingBody and isinstance(fp, http.client.HTTPResponse)
    read_into: Callable[[memoryview], int] = (
        fp.readinto if direct else getattr(body, "readinto", None) or partial(_read_into, body)  # type: ignore[union-attr]
    )
    got = 0
    while got < length:
        n = read_into(view[: min(len(view), length - got)])
        if not n:
            break
        sink.write_at(offset + got, view[:n])
        got += n
    if direct and fp.isclosed():  # type: ignore[union-attr]
        raw.release_conn()  # type: ignore[union-attr]
    return got


def _read_into(body: Any, view: memoryview) -> int:
    """``readinto`` for a body that only has ``read`` (s3fs's)."""
    data = body.read(len(view))
    view[: len(data)] = data
    return len(data)


def _first_range(store: S3Store, full: str, context: str, part: int) -> dict[str, Any] | None:
    try:
        return dict(store._call(context, store._client.get_object, Key=full, Range=f"bytes=0-{part - 1}"))
    except bx.ClientError as exc:
        if _status(exc) == 416 or _code(exc) == "InvalidRange":
            return None
        raise store._error(exc, context) from exc


def _read_range(store: S3Store, full: str, context: str, start: int, end: int, etag: str, sink: FileSink) -> None:
    """Bytes ``start..end`` of the version ``etag`` of the object, written at ``start`` of
    ``sink``, fetched again while the body breaks off (``max_attempts``)."""
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
        body = response["Body"]
        try:
            got = _receive(body, sink, start, end - start + 1)
        except BulletinError:
            raise  # the local disk's (LocalStorageError is an OSError too)
        except _RECEIVE_ERRORS as exc:
            if attempt >= store._max_attempts:
                raise translate_error(exc, f"{where}: reading the body") from exc
            _backoff(attempt)
            continue
        finally:
            body.close()
        if got == end - start + 1:
            return
        if attempt >= store._max_attempts:
            raise StorageUnavailable(f"{where}: {got} bytes arrived")
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
