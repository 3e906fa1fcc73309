"""Validation of object keys and listing prefixes, shared by every backend.

A key is checked once, at the storage boundary, with the same rules for every
backend, so that a key valid in memory is valid on disk and in S3 too.
"""

from __future__ import annotations

from typing import Final

from bulletin.errors import ConfigError, InvalidInput, ObjectTooLarge

__all__ = [
    "MAX_KEY_BYTES",
    "RESERVED_SEGMENT_PREFIX",
    "check_data",
    "check_etag",
    "check_key",
    "check_max_bytes",
    "check_prefix",
    "check_start_after",
    "check_store_prefix",
    "join_key",
    "too_large",
]

#: S3's limit on a key, counted in UTF-8 bytes (including a store's own prefix).
MAX_KEY_BYTES: Final = 1024

#: Path segments starting with this are reserved for a backend's own files
#: (the local store's temporary and lock files), in every backend alike.
RESERVED_SEGMENT_PREFIX: Final = ".bulletin-"


def _utf8_length(text: str, what: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:  # Lone surrogates: no S3 server or file system takes them.
        raise InvalidInput(f"{what} is not valid UTF-8: {text!r}") from None


def _check_chars(text: str, what: str) -> None:
    if "\\" in text:
        raise InvalidInput(f"{what} must not contain a backslash: {text!r}")
    # NUL ends C strings; other control characters break S3's XML listings.
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        raise InvalidInput(f"{what} contains a control character or NUL: {text!r}")


def _check_segment(segment: str, text: str, what: str) -> None:
    if not segment:
        raise InvalidInput(f"{what} has an empty path segment: {text!r}")
    if segment in {".", ".."}:
        raise InvalidInput(f"{what} has a '.' or '..' path segment: {text!r}")
    if segment.startswith(RESERVED_SEGMENT_PREFIX):
        raise InvalidInput(
            f"{what} has a segment starting with {RESERVED_SEGMENT_PREFIX!r}, "
            f"which is reserved for store internals: {text!r}"
        )


def check_key(key: object) -> str:
    """Return ``key`` if it is a valid object key, else raise ``InvalidInput``.

    A key is a relative ``/``-separated path of at most :data:`MAX_KEY_BYTES`
    UTF-8 bytes: no leading ``/``, no empty, ``.`` or ``..`` segments, no
    backslash, NUL or other control character, and no segment starting with
    :data:`RESERVED_SEGMENT_PREFIX`.
    """
    if not isinstance(key, str):
        raise InvalidInput(f"key must be a str, got {type(key).__name__}")
    if not key:
        raise InvalidInput("key must not be empty")
    if _utf8_length(key, "key") > MAX_KEY_BYTES:
        raise InvalidInput(f"key longer than {MAX_KEY_BYTES} bytes: {key[:64]!r}...")
    _check_chars(key, "key")
    if key.startswith("/"):
        raise InvalidInput(f"key must be relative (no leading '/'): {key!r}")
    for segment in key.split("/"):
        _check_segment(segment, key, "key")
    return key


def check_prefix(prefix: object) -> str:
    """Return ``prefix`` if it is a valid listing prefix, else raise ``InvalidInput``.

    A prefix is the start of a key: ``""`` (everything), whole segments ending in
    ``/`` (``"manifests/"``), or a partial last segment (``"manifests/0000"``).
    Its complete segments obey the rules of :func:`check_key`.
    """
    if not isinstance(prefix, str):
        raise InvalidInput(f"prefix must be a str, got {type(prefix).__name__}")
    if _utf8_length(prefix, "prefix") > MAX_KEY_BYTES:
        raise InvalidInput(f"prefix longer than {MAX_KEY_BYTES} bytes: {prefix[:64]!r}...")
    _check_chars(prefix, "prefix")
    if prefix.startswith("/"):
        raise InvalidInput(f"prefix must be relative (no leading '/'): {prefix!r}")
    # The last segment may be partial ("ab" of "abc"), so only complete ones are checked.
    for segment in prefix.split("/")[:-1]:
        _check_segment(segment, prefix, "prefix")
    return prefix


def check_start_after(start_after: object) -> str | None:
    """Return ``start_after`` if usable as a listing bound, else raise ``InvalidInput``.

    Any string sorts somewhere, so only the type, encoding and length are checked.
    """
    if start_after is None:
        return None
    if not isinstance(start_after, str):
        raise InvalidInput(f"start_after must be a str or None, got {type(start_after).__name__}")
    if _utf8_length(start_after, "start_after") > MAX_KEY_BYTES:
        raise InvalidInput(f"start_after longer than {MAX_KEY_BYTES} bytes")
    if "\x00" in start_after:
        raise InvalidInput("start_after must not contain NUL")
    return start_after


def check_data(data: object) -> bytes:
    """Return ``data`` as ``bytes`` (copying a ``bytearray`` or ``memoryview``).

    The copy matters: the store keeps or sends these bytes after the call returns,
    and a caller may reuse its buffer.
    """
    if isinstance(data, bytes):
        return data
    if isinstance(data, bytearray | memoryview):
        return bytes(data)
    raise InvalidInput(f"data must be bytes, got {type(data).__name__}")


def check_etag(etag: object) -> str:
    """Return ``etag`` if it can be an ETag (a non-empty str), else raise ``InvalidInput``."""
    if not isinstance(etag, str) or not etag:
        raise InvalidInput(f"etag must be a non-empty str, got {etag!r}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in etag):
        raise InvalidInput(f"etag contains a control character: {etag!r}")
    return etag


def check_max_bytes(max_bytes: object) -> int | None:
    """Return the bound of a bounded read (``None``: unbounded, or an int ``>= 0``)."""
    if max_bytes is None:
        return None
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise InvalidInput(f"max_bytes must be None or an int >= 0, got {max_bytes!r}")
    return max_bytes


def check_range(start: object, stop: object) -> tuple[int, int]:
    """Return the bounds of a ranged read: ints with ``0 <= start < stop``."""
    if isinstance(start, bool) or isinstance(stop, bool) or not isinstance(start, int) or not isinstance(stop, int):
        raise InvalidInput(f"a range's start and stop must be ints, got {start!r} and {stop!r}")
    if not 0 <= start < stop:
        raise InvalidInput(f"a range needs 0 <= start < stop, got [{start}, {stop})")
    return start, stop


def too_large(where: str, size: int | None, max_bytes: int) -> ObjectTooLarge:
    """The error of a bounded read that found an object of ``size`` bytes (None: unknown,
    it only showed while reading) larger than ``max_bytes``."""
    found = "more bytes" if size is None else f"{size} bytes"
    return ObjectTooLarge(f"{where}: {found} where at most {max_bytes} are allowed (refused unread)")


def check_store_prefix(prefix: str) -> str:
    """Normalise the prefix a store URL puts before every key, or raise ``ConfigError``.

    ``"runs/a"``, ``"runs/a/"`` and ``"/runs/a/"`` all give ``"runs/a/"``; ``""`` stays ``""``.
    """
    stripped = prefix.strip("/")
    if not stripped:
        return ""
    try:
        check_key(stripped)
    except InvalidInput as exc:
        raise ConfigError(f"bad store prefix {prefix!r}: {exc}") from None
    return stripped + "/"


def join_key(store_prefix: str, key: str) -> str:
    """``store_prefix + key`` after checking ``key``; the whole must fit S3's key limit."""
    full = store_prefix + check_key(key)
    if store_prefix and len(full.encode("utf-8")) > MAX_KEY_BYTES:
        raise InvalidInput(
            f"key {key[:64]!r} is longer than {MAX_KEY_BYTES} bytes after the store prefix {store_prefix!r}"
        )
    return full
