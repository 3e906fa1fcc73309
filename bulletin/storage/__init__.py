"""Storage: one protocol, bytes in and bytes out with ETags, and its backends.

- :class:`Store`: the protocol every backend implements (:mod:`bulletin.storage.base`).
- :func:`open_store`: a store from a URL (a path, ``file://``, ``memory://``, ``s3://``,
  ``https://``, ``fsspec+<protocol>://``); :func:`open_fsspec` one from an fsspec URL and
  storage options given in Python.
- :class:`LocalStore`, :class:`MemoryStore`, :class:`S3Store`: the backends;
  :class:`FsspecStore`, :class:`HttpStore` (read-only) and :class:`S3fsStore` over fsspec.
- :func:`require_writable`: ``StoreNotWritable`` unless a store takes writes.
- :func:`get_many`, :func:`put_many_if_absent`: parallel bulk transfers over any store.
- ``Store.put_file_if_absent`` / ``Store.get_to_file`` (:class:`Downloaded`): objects of any
  size to and from local files, streamed (S3: multipart uploads, parallel ranged reads).

Lost races are return values (:class:`Updated` / :class:`Conflicted`), never
exceptions; everything else raises from :mod:`bulletin.errors`. ``S3Store``,
``S3fsStore`` and ``HttpStore`` are imported lazily, so that code which never touches
S3 or HTTP does not pay for boto3, s3fs or aiohttp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bulletin.storage.base import (
    Conflicted,
    Downloaded,
    ObjectData,
    ObjectInfo,
    Store,
    StoreBase,
    Updated,
    WriteResult,
    require_writable,
)
from bulletin.storage.fsspec_store import FsspecStore, open_fsspec
from bulletin.storage.keys import MAX_KEY_BYTES, check_key, check_prefix
from bulletin.storage.local import LocalStore
from bulletin.storage.memory import MemoryStore, drop_memory_bucket
from bulletin.storage.transfer import DEFAULT_WORKERS, get_many, put_many_if_absent
from bulletin.storage.url import open_store

if TYPE_CHECKING:
    from bulletin.storage.fsspec_http import HttpStore
    from bulletin.storage.fsspec_s3 import S3fsStore
    from bulletin.storage.s3 import S3Store

__all__ = [
    "DEFAULT_WORKERS",
    "MAX_KEY_BYTES",
    "Conflicted",
    "Downloaded",
    "FsspecStore",
    "HttpStore",
    "LocalStore",
    "MemoryStore",
    "ObjectData",
    "ObjectInfo",
    "S3Store",
    "S3fsStore",
    "Store",
    "StoreBase",
    "Updated",
    "WriteResult",
    "check_key",
    "check_prefix",
    "drop_memory_bucket",
    "get_many",
    "open_fsspec",
    "open_store",
    "put_many_if_absent",
    "require_writable",
]


def __getattr__(name: str) -> Any:
    if name == "S3Store":
        from bulletin.storage.s3 import S3Store

        return S3Store
    if name == "S3fsStore":
        from bulletin.storage.fsspec_s3 import S3fsStore

        return S3fsStore
    if name == "HttpStore":
        from bulletin.storage.fsspec_http import HttpStore

        return HttpStore
    raise AttributeError(f"module 'bulletin.storage' has no attribute {name!r}")
