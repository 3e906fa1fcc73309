"""S3 through s3fs (``fsspec+s3://``) against LocalStack: the whole store contract (the
16-writer create-only race in separate processes included), lost responses, one-304 idle
polls, and a run published and synced through it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import boto3
import pytest

from bulletin import Publisher, Subscriber
from bulletin.errors import ConfigError
from bulletin.storage import S3fsStore, Store, Updated, fsspec_s3, open_store
from bulletin.storage.s3 import WRITE_ID_METADATA
from bulletin.target import ArrayTarget
from tests.conftest import S3_TEST_REGION
from tests.run.helpers import ToyTrainer, assert_bits_equal
from tests.storage.contract import StoreContract
from tests.storage.tcp_proxy import ResponseDroppingProxy

pytestmark = pytest.mark.integration


def s3fs_url(endpoint: str, bucket: str, prefix: str = "") -> str:
    path = f"{bucket}/{prefix}".rstrip("/")
    return f'fsspec+s3://{path}?endpoint_url={endpoint}&client_kwargs={{"region_name":"{S3_TEST_REGION}"}}'


class TestS3fsStore(StoreContract):
    """Under a prefix; racing writers are processes that each open the store's URL."""

    race_in_processes = True
    file_size = (11 << 20) + 12345
    atomic_file_create = False  # LocalStack: see docs/STORAGE.md, large objects

    @pytest.fixture
    def store(self, s3_endpoint: str, s3_bucket: str) -> Iterator[Store]:
        opened = open_store(s3fs_url(s3_endpoint, s3_bucket, "runs/contract"))
        assert isinstance(opened, S3fsStore)
        # The same filesystem and URL, with multipart uploads from 6 MiB (5 MiB parts).
        store = S3fsStore(
            opened.fs, s3_bucket, "runs/contract", url=opened.url, multipart_threshold=6 << 20, part_size=5 << 20
        )
        yield store
        store.close()
        opened.close()


@pytest.fixture
def raw(s3_endpoint: str) -> Iterator[Any]:
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name=S3_TEST_REGION)
    yield client
    client.close()


def test_objects_are_the_s3_stores_objects(s3_endpoint: str, s3_bucket: str, raw: Any) -> None:
    store = open_store(s3fs_url(s3_endpoint, s3_bucket, "runs/a"))
    created = store.put_if_absent("head.json", b"{}")
    assert isinstance(created, Updated)
    head = raw.head_object(Bucket=s3_bucket, Key="runs/a/head.json")
    assert len(head["Metadata"][WRITE_ID_METADATA]) == 32 and head["ETag"] == created.etag
    boto = open_store(f"s3://{s3_bucket}/runs/a?endpoint_url={s3_endpoint}&region={S3_TEST_REGION}")
    assert boto.get("head.json").etag == created.etag  # one bucket, two clients
    store.close()
    boto.close()


def test_an_idle_poll_is_one_conditional_get(s3_endpoint: str, s3_bucket: str) -> None:
    store = open_store(s3fs_url(s3_endpoint, s3_bucket))
    assert isinstance(store, S3fsStore)
    first = store.put_if_absent("head.json", b"1")
    assert isinstance(first, Updated)
    sent: list[dict[str, bytes]] = []
    store.fs.s3.meta.events.register("before-send.s3", lambda request, **_: sent.append(dict(request.headers)))
    assert store.get_if_changed("head.json", first.etag) is None  # None only for a 304
    assert len(sent) == 1 and sent[0]["If-None-Match"] == first.etag.encode()
    store.close()


def test_a_run_published_and_synced_through_s3fs(s3_endpoint: str, s3_bucket: str) -> None:
    url = s3fs_url(s3_endpoint, s3_bucket, "runs")
    trainer = ToyTrainer(seed=5)
    with Publisher(url, "run", keyframe_every=3) as pub:
        for step in range(4):
            if step:
                trainer.step()
            pub.publish(trainer.state)
    boto = f"s3://{s3_bucket}/runs?endpoint_url={s3_endpoint}&region={S3_TEST_REGION}"
    for source in (url, boto):  # and the boto3 store reads what s3fs wrote
        with Subscriber(source, "run", target=ArrayTarget()) as sub:
            assert sub.sync() == 4
            assert_bits_equal(dict(sub.target.arrays), trainer.served())  # type: ignore[attr-defined]


def test_a_lost_create_response_is_still_our_write(s3_endpoint: str, s3_bucket: str, raw: Any) -> None:
    upstream = urlsplit(s3_endpoint)
    assert upstream.hostname is not None and upstream.port is not None
    with ResponseDroppingProxy(upstream.hostname, upstream.port) as proxy:
        store = open_store(s3fs_url(proxy.endpoint, s3_bucket))
        proxy.drop_next_response()
        outcome = store.put_if_absent("manifests/1.json", b"ours")
        assert proxy.dropped == 1
        assert isinstance(outcome, Updated)  # the re-sent PUT's 412 was our own object
        assert raw.get_object(Bucket=s3_bucket, Key="manifests/1.json")["Body"].read() == b"ours"
        store.close()


def test_a_client_without_conditional_parameters_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # s3fs drops parameters its botocore does not know: a conditional PUT would overwrite.
    store = open_store("fsspec+s3://bucket?endpoint_url=http://127.0.0.1:9")
    assert isinstance(store, S3fsStore)
    model = store.fs.connect().meta.service_model
    fsspec_s3.check_conditional_support(model)  # this botocore knows them
    monkeypatch.setitem(fsspec_s3._CONDITIONAL_PARAMETERS, "PutObject", ("IfMatch", "IfNoneMatch", "IfNothing"))
    with pytest.raises(ConfigError, match="IfNothing"):
        fsspec_s3.check_conditional_support(model)
    store.close()
