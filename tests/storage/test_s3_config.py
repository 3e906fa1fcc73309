"""S3 store configuration and error translation: no server needed."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import botocore.exceptions as bx
import pytest

from bulletin.errors import (
    AccessDenied,
    BulletinError,
    ConfigError,
    InvalidInput,
    NotFound,
    ObjectTooLarge,
    StorageUnavailable,
)
from bulletin.storage import S3Store, open_store
from bulletin.storage.s3 import translate_error


def _client_error(code: str, status: int, message: str = "msg") -> bx.ClientError:
    response: Any = {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return bx.ClientError(response, "GetObject")


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (_client_error("NoSuchKey", 404), NotFound),
        (_client_error("404", 404), NotFound),
        (_client_error("NoSuchBucket", 404), AccessDenied),
        (_client_error("AccessDenied", 403), AccessDenied),
        (_client_error("InvalidAccessKeyId", 403), AccessDenied),
        (_client_error("SignatureDoesNotMatch", 403), AccessDenied),
        (_client_error("ExpiredToken", 400), AccessDenied),
        (_client_error("403", 403), AccessDenied),
        (_client_error("PermanentRedirect", 301), ConfigError),
        (_client_error("AuthorizationHeaderMalformed", 400), ConfigError),
        (_client_error("NotImplemented", 501), ConfigError),
        (_client_error("InvalidBucketName", 400), ConfigError),
        (_client_error("EntityTooLarge", 400), InvalidInput),
        (_client_error("SlowDown", 503), StorageUnavailable),
        (_client_error("InternalError", 500), StorageUnavailable),
        (bx.NoCredentialsError(), AccessDenied),
        (bx.PartialCredentialsError(provider="env", cred_var="AWS_SECRET_ACCESS_KEY"), AccessDenied),
        (bx.ProfileNotFound(profile="p"), ConfigError),
        (bx.NoRegionError(), ConfigError),
        (bx.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), StorageUnavailable),
        (bx.ConnectTimeoutError(endpoint_url="http://127.0.0.1:1"), StorageUnavailable),
        (bx.ReadTimeoutError(endpoint_url="http://127.0.0.1:1"), StorageUnavailable),
        (bx.ConnectionClosedError(endpoint_url="http://127.0.0.1:1"), StorageUnavailable),
        (bx.ParamValidationError(report="bad"), InvalidInput),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else getattr(v, "__name__", ""),
)
def test_translate_error(error: Exception, expected: type[BulletinError]) -> None:
    translated = translate_error(error, "s3://b: 'k'")
    assert type(translated) is expected
    assert "s3://b: 'k'" in str(translated)
    # Raised the way the store raises it, the botocore error stays the cause.
    with pytest.raises(expected) as excinfo:
        raise translated from error
    assert excinfo.value.__cause__ is error


def test_access_denied_is_storage_unavailable_and_oserror() -> None:
    # Callers that retry on StorageUnavailable also see AccessDenied; both are OSErrors.
    assert issubclass(AccessDenied, StorageUnavailable)
    assert isinstance(translate_error(bx.NoCredentialsError(), "x"), OSError)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bucket": "a"}, "bucket"),
        ({"bucket": "has/slash"}, "bucket"),
        ({"bucket": "-leading"}, "bucket"),
        ({"bucket": "b" * 256}, "bucket"),
        ({"bucket": "ok-bucket", "region": "Not A Region"}, "region"),
        ({"bucket": "ok-bucket", "endpoint_url": "ftp://host"}, "endpoint_url"),
        ({"bucket": "ok-bucket", "endpoint_url": "http://user:pw@host:1"}, "credentials"),
        ({"bucket": "ok-bucket", "endpoint_url": "http://host?x=1"}, "query"),
        ({"bucket": "ok-bucket", "addressing_style": "sideways"}, "addressing_style"),
        ({"bucket": "ok-bucket", "retry_mode": "legacy"}, "retry_mode"),
        ({"bucket": "ok-bucket", "max_attempts": 0}, "max_attempts"),
        ({"bucket": "ok-bucket", "max_attempts": 21}, "max_attempts"),
        ({"bucket": "ok-bucket", "max_attempts": True}, "max_attempts"),
        ({"bucket": "ok-bucket", "connect_timeout": -1.0}, "connect_timeout"),
        ({"bucket": "ok-bucket", "read_timeout": 0}, "read_timeout"),
        ({"bucket": "ok-bucket", "max_pool_connections": 2.5}, "max_pool_connections"),
        ({"bucket": "ok-bucket", "page_size": 1001}, "page_size"),
        ({"bucket": "ok-bucket", "prefix": "a/../b"}, "prefix"),
    ],
)
def test_bad_configuration(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        S3Store(**kwargs)


def test_session_and_profile_are_exclusive() -> None:
    import boto3

    with pytest.raises(ConfigError, match="session"):
        S3Store("ok-bucket", session=boto3.session.Session(), profile="p")


def test_canonical_url_lists_only_non_defaults() -> None:
    store = S3Store(
        "my-bucket",
        "/runs/a/",
        endpoint_url="http://127.0.0.1:4566/",
        region="us-east-1",
        max_attempts=5,
        connect_timeout=2.5,
    )
    assert store.url == (
        "s3://my-bucket/runs/a?connect_timeout=2.5&endpoint_url=http://127.0.0.1:4566&region=us-east-1"
    )
    assert store.prefix == "runs/a/"
    assert store.bucket == "my-bucket"
    store.close()
    assert S3Store("my-bucket").url == "s3://my-bucket"


def test_construction_sends_nothing() -> None:
    # A closed port: any request would fail, and none is made until first use.
    store = S3Store("my-bucket", endpoint_url="http://127.0.0.1:9", region="us-east-1")
    assert store.endpoint_url == "http://127.0.0.1:9"
    store.close()


def test_unknown_profile_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    with pytest.raises(ConfigError, match="profile"):
        open_store("s3://bucket?profile=nobody-has-this-profile")


# -- bounded reads, against a stubbed client ---------------------------------------------------


class _Body(io.BytesIO):
    """A response body that records how much of it was read."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.taken = 0

    def read(self, size: int | None = -1) -> bytes:
        chunk = super().read(size)
        self.taken += len(chunk)
        return chunk


