"""Fixtures shared by the whole suite: the S3 test server (LocalStack) and its buckets.

``scripts/test.sh`` starts LocalStack and exports ``BULLETIN_TEST_S3_ENDPOINT``; without
it, tests that need S3 are skipped with a reason. Any test using ``s3_endpoint``
(directly or through ``s3_bucket`` / ``s3_url``) is marked ``integration``.
Subfolders add their own fixtures in their own ``conftest.py``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator

import pytest

S3_ENDPOINT_ENV = "BULLETIN_TEST_S3_ENDPOINT"
S3_TEST_REGION = "us-east-1"


def pytest_configure(config: pytest.Config) -> None:
    # botocore probes the EC2 metadata address for credentials when it finds none
    # elsewhere: tests must never send traffic beyond loopback.
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    # Publishers keep their bases in a cache folder (bulletin.base): the session's own,
    # removed at its end, never the developer's ~/.cache (subprocesses inherit it).
    os.environ["BULLETIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="bulletin-test-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(os.environ.pop("BULLETIN_CACHE_DIR", ""), ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    integration = pytest.mark.integration
    for item in items:
        if "s3_endpoint" in getattr(item, "fixturenames", ()):
            item.add_marker(integration)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The LocalStack endpoint URL; skips the test when none is configured.

    For the rest of the session the AWS environment holds LocalStack's dummy
    credentials and nothing else, so that no developer's real credentials, profile
    or endpoint override ever reaches the tests.
    """
    endpoint = os.environ.get(S3_ENDPOINT_ENV, "").strip()
    if not endpoint:
        pytest.skip(
            f"{S3_ENDPOINT_ENV} is not set: run scripts/test.sh, or localstack/start.sh "
            f"and export {S3_ENDPOINT_ENV}=<the URL it prints>"
        )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "test")
        env.setenv("AWS_SECRET_ACCESS_KEY", "test")
        for name in (
            "AWS_SESSION_TOKEN",
            "AWS_PROFILE",
            "AWS_DEFAULT_PROFILE",
            "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3",
            "AWS_REGION",
            "AWS_DEFAULT_REGION",
        ):
            env.delenv(name, raising=False)
        yield endpoint.rstrip("/")


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> Iterator[str]:
    """A new empty bucket on the test server, deleted with its objects afterwards."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name=S3_TEST_REGION)
    name = f"bulletin-test-{uuid.uuid4().hex[:20]}"
    client.create_bucket(Bucket=name)
    try:
        yield name
    finally:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [obj["Key"] for obj in page.get("Contents", ())]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True})
        client.delete_bucket(Bucket=name)
        client.close()


@pytest.fixture
def s3_url(s3_endpoint: str, s3_bucket: str) -> str:
    """``s3://`` URL of a fresh bucket on the test server (see ``s3_bucket``)."""
    return f"s3://{s3_bucket}?endpoint_url={s3_endpoint}&region={S3_TEST_REGION}"


CODEC_PATHS = ("compiled", "numpy")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Tests that compare the two paths themselves run once, on the compiled one.
    if "codec_path" in metafunc.fixturenames:
        both = metafunc.definition.get_closest_marker("compiled_vs_numpy") is None
        metafunc.parametrize("codec_path", CODEC_PATHS if both else CODEC_PATHS[:1], indirect=True)


@pytest.fixture
def codec_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test on the codec's compiled fast path, then on NumPy alone (patcher.native).

    The compiled run is skipped where the extension was not built, unless
    ``BULLETIN_REQUIRE_NATIVE=1`` (scripts/test.sh sets it), where it fails instead.
    """
    from patcher import native

    if getattr(request, "param", "compiled") == "numpy":
        with native.disabled():
            yield "numpy"
        return
    if not native.BUILT:
        if os.environ.get("BULLETIN_REQUIRE_NATIVE") == "1":
            pytest.fail("patcher._speedups was not built, and BULLETIN_REQUIRE_NATIVE=1")
        pytest.skip("patcher._speedups was not built (no C compiler at install time)")
    yield "compiled"
