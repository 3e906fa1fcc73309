"""The S3 store against LocalStack: the contract, lost responses, and failures to reach S3."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
import pytest

from bulletin.errors import AccessDenied, StorageUnavailable
from bulletin.storage import Conflicted, S3Store, Store, Updated, open_store
from bulletin.storage.s3 import WRITE_ID_METADATA
from tests.conftest import S3_TEST_REGION
from tests.storage.contract import StoreContract
from tests.storage.tcp_proxy import ResponseDroppingProxy

pytestmark = pytest.mark.integration


#: Small enough for quick tests, as small as S3 allows: files of the contract go as three parts.
MULTIPART = {"multipart_threshold": 6 << 20, "part_size": 5 << 20}


class TestS3Store(StoreContract):
    """Under a prefix and with tiny listing pages, so every listing crosses pages; files
    and objects over 6 MiB go as multipart uploads of 5 MiB parts."""

    file_size = (11 << 20) + 12345
    atomic_file_create = False  # LocalStack: see docs/STORAGE.md, large objects

    @pytest.fixture
    def store(self, s3_endpoint: str, s3_bucket: str) -> Iterator[Store]:
        store = S3Store(
            s3_bucket,
            "runs/contract",
            endpoint_url=s3_endpoint,
            region=S3_TEST_REGION,
            page_size=7,
            max_pool_connections=20,
            **MULTIPART,
        )
        yield store
        store.close()


@pytest.fixture
def raw(s3_endpoint: str) -> Iterator[Any]:
    """A plain boto3 client on the test server, to look behind the store's back."""
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name=S3_TEST_REGION)
    yield client
    client.close()


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[ResponseDroppingProxy]:
    upstream = urlsplit(s3_endpoint)
    assert upstream.hostname is not None and upstream.port is not None
    with ResponseDroppingProxy(upstream.hostname, upstream.port) as p:
        yield p


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port  # closed again: connecting is refused at once


def test_prefix_and_write_id_in_the_bucket(s3_url: str, s3_bucket: str, raw: Any) -> None:
    store = open_store(s3_url.replace("?", "/runs/a/?"))
    assert store.url == s3_url.replace("?", "/runs/a?")
    outcome = store.put_if_absent("head.json", b"{}")
    assert isinstance(outcome, Updated)
    listed = raw.list_objects_v2(Bucket=s3_bucket)["Contents"]
    assert [o["Key"] for o in listed] == ["runs/a/head.json"]
    head = raw.head_object(Bucket=s3_bucket, Key="runs/a/head.json")
    assert len(head["Metadata"][WRITE_ID_METADATA]) == 32
    assert head["ETag"] == outcome.etag
    assert [i.key for i in store.list("")] == ["head.json"]


# -- the lost-response rule -------------------------------------------------------------


def _through(proxy: ResponseDroppingProxy, bucket: str, **options: Any) -> S3Store:
    return S3Store(bucket, endpoint_url=proxy.endpoint, region=S3_TEST_REGION, **options)


def test_lost_create_response_then_retry_is_still_our_write(
    proxy: ResponseDroppingProxy, s3_bucket: str, raw: Any
) -> None:
    # botocore re-sends the PUT, which now fails If-None-Match against our own object.
    store = _through(proxy, s3_bucket, max_attempts=3)
    proxy.drop_next_response()
    outcome = store.put_if_absent("manifests/1.json", b"ours")
    assert proxy.dropped == 1
    assert isinstance(outcome, Updated)
    body = raw.get_object(Bucket=s3_bucket, Key="manifests/1.json")
    assert body["Body"].read() == b"ours"
    assert body["ETag"] == outcome.etag
    store.close()


def test_lost_create_response_without_retries_is_still_our_write(proxy: ResponseDroppingProxy, s3_bucket: str) -> None:
    store = _through(proxy, s3_bucket, max_attempts=1)
    proxy.drop_next_response()
    outcome = store.put_if_absent("k", b"ours")
    assert proxy.dropped == 1
    assert isinstance(outcome, Updated)
    assert store.get("k").data == b"ours"
    store.close()


def test_lost_cas_response_is_still_our_write(proxy: ResponseDroppingProxy, s3_bucket: str) -> None:
    store = _through(proxy, s3_bucket, max_attempts=3)
    first = store.put_if_absent("head", b"1")
    assert isinstance(first, Updated)
    proxy.drop_next_response()
    second = store.put_if_match("head", b"2", first.etag)
    assert proxy.dropped == 1
    assert isinstance(second, Updated)
    assert store.get("head").etag == second.etag
    store.close()


