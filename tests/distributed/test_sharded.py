"""Sharded publishing with real ranks: the same runs published by 1, 2 and 4 processes
(gloo on CPU) are the same versions, bit for bit (tests/distributed/worker.py).

Each world size is one job, spawned once for every scenario; the three jobs run side by
side, each into its own store, under the same run names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bulletin import Subscriber
from bulletin.run import Run
from bulletin.signing import TrustPolicy
from bulletin.storage import open_store
from schemas.head import HeadV2
from schemas.manifest import manifest_files
from tests.distributed.worker import CONFIG, SIGNING_SEED

pytest.importorskip("torch.distributed")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
WORLDS = (1, 2, 4)
RUNS = {"fsdp": 8, "megatron": 6, "pipeline": 4, "reshard": 4}


def launch(world: int, folder: Path) -> list[subprocess.Popen[bytes]]:
    folder.mkdir(parents=True)
    store = str(folder / "store")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BULLETIN_CACHE_DIR": str(folder / "cache")}
    return [
        subprocess.Popen(
            [sys.executable, "-m", "tests.distributed.worker", str(r), str(world), str(folder / "init"), store],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, str]]:
    root = tmp_path_factory.mktemp("sharded")
    jobs = {world: launch(world, root / f"w{world}") for world in WORLDS}
    failed = []
    for world, procs in jobs.items():
        for rank, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=600)
            if proc.returncode != 0:
                failed.append(f"world {world} rank {rank} exited {proc.returncode}:\n{out.decode()[-3000:]}")
    assert not failed, "\n".join(failed)
    yield {world: str(root / f"w{world}" / "store") for world in WORLDS}


def versions_of(store: str, run: str, last: int) -> list[dict[str, np.ndarray]]:
    """Every version's bits, as a subscriber reconstructs and verifies them."""
    out = []
    sub = Subscriber(store, run)
    for version in range(1, last + 1):
        assert sub.sync(version) == version
        target = sub.target
        out.append({name: np.array(bits, copy=True) for name, bits in target.arrays.items()})  # type: ignore[attr-defined]
    sub.close()
    return out


def tensor_entries(store: str, run: str) -> list[list[dict[str, object]]]:
    r = Run(open_store(store), run)
    return [
        [entry.model_dump() for entry in r.read_manifest(v).manifest.tensors] for v in range(1, r.tip().version + 1)
    ]


@pytest.mark.parametrize("run", sorted(RUNS))
def test_every_world_size_publishes_the_same_versions(stores: dict[int, str], run: str) -> None:
    entries = {world: tensor_entries(store, run) for world, store in stores.items()}
    assert len(entries[1]) == RUNS[run]
    assert entries[2] == entries[1] and entries[4] == entries[1]
    bits = {world: versions_of(store, run, RUNS[run]) for world, store in stores.items()}
    for world in (2, 4):
        for version, (ours, reference) in enumerate(zip(bits[world], bits[1], strict=True), start=1):
            assert sorted(ours) == sorted(reference), (world, version)
            for name in reference:
                assert ours[name].tobytes() == reference[name].tobytes(), (world, version, name)
    # The run really changes, and only in part, between versions (not a trivially equal chain).
    first, second = bits[1][0], bits[1][1]
    assert any(first[n].tobytes() != second[n].tobytes() for n in first)


def test_a_sharded_run_is_the_single_process_run(stores: dict[int, str]) -> None:
    """A subscriber of the FSDP2 run at 2 and 4 ranks holds, at every version, the bits the
    plain Publisher published from one process of the same training."""
    single = versions_of(stores[1], "fsdp-single", RUNS["fsdp"])
    for world in (2, 4):
        sharded = versions_of(stores[world], "fsdp", RUNS["fsdp"])
        for version, (ours, reference) in enumerate(zip(sharded, single, strict=True), start=1):
            assert {n: a.tobytes() for n, a in ours.items()} == {n: a.tobytes() for n, a in reference.items()}, version
    assert tensor_entries(stores[4], "fsdp") == tensor_entries(stores[1], "fsdp-single")


def test_rank_0_signs_every_manifest_and_head_of_the_job(stores: dict[int, str]) -> None:
    # Only rank 0 is given the key (tests/distributed/worker.py's pipeline scenario).
    trust = TrustPolicy([Ed25519PrivateKey.from_private_bytes(SIGNING_SEED).public_key()])
    for store in stores.values():
        run = Run(open_store(store), "pipeline", trust=trust)
        for version in range(1, RUNS["pipeline"] + 1):
            run.read_manifest(version)  # UntrustedVersion / Unsigned unless signed by the key
        head = run.read_head()
        assert head is not None and isinstance(head.head, HeadV2) and head.head.version == RUNS["pipeline"]


def test_rank_0s_model_files_go_with_the_version_and_stay(stores: dict[int, str], tmp_path: Path) -> None:
    for world, store in stores.items():
        run = Run(open_store(store), "pipeline")
        for version in range(1, RUNS["pipeline"] + 1):
            assert [f.path for f in manifest_files(run.read_manifest(version).manifest)] == ["config.json"], world
        sub = Subscriber(store, "pipeline", tmp_path / f"node-{world}")
        assert sub.sync() == RUNS["pipeline"]
        config = json.loads((tmp_path / f"node-{world}" / "current" / "config.json").read_bytes())
        assert config == {**json.loads(CONFIG), "torch_dtype": "bfloat16"}  # names the served dtype
        sub.close()


def test_the_chain_has_keyframes_and_patches(stores: dict[int, str]) -> None:
    r = Run(open_store(stores[4]), "fsdp")
    kinds = [
        ("k" if m.keyframe else "") + ("p" if m.patch else "")
        for m in (r.read_manifest(v).manifest for v in range(1, RUNS["fsdp"] + 1))
    ]
    # keyframe_every=4: versions 1 and 5 in full (5 with its patch too: the layout is the same);
    # the restarted job's steps 7, 8 are patches.
    assert kinds == ["k", "p", "p", "p", "kp", "p", "p", "p"]
    patch = r.read_manifest(2).manifest.patch
    assert patch is not None and len(patch.shards) > 1  # several writer ranks' shards, one patch


def test_a_new_placement_is_published_in_full(stores: dict[int, str]) -> None:
    """Blocks moved between ranks make the next version a keyframe on every rank (the
    same versions as one process's: test_every_world_size_publishes_the_same_versions)."""
    for world, expected in ((1, ["k", "p", "p", "p"]), (2, ["k", "p", "k", "k"]), (4, ["k", "p", "k", "k"])):
        r = Run(open_store(stores[world]), "reshard")
        manifests = [r.read_manifest(v).manifest for v in range(1, RUNS["reshard"] + 1)]
        assert ["k" if m.keyframe else "p" for m in manifests] == expected, world