def _stubbed_get(data: bytes, *, length: int | None, max_bytes: int) -> tuple[bytes | BaseException, _Body]:
    """One bounded ``get`` answered with ``data`` (and ``Content-Length: length`` unless None)."""
    from botocore.response import StreamingBody
    from botocore.stub import Stubber

    store = S3Store("my-bucket", endpoint_url="http://127.0.0.1:9", region="us-east-1")
    body = _Body(data)
    response: dict[str, Any] = {"Body": StreamingBody(body, length), "ETag": '"e"'}
    if length is not None:
        response["ContentLength"] = length
    with Stubber(store._client) as stub:
        stub.add_response("get_object", response, {"Bucket": "my-bucket", "Key": "k"})
        try:
            return store.get("k", max_bytes=max_bytes).data, body
        except BulletinError as exc:
            return exc, body
        finally:
            store.close()


def test_content_length_over_the_bound_is_refused_before_the_body_is_read() -> None:
    outcome, body = _stubbed_get(bytes(10_000), length=10_000, max_bytes=4096)
    assert isinstance(outcome, ObjectTooLarge) and "10000 bytes" in str(outcome)
    assert body.taken == 0
    assert body.closed  # the connection is dropped, not drained
    outcome, _ = _stubbed_get(b"abc", length=3, max_bytes=3)
    assert outcome == b"abc"


def test_a_body_without_a_length_is_read_only_up_to_the_bound() -> None:
    outcome, body = _stubbed_get(bytes(5 << 20), length=None, max_bytes=(1 << 20) + 5)
    assert isinstance(outcome, ObjectTooLarge) and "more bytes" in str(outcome)
    assert body.taken <= (1 << 20) + 6
    outcome, _ = _stubbed_get(b"x" * 3_000_000, length=None, max_bytes=3_000_000)
    assert outcome == b"x" * 3_000_000


def test_part_sizes_fit_s3s_limits() -> None:
    from bulletin.storage.s3_transfer import MAX_PARTS, part_size_for

    mib = 1 << 20
    assert part_size_for(100 * mib, 8 * mib) == 8 * mib
    five_tb = 5 * 10**12
    chosen = part_size_for(five_tb, 8 * mib)
    assert chosen % mib == 0 and -(-five_tb // chosen) <= MAX_PARTS and chosen <= 500 * mib
    assert -(-(45 << 40) // part_size_for(45 << 40, 8 * mib)) <= MAX_PARTS  # 45 TiB: ~4.6 GiB parts
    with pytest.raises(InvalidInput, match="larger than S3 takes"):
        part_size_for(MAX_PARTS * (5 << 30) + 1, 8 * mib)


@pytest.mark.parametrize(
    "options",
    [
        {"part_size": (5 << 20) - 1},
        {"part_size": (5 << 30) + 1},
        {"part_size": True},
        {"multipart_threshold": 0},
        {"multipart_threshold": (5 << 30) + 1},
        {"transfer_workers": 0},
    ],
)
def test_bad_transfer_settings_are_config_errors(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        S3Store("bucket", **options)


def test_transfer_settings_round_trip_through_the_url() -> None:
    store = open_store(
        "s3://bucket/p?multipart_threshold=10485760&part_size=6291456&transfer_workers=4&region=us-east-1"
    )
    assert isinstance(store, S3Store)
    assert "multipart_threshold=10485760" in store.url and "transfer_workers=4" in store.url
    assert open_store(store.url).url == store.url
    store.close()
