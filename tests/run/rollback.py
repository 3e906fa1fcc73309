"""What an operator (or a second trainer) does to a run behind its nodes' backs."""

from __future__ import annotations

from datetime import UTC, datetime

from bulletin.keyspace import HEAD, manifest_key
from bulletin.run import Run
from bulletin.storage import Updated, open_store
from schemas.head import HeadV1
from tests.run.helpers import publish_versions


def rewind(store_url: str, run_name: str, to: int) -> None:
    """Roll the run back to version ``to``: newer manifests deleted, the head moved back."""
    run = Run(open_store(store_url), run_name)
    for version in run.versions():
        if version > to:
            run.store.delete(run.key(manifest_key(version)))
    stored = run.read_manifest(to)
    head = run.read_head()
    assert head is not None
    data = HeadV1(run=run_name, version=to, manifest_digest=stored.digest, updated_at=datetime.now(UTC))
    assert isinstance(run.store.put_if_match(run.key(HEAD), data.model_dump_json().encode(), head.etag), Updated)


def rewrite(store_url: str, run_name: str, versions: int, *, seed: int, keyframe_every: int = 3) -> list[dict]:
    """Replace the whole run with another trainer's chain of ``versions`` versions; returns
    the bits each of them serves."""
    run = Run(open_store(store_url), run_name)
    for info in list(run.objects()):
        run.store.delete(info.key)
    return publish_versions(store_url, run_name, versions, seed=seed, keyframe_every=keyframe_every)