def test_lost_response_of_a_real_conflict_is_still_a_conflict(proxy: ResponseDroppingProxy, s3_bucket: str) -> None:
    store = _through(proxy, s3_bucket, max_attempts=3)
    theirs = store.put_if_absent("k", b"theirs")
    assert isinstance(theirs, Updated)
    proxy.drop_next_response()
    assert store.put_if_absent("k", b"ours") == Conflicted(theirs.etag)
    assert proxy.dropped == 1
    proxy.drop_next_response()
    assert store.put_if_match("k", b"ours", '"stale"') == Conflicted(theirs.etag)
    assert store.get("k").data == b"theirs"
    store.close()


def test_requests_that_never_arrived_are_an_error_not_a_result(proxy: ResponseDroppingProxy, s3_bucket: str) -> None:
    store = _through(proxy, s3_bucket, max_attempts=2)
    proxy.drop_next_request(2)  # both attempts; the read-back then gets through
    with pytest.raises(StorageUnavailable) as created:
        store.put_if_absent("k", b"v")
    assert not isinstance(created.value, AccessDenied)
    assert created.value.__cause__ is not None
    first = store.put_if_absent("k", b"v")
    assert isinstance(first, Updated)
    proxy.drop_next_request(2)
    with pytest.raises(StorageUnavailable):
        store.put_if_match("k", b"w", first.etag)  # its precondition still holds
    assert proxy.requests_dropped == 4
    assert store.get("k").etag == first.etag
    store.close()


# -- failures to reach the bucket -------------------------------------------------------


def test_missing_bucket_is_access_denied(s3_endpoint: str) -> None:
    store = open_store(f"s3://bulletin-no-such-bucket-x1?endpoint_url={s3_endpoint}&region=us-east-1")
    for call in (
        lambda: store.get("k"),
        lambda: store.get_if_changed("k", "etag"),
        lambda: store.stat("k"),
        lambda: store.put_if_absent("k", b"v"),
        lambda: store.put_if_match("k", b"v", "etag"),
        lambda: list(store.list("")),
        lambda: store.delete("k"),
    ):
        with pytest.raises(AccessDenied, match="bucket"):
            call()


def test_missing_credentials_are_access_denied(s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_ROLE_ARN",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    store = open_store(s3_url)
    started = time.monotonic()
    with pytest.raises(AccessDenied, match="credentials"):
        store.get("k")
    with pytest.raises(AccessDenied, match="credentials"):
        store.put_if_absent("k", b"v")
    assert time.monotonic() - started < 10


def test_unreachable_endpoint_is_storage_unavailable_quickly(s3_endpoint: str) -> None:
    # s3_endpoint only for the dummy credentials; the port below is closed.
    url = f"s3://bucket?endpoint_url=http://127.0.0.1:{_closed_port()}&max_attempts=2&connect_timeout=1"
    store = open_store(url)
    started = time.monotonic()
    for call in (
        lambda: store.get("k"),
        lambda: store.stat("k"),
        lambda: store.put_if_absent("k", b"v"),
        lambda: store.put_if_match("k", b"v", "etag"),
        lambda: list(store.list("")),
        lambda: store.delete("k"),
    ):
        with pytest.raises(StorageUnavailable) as excinfo:
            call()
        assert not isinstance(excinfo.value, AccessDenied)
        assert excinfo.value.__cause__ is not None
    assert time.monotonic() - started < 20


# -- endpoints from the environment, as boto3 resolves them ------------------------------


def _round_trip(store: Store) -> None:
    assert isinstance(store.put_if_absent("k", b"v"), Updated)
    assert store.get("k").data == b"v"


def test_aws_endpoint_url_s3_is_honoured(s3_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")  # less specific
    store = open_store(f"s3://{s3_bucket}?region={S3_TEST_REGION}")
    assert isinstance(store, S3Store)
    assert store.endpoint_url == s3_endpoint
    _round_trip(store)


def test_aws_endpoint_url_is_honoured(s3_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    store = open_store(f"s3://{s3_bucket}?region={S3_TEST_REGION}")
    assert isinstance(store, S3Store)
    assert store.endpoint_url == s3_endpoint
    _round_trip(store)


def test_endpoint_in_the_url_beats_the_environment(s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{_closed_port()}")
    _round_trip(open_store(s3_url))


def test_region_from_the_environment(s3_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    store = open_store(f"s3://{s3_bucket}?endpoint_url={s3_endpoint}")
    assert isinstance(store, S3Store)
    assert store.region == "eu-west-3"
    _round_trip(store)  # LocalStack serves every region
