"""Hostile objects in the bucket cost bounded memory, never hang, and get one typed line.

Each test puts one hostile object where a run keeps a legitimate one (a shard replaced
by a large or sparse file or a FIFO, a tiny shard whose header claims a billion changes,
manifests far larger than their layout needs), then runs ``bulletin sync`` in a process
of its own (``tests/run/hostile_sync.py``) that measures how far its peak resident set
grew. The node must refuse the version with one line naming a typed error, keep the
version it held bit for bit, and stay within :data:`PEAK_LIMIT` of memory: the largest
legitimate object of each kind here is a few KiB, so that is all "constant".
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import zstandard

from bulletin import Publisher, Subscriber
from bulletin.errors import FormatError
from bulletin.run import Run
from bulletin.storage import Store, Updated, open_store
from patcher.fingerprint import format_fingerprint
from patcher.format import canonical_json
from schemas.head import HeadV1, parse_head
from schemas.manifest import ObjectRef, PatchRef
from tests.patcher.helpers import forge
from tests.run.helpers import ToyTrainer

ROOT = Path(__file__).resolve().parents[2]
RUN = "run"
#: Peak growth of the syncing process's resident set allowed while it refuses an object.
PEAK_LIMIT = 48 << 20
#: What a legitimate sync of the toy run grows by, measured the same way (a sanity bound).
LEGIT_LIMIT = 48 << 20
CHILD_TIMEOUT = 60.0

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="measures memory through Linux's /proc/self"
)


@dataclass
class Bucket:
    url: str
    store: Store
    path: Path | None  # the local store's root; None on S3

    def file(self, key: str) -> Path:
        assert self.path is not None
        return self.path / RUN / key


@pytest.fixture
def local(tmp_path: Path) -> Iterator[Bucket]:
    store = open_store(tmp_path / "bucket")
    yield Bucket(str(tmp_path / "bucket"), store, tmp_path / "bucket")
    store.close()


def _publish(bucket: Bucket, versions: int) -> None:
    trainer = ToyTrainer(seed=5)
    with Publisher(bucket.url, RUN, keyframe_every=1000) as pub:
        for i in range(versions):
            if i:
                trainer.step()
            pub.publish(trainer.state)


def _node(bucket: Bucket, tmp_path: Path, version: int = 1) -> tuple[Path, dict[str, int]]:
    """A node folder synced to ``version``; its fingerprints, recomputed from its bits."""
    node = tmp_path / "node"
    with Subscriber(bucket.url, RUN, node) as sub:
        assert sub.sync(version) == version
        return node, sub.target.full_fingerprints()


def _held(bucket: Bucket, node: Path) -> tuple[int | None, dict[str, int]]:
    with Subscriber(bucket.url, RUN, node) as sub:
        return sub.current_version, sub.target.full_fingerprints()


def _sync_in_child(tmp_path: Path, bucket: Bucket, node: Path) -> tuple[int, int, str]:
    """``bulletin sync`` in a child: (exit status, peak RSS growth in bytes, stderr)."""
    out = tmp_path / "child.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.run.hostile_sync", str(out), bucket.url, RUN, str(node)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
        check=False,
    )
    assert out.exists(), f"the child died (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    result = json.loads(out.read_text())
    return int(result["status"]), int(result["peak_growth"]), proc.stderr


def _assert_refused(tmp_path: Path, bucket: Bucket, node: Path, held: dict[str, int], codes: set[str]) -> int:
    """The child refuses with one typed line, in bounded memory; the node is unchanged."""
    status, grew, stderr = _sync_in_child(tmp_path, bucket, node)
    lines = stderr.strip().splitlines()
    print(f"peak growth {grew / 2**20:.1f} MiB, exit {status}: {lines[-1:]}")
    assert "Traceback" not in stderr, stderr[-3000:]
    assert len(lines) == 1, stderr[-3000:]
    code = lines[0].split(":", 2)[1].strip() if lines[0].startswith("error:") else ""
    assert code in codes, lines[0]
    assert status != 0
    assert grew < PEAK_LIMIT, f"peak resident set grew by {grew / 2**20:.1f} MiB: {lines[0]}"
    assert _held(bucket, node) == (1, held)
    return grew


def _shard_key(bucket: Bucket, version: int) -> str:
    stored = Run(bucket.store, RUN).read_manifest(version)
    assert stored.manifest.patch is not None
    return stored.manifest.patch.shards[0].key


def _replace_manifest(bucket: Bucket, version: int, data: bytes) -> None:
    key = f"{RUN}/manifests/{version:020d}.json"
    bucket.store.delete(key)
    assert isinstance(bucket.store.put_if_absent(key, data), Updated)


def _point_head(bucket: Bucket, version: int, data: bytes) -> None:
    """Move the head to ``version`` whose manifest bytes are ``data`` (as a writer would)."""
    key = f"{RUN}/head.json"
    current = bucket.store.get(key)
    head = parse_head(current.data, source=key)
    new = HeadV1(
        run=RUN, version=version, manifest_digest=hashlib.sha256(data).hexdigest(), updated_at=datetime.now(UTC)
    )
    assert head.version == version
    assert isinstance(bucket.store.put_if_match(key, new.model_dump_json().encode(), current.etag), Updated)


# -- calibration --------------------------------------------------------------------------------


def test_a_legitimate_sync_measured_the_same_way(local: Bucket, tmp_path: Path) -> None:
    _publish(local, 4)
    node, _ = _node(local, tmp_path)
    status, grew, stderr = _sync_in_child(tmp_path, local, node)
    assert status == 0, stderr
    assert grew < LEGIT_LIMIT
    assert _held(local, node)[0] == 4


# -- data objects ---------------------------------------------------------------------------------


def test_a_shard_replaced_by_a_large_object_is_refused_by_its_size(local: Bucket, tmp_path: Path) -> None:
    _publish(local, 3)
    node, held = _node(local, tmp_path)
    path = local.file(_shard_key(local, 3))
    with open(path, "r+b") as f:
        f.truncate(256 << 20)  # a sparse 256 MiB file: reading it costs 256 MiB
    _assert_refused(tmp_path, local, node, held, {"digest_mismatch"})


def test_a_64_gib_sparse_shard_is_refused_without_being_read(local: Bucket, tmp_path: Path) -> None:
    _publish(local, 2)
    node, held = _node(local, tmp_path)
    with open(local.file(_shard_key(local, 2)), "r+b") as f:
        f.truncate(64 << 30)
    _assert_refused(tmp_path, local, node, held, {"digest_mismatch"})


def test_a_fifo_in_place_of_a_shard_does_not_hang_the_sync(local: Bucket, tmp_path: Path) -> None:
    _publish(local, 2)
    node, held = _node(local, tmp_path)
    path = local.file(_shard_key(local, 2))
    path.unlink()
    os.mkfifo(path)  # opened for reading without O_NONBLOCK, it blocks until a writer comes
    _assert_refused(tmp_path, local, node, held, {"digest_mismatch"})


# -- shard headers ----------------------------------------------------------------------------------


def _repeated(byte: int, n: int) -> bytes:
    """One zstd frame (content size recorded) of ``n`` copies of ``byte``, in bounded memory."""
    chunk = bytes([byte]) * (16 << 20)
    obj = zstandard.ZstdCompressor(level=1).compressobj(size=n)
    parts = []
    while n:
        take = min(n, len(chunk))
        parts.append(obj.compress(chunk if take == len(chunk) else chunk[:take]))
        n -= take
    parts.append(obj.flush())
    return b"".join(parts)


def bomb_shard(name: str, changes: int, base: int, target: int) -> bytes:
    """A valid shard of a few tens of KiB: ``changes`` consecutive +1 deltas of a 2**34-element
    U8 tensor ``name``. It decodes to about ``10.5 * changes`` bytes."""
    gap_low, codes, deltas = _repeated(0x01, changes), _repeated(0, changes // 4), _repeated(0x55, changes // 4)
    tensor = {
        "base": format_fingerprint(base),
        "changed": changes,
        "dtype": "U8",
        "shape": [1 << 34],
        "target": format_fingerprint(target),
    }
    entry = {
        "count": changes,
        "delta_escape_width": 0,
        "delta_escapes": 0,
        "gap_escape_width": 0,
        "gap_escapes": 0,
        "start": 0,
        "stop": 1 << 34,
        "tensor": name,
    }
    streams = {
        "gap_low": [0, len(gap_low)],
        "gap_codes": [len(gap_low), len(codes)],
        "gap_escapes": [],
        "delta_codes": [len(gap_low) + len(codes), len(deltas)],
        "delta_escapes": [],
    }
    doc = {
        "entries": [entry],
        "patch": hashlib.sha256(canonical_json({name: tensor})).hexdigest(),
        "shard": 0,
        "shards": 1,
        "streams": streams,
        "tensors": {name: tensor},
    }
    return forge(doc, gap_low + codes + deltas)


def test_a_tiny_shard_claiming_a_billion_changes_is_refused_from_its_header(local: Bucket, tmp_path: Path) -> None:
    _publish(local, 2)
    node, held = _node(local, tmp_path)
    run = Run(local.store, RUN)
    v1, v2 = run.read_manifest(1), run.read_manifest(2)
    name = "model.embed_tokens.weight"
    changes = 1 << 30
    shard = bomb_shard(name, changes, v1.manifest.fingerprints[name], v2.manifest.fingerprints[name])
    assert len(shard) < 64 << 10
    digest = hashlib.sha256(shard).hexdigest()
    key = f"patches/{2:020d}/{digest}.bpatch"
    assert isinstance(local.store.put_if_absent(f"{RUN}/{key}", shard), Updated)
    # The manifest names the shard with its true size and digest: only its header lies.
    patch = PatchRef(
        codec="zstd", shards=(ObjectRef(key=key, size=len(shard), sha256=digest),), changed_elements=changes
    )
    data = v2.manifest.model_copy(update={"patch": patch}).model_dump_json().encode()
    _replace_manifest(local, 2, data)
    _point_head(local, 2, data)
    _assert_refused(tmp_path, local, node, held, {"format_error"})


# -- manifests -------------------------------------------------------------------------------------


@functools.cache
def _extra_tensors(count: int) -> bytes:
    """``count`` JSON tensor entries named ``t0000000``... (after every real name)."""
    return b",".join(
        b'{"name":"t%07d","dtype":"U8","shape":[1],"fingerprint":"0000000000000000"}' % i for i in range(count)
    )


def _padded_manifest(real: bytes, size: int) -> bytes:
    """A manifest that validates, of about ``size`` bytes: the real one with thousands of
    tensors added (costly to parse, unlike whitespace)."""
    doc: dict[str, Any] = json.loads(real)
    listed = json.dumps(doc.pop("tensors"), separators=(",", ":")).encode()
    extra = _extra_tensors(max(0, size - len(real)) // 79)
    body = json.dumps({**doc, "tensors": None}, separators=(",", ":")).encode()
    return body.replace(b'"tensors":null', b'"tensors":' + listed[:-1] + b"," + extra + b"]")


@pytest.mark.parametrize("size", [24 << 20, 6 << 20], ids=["24MiB", "6MiB"])
def test_manifests_far_larger_than_their_layout_needs_are_refused(local: Bucket, tmp_path: Path, size: int) -> None:
    _publish(local, 6)
    node, held = _node(local, tmp_path)
    # Versions 2..5 become manifests of a few hundred thousand tensors; 6, the head's, is real.
    for version in range(2, 6):
        key = f"{RUN}/manifests/{version:020d}.json"
        _replace_manifest(local, version, _padded_manifest(local.store.get(key).data, size))
    _assert_refused(tmp_path, local, node, held, {"object_too_large", "corrupt_data"})


@pytest.mark.parametrize("what", ["manifest", "head"])
def test_a_64_gib_sparse_manifest_or_head_is_refused_without_being_read(
    local: Bucket, tmp_path: Path, what: str
) -> None:
    _publish(local, 2)
    node, held = _node(local, tmp_path)
    key = "head.json" if what == "head" else f"manifests/{2:020d}.json"
    with open(local.file(key), "r+b") as f:
        f.truncate(64 << 30)
    _assert_refused(tmp_path, local, node, held, {"object_too_large"})


# -- the same on S3, where the size comes from the GET response's Content-Length -------------------


@pytest.fixture
def s3(s3_url: str) -> Iterator[Bucket]:
    store = open_store(s3_url)
    yield Bucket(s3_url, store, None)
    store.close()


@pytest.mark.integration
@pytest.mark.parametrize("what", ["shard", "manifest"])
def test_s3_objects_larger_than_allowed_are_refused_before_their_body_is_read(
    s3: Bucket, tmp_path: Path, what: str
) -> None:
    _publish(s3, 3)
    node, held = _node(s3, tmp_path)
    big = bytes(96 << 20)
    if what == "shard":
        key = f"{RUN}/{_shard_key(s3, 3)}"
        s3.store.delete(key)
        assert isinstance(s3.store.put_if_absent(key, big), Updated)
        codes = {"digest_mismatch"}
    else:
        _replace_manifest(s3, 2, big)
        codes = {"object_too_large"}
    del big
    _assert_refused(tmp_path, s3, node, held, codes)


def test_headers_that_count_other_changes_than_their_manifest_are_refused(local: Bucket, tmp_path: Path) -> None:
    _publish(local, 2)
    node, held = _node(local, tmp_path)
    v2 = Run(local.store, RUN).read_manifest(2).manifest
    assert v2.patch is not None
    patch = v2.patch.model_copy(update={"changed_elements": v2.patch.changed_elements + 1})
    data = v2.model_copy(update={"patch": patch}).model_dump_json().encode()
    _replace_manifest(local, 2, data)
    _point_head(local, 2, data)
    with Subscriber(local.url, RUN, node) as sub, pytest.raises(FormatError, match="changed elements"):
        sub.sync()
    assert _held(local, node) == (1, held)
