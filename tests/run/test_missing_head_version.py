"""A head naming a version that is not in the bucket does not block syncing.

A partial rollback, or a garbage collection racing the head, can leave ``head.json``
pointing at a manifest that is gone. ``Run.tip`` then falls back to the newest
version the bucket does hold, with a warning; it never reports one that is not there
(whether a node already holds a newer version is the sync's check, not the tip's).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import pytest

from bulletin import Subscriber
from bulletin.run import Run
from bulletin.storage import open_store
from bulletin.target import ArrayTarget
from tests.run.helpers import assert_bits_equal, publish_versions


def _publish(bucket: Path, versions: int) -> list[dict[str, np.ndarray]]:
    return publish_versions(bucket, "run", versions, seed=51, keyframe_every=3)


def _delete_manifest(run: Run, version: int) -> None:
    run.store.delete(run.key(f"manifests/{version:020d}.json"))


def test_sync_reaches_the_newest_version_left_when_the_head_names_a_missing_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bucket = tmp_path / "bucket"
    served = _publish(bucket, 5)
    run = Run(open_store(bucket), "run")
    node = ArrayTarget()
    behind = Subscriber(bucket, "run", target=node)
    assert behind.sync(2) == 2
    _delete_manifest(run, 5)
    assert run.read_head().head.version == 5  # type: ignore[union-attr]
    with caplog.at_level(logging.WARNING, logger="bulletin.run"):
        tip = run.tip()
    assert tip is not None and tip.version == 4
    assert "names version 5, which is not in the bucket" in caplog.text
    assert behind.sync() == 4
    assert_bits_equal(node.arrays, served[3])
    fresh = ArrayTarget()
    assert Subscriber(bucket, "run", target=fresh).sync() == 4
    assert_bits_equal(fresh.arrays, served[3])


def test_versions_past_a_missing_head_version_are_still_found(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    served = _publish(bucket, 5)
    run = Run(open_store(bucket), "run")
    v5 = run.read_manifest(5)
    head = run.read_head()
    assert head is not None
    # The head left at 3 (a crash before it moved), and 3 itself removed since.
    stale = head.head.model_copy(update={"version": 3, "manifest_digest": run.read_manifest(3).digest})
    run.store.put_if_match(run.key("head.json"), stale.model_dump_json().encode(), head.etag)
    _delete_manifest(run, 3)
    tip = run.tip()
    assert tip is not None and tip.version == 5 and tip.digest == v5.digest
    fresh = ArrayTarget()
    assert Subscriber(bucket, "run", target=fresh).sync() == 5  # from the keyframe of 4
    assert_bits_equal(fresh.arrays, served[4])


def test_a_head_with_no_manifest_left_at_all_is_a_run_without_versions(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    _publish(bucket, 2)
    run = Run(open_store(bucket), "run")
    for version in (1, 2):
        _delete_manifest(run, version)
    assert run.read_head() is not None
    assert run.tip() is None


def test_following_a_run_whose_head_names_a_missing_version_reaches_the_newest_left(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    served = _publish(bucket, 5)
    run = Run(open_store(bucket), "run")
    node = ArrayTarget()
    sub = Subscriber(bucket, "run", target=node)
    assert sub.sync(2) == 2
    _delete_manifest(run, 5)
    errors: list[Exception] = []
    stop = threading.Event()

    def failed(exc: Exception) -> None:  # one failure ends the loop: the test never hangs
        errors.append(exc)
        stop.set()

    assert next(sub.follow(interval=0.01, stop=stop, on_error=failed), None) == 4, errors
    assert_bits_equal(node.arrays, served[3])
