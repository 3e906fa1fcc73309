"""The run on LocalStack: real S3 conditional writes, real safetensors checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bulletin import Publisher, Subscriber
from bulletin.errors import AccessDenied, ConfigError, DigestMismatch, NotFound, StorageUnavailable
from bulletin.maintenance import verify
from bulletin.run import Run
from bulletin.storage import open_store
from bulletin.target import LocalDirTarget
from tests.run.test_crashes import CRASH_POINTS, check_trainer_crash

pytestmark = pytest.mark.integration


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 64, generator=g)
    b = torch.randn(64, generator=g)
    noise = torch.Generator().manual_seed(step)
    w += 1e-3 * step * torch.randn(w.shape, generator=noise)
    return {"model.w": w, "model.b": b, "model.count": torch.tensor(step)}


def test_versions_publish_and_sync_as_real_checkpoints(s3_url: str, tmp_path: Path) -> None:
    node_a, node_b = tmp_path / "a", tmp_path / "b"
    with Publisher(s3_url, "run", keyframe_every=3) as pub:
        for step in range(6):
            ckpt = tmp_path / f"step{step}.safetensors"
            save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in _state(step).items()}, ckpt)
            pub.publish_checkpoint(ckpt)
            if step == 1:
                assert Subscriber(s3_url, "run", node_a).sync() == 2
            if step == 3:
                assert Subscriber(s3_url, "run", node_b).sync() == 4
    a = Subscriber(s3_url, "run", node_a)
    b = Subscriber(s3_url, "run", node_b)
    assert (a.current_version, b.current_version) == (2, 4)
    assert a.sync() == 6 and b.sync(5) == 5
    fresh = Subscriber(s3_url, "run", tmp_path / "fresh")
    assert fresh.sync() == 6
    expected = load_file(tmp_path / "step5.safetensors")
    for sub in (a, fresh):
        assert isinstance(sub.target, LocalDirTarget)
        got = load_file(tmp_path / sub.target.dir.name / "current" / "model.safetensors")
        for name, tensor in expected.items():
            assert torch.equal(got[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)), name
    assert verify(Run(open_store(s3_url), "run")).ok


def test_model_files_travel_through_s3_once(s3_url: str, tmp_path: Path) -> None:
    from bulletin.maintenance import collect_garbage
    from schemas.manifest import manifest_files

    files = {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b'{"model": {}}'}
    with Publisher(s3_url, "files", keyframe_every=2) as pub:
        for step in range(4):
            pub.publish(_state(step), files=files if step != 2 else {**files, "tokenizer.json": b"{}"})
    uploaded = [r.files_uploaded for r in pub.results]
    # Unchanged: nothing; changed: the new bytes; back to older bytes: uploaded again under
    # the new version (a publisher names only its parent's objects, never one gc may remove).
    assert uploaded == [sum(map(len, files.values())), 0, 2, len(files["tokenizer.json"])]
    with Subscriber(s3_url, "files", tmp_path / "node") as sub:
        assert sub.sync(2) == 2 and sub.sync() == 4
    assert (tmp_path / "node" / "current" / "tokenizer.json").read_bytes() == files["tokenizer.json"]
    run = Run(open_store(s3_url), "files")
    collect_garbage(run, keep=1, grace=__import__("datetime").timedelta(0))
    assert verify(run).ok
    kept = {f.key for v in (3, 4) for f in manifest_files(run.read_manifest(v).manifest)}
    listed = {info.key[len(run.root) :] for info in run.objects("files/")}
    assert run.versions() == [3, 4] and listed == kept  # version 1's tokenizer, named by no kept version, went


def test_idle_poll_is_one_small_conditional_request(s3_url: str) -> None:
    with Publisher(s3_url, "run") as pub:
        pub.publish(_state(0))
    sub = Subscriber(s3_url, "run")
    sub.sync()
    run = sub.source
    head = run.read_head()
    assert head is not None
    assert len(head.head.model_dump_json()) < 1024
    assert sub.head_version() == 1
    assert run.poll_head(head.etag) is None  # 304: unchanged


@pytest.mark.parametrize("crash_at", CRASH_POINTS)
def test_trainer_killed_during_a_commit_s3(s3_url: str, crash_at: str) -> None:
    check_trainer_crash(s3_url, crash_at, steps=3)


def test_a_shard_corrupted_in_the_bucket_is_never_applied(s3_url: str, s3_endpoint: str, tmp_path: Path) -> None:
    import boto3

    with Publisher(s3_url, "run") as pub:
        pub.publish(_state(0))
        pub.publish(_state(1))
    node = Subscriber(s3_url, "run", tmp_path / "node")
    node.sync(1)
    before = node.target.full_fingerprints()
    bucket = s3_url.split("//", 1)[1].split("?", 1)[0]
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    key = next(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="run/patches/")["Contents"])
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-5] ^= 1
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with pytest.raises(DigestMismatch):
        node.sync()
    assert node.current_version == 1
    assert node.target.full_fingerprints() == before


def test_bad_urls_missing_buckets_and_wrong_credentials(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError):
        Subscriber("s3://", "run").sync()
    missing = f"s3://no-such-bucket-bulletin?endpoint_url={s3_endpoint}&region=us-east-1"
    with pytest.raises((AccessDenied, NotFound)) as info:
        Subscriber(missing, "run").sync()
    assert "no-such-bucket-bulletin" in str(info.value)
    unreachable = "s3://bucket?endpoint_url=http://127.0.0.1:9&region=us-east-1"
    with pytest.raises(StorageUnavailable):
        Publisher(unreachable, "run").publish(_state(0))
