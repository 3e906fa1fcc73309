"""The publisher's base (bulletin.base): one owner of the last committed bits, kept in a
memory-mapped cache folder, verified when opened, rebuilt only when it must be, and
moved only by a commit; publish_async's snapshot; memory that does not grow with the model."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bulletin import Publisher, Subscriber
from bulletin.base import STATE_NAME
from bulletin.checkpoint import Checkpoint, write_checkpoint
from bulletin.maintenance import verify
from bulletin.run import Run
from bulletin.storage import Downloaded, ObjectData, open_store
from bulletin.storage.wrapper import WrapperStore
from bulletin.target import ArrayTarget
from patcher.cast import cast_bits
from patcher.context import choose_window
from patcher.context_diff import SMALLEST, RankedDelta, diff_ranked
from patcher.decode import read_shard_header
from patcher.format import ContextEntry
from patcher.patch import TensorSpec
from schemas.manifest import PatchRefV2
from tests.run.helpers import ToyTrainer, assert_bits_equal
from tests.run.test_device_recovery import _on_device, emulated_device  # noqa: F401 - a fixture

ROOT = Path(__file__).resolve().parents[2]


class ReadLog(WrapperStore):
    """Records every key read, whole or to a file."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.read: list[str] = []

    def get(self, key: str, *, max_bytes: int | None = None) -> ObjectData:
        self.read.append(key)
        return super().get(key, max_bytes=max_bytes)

    def get_to_file(
        self, key: str, path: Any, *, sha256: str | None = None, max_bytes: int | None = None
    ) -> Downloaded:
        self.read.append(key)
        return super().get_to_file(key, path, sha256=sha256, max_bytes=max_bytes)

    def keyframe_reads(self) -> list[str]:
        return [key for key in self.read if "/keyframes/" in key]


def _synced(url: str, version: int) -> dict[str, np.ndarray]:
    node = ArrayTarget()
    assert Subscriber(url, "run", target=node).sync(version) == version
    return dict(node.arrays)


def _publish(url: str, cache: Path, trainer: ToyTrainer, versions: int, **kwargs: Any) -> list[dict[str, np.ndarray]]:
    served = []
    with Publisher(url, "run", keyframe_every=kwargs.pop("keyframe_every", 100), cache_dir=cache, **kwargs) as pub:
        for _ in range(versions):
            if pub.version is not None or served:
                trainer.step()
            pub.publish(trainer.state)
            served.append(trainer.served())
    return served


def test_publish_async_publishes_the_bits_the_tensors_held_when_it_returned(tmp_path: Path) -> None:
    url = str(tmp_path / "bucket")
    rng = np.random.default_rng(3)
    state: dict[str, Any] = {
        "f32": rng.standard_normal(5000).astype(np.float32),  # cast: the one copy is the cast
        "i64": np.arange(300, dtype=np.int64),  # served as it is: a plain copy
        "t_bf16": torch.randn(70, 30).to(torch.bfloat16),  # torch, served as it is
        "t_f32": torch.randn(40, 30),  # torch, cast
    }
    with Publisher(url, "run", keyframe_every=2, cache_dir=tmp_path / "cache") as pub:
        expected = []
        for _ in range(4):  # keyframes and patches
            want = {
                "f32": cast_bits(state["f32"].view(np.uint32), "F32", "BF16"),
                "i64": state["i64"].view(np.uint64).copy(),
                "t_bf16": state["t_bf16"].view(torch.uint16).numpy().copy(),
                "t_f32": state["t_f32"].to(torch.bfloat16).view(torch.uint16).numpy().copy(),
            }
            future = pub.publish_async(state)
            # The caller's next step, at once, in place: none of it may reach the version.
            state["f32"] += np.float32(0.5)
            state["i64"] += 7
            state["t_bf16"].add_(1.0)
            state["t_f32"].mul_(3.0)
            expected.append((future, want))
        pub.flush()
    for future, want in expected:
        assert_bits_equal(_synced(url, future.result().version), want)


def test_a_restarted_publisher_resumes_from_its_cache_without_reading_a_keyframe(tmp_path: Path) -> None:
    url, cache = str(tmp_path / "bucket"), tmp_path / "cache"
    trainer = ToyTrainer(seed=5)
    _publish(url, cache, trainer, 3)
    state = json.loads((cache / STATE_NAME).read_text())
    assert state["version"] == 3
    store = ReadLog(open_store(url))
    trainer.step()
    with Publisher(store, "run", keyframe_every=100, cache_dir=cache) as pub:
        assert pub.publish(trainer.state) == 4
    assert store.keyframe_reads() == []
    assert_bits_equal(_synced(url, 4), trainer.served())


def test_a_damaged_cache_is_found_and_rebuilt_from_the_run(tmp_path: Path) -> None:
    url, cache = str(tmp_path / "bucket"), tmp_path / "cache"
    trainer = ToyTrainer(seed=6)
    _publish(url, cache, trainer, 3)
    folder = cache / json.loads((cache / STATE_NAME).read_text())["folder"]
    (data,) = folder.glob("*.safetensors")
    with open(data, "r+b") as fh:  # one bit of one tensor's data, flipped on disk
        fh.seek(-3, 2)
        byte = fh.read(1)
        fh.seek(-3, 2)
        fh.write(bytes([byte[0] ^ 0x10]))
    store = ReadLog(open_store(url))
    trainer.step()
    with Publisher(store, "run", keyframe_every=100, cache_dir=cache) as pub:
        assert pub.publish(trainer.state) == 4
    assert store.keyframe_reads(), "a damaged cache must be rebuilt from the run's keyframe"
    assert_bits_equal(_synced(url, 4), trainer.served())
    assert verify(Run(open_store(url), "run")).ok


def test_a_cache_behind_the_run_catches_up_by_its_patches(tmp_path: Path) -> None:
    url = str(tmp_path / "bucket")
    trainer = ToyTrainer(seed=7)
    _publish(url, tmp_path / "a", trainer, 2)  # publisher A's cache holds version 2
    trainer.step()
    _publish(url, tmp_path / "b", trainer, 2)  # B resumes (its own cache) and publishes 3, 4
    store = ReadLog(open_store(url))
    trainer.step()
    with Publisher(store, "run", keyframe_every=100, cache_dir=tmp_path / "a") as pub:
        assert pub.publish(trainer.state) == 5
    assert store.keyframe_reads() == []
    assert [k for k in store.read if "/patches/" in k]  # versions 3 and 4, applied to the cache
    assert_bits_equal(_synced(url, 5), trainer.served())


def test_a_failed_publish_leaves_the_base_at_the_committed_version(tmp_path: Path) -> None:
    from tests.run.test_device_recovery import FailingUploads

    url, cache = str(tmp_path / "bucket"), tmp_path / "cache"
    store = FailingUploads(open_store(url))
    trainer = ToyTrainer(seed=8)
    pub = Publisher(store, "run", keyframe_every=100, cache_dir=cache)
    pub.publish(trainer.state)
    trainer.step()
    pub.publish(trainer.state)
    committed = json.loads((cache / STATE_NAME).read_text())
    trainer.step()
    store.uploads_fail = True
    with pytest.raises(Exception, match="injected"):
        pub.publish(trainer.state)
    assert json.loads((cache / STATE_NAME).read_text()) == committed
    assert pub.version == 2
    store.uploads_fail = False
    trainer.step()
    assert pub.publish(trainer.state) == 3
    pub.close()
    assert_bits_equal(_synced(url, 3), trainer.served())


def test_a_second_publisher_on_a_held_cache_works_in_its_own(tmp_path: Path) -> None:
    url, cache = str(tmp_path / "bucket"), tmp_path / "cache"
    first = Publisher(url, "run", cache_dir=cache)
    second = Publisher(url, "other", cache_dir=cache)
    try:
        assert first.cache_dir == cache
        assert second.cache_dir != cache and second.cache_dir.is_dir()
        second.publish({"w": np.ones(8, np.float32)})
    finally:
        first.close()
        second.close()
    assert not second.cache_dir.exists()  # a temporary cache goes with its publisher


@pytest.mark.usefixtures("emulated_device")
def test_queued_gpu_snapshots_are_context_coded_against_the_committed_base(tmp_path: Path) -> None:
    """Several snapshots diffed on the device before the first one commits: each is
    encoded against its own base, the committed host bits, not the device's newer ones."""
    url = str(tmp_path / "bucket")
    trainer = ToyTrainer(seed=9)
    served = []
    with Publisher(url, "run", keyframe_every=100, codec="context", queue_size=3, cache_dir=tmp_path / "c") as pub:
        for step in range(6):
            if step:
                trainer.step()
            pub.publish_async(_on_device(trainer.state))
            served.append(trainer.served())
        pub.flush()
    for version, bits in enumerate(served, start=1):
        assert_bits_equal(_synced(url, version), bits)


CRASH_POINTS = ["base", "state"]


@pytest.mark.parametrize("crash_at", CRASH_POINTS)
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_a_publisher_killed_while_its_base_advances_resumes_exactly(tmp_path: Path, crash_at: str, steps: int) -> None:
    url, run = str(tmp_path / "bucket"), "run"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.run.crash_publisher", url, run, "13", str(steps), crash_at],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if crash_at == "base" and steps == 1:  # a keyframe advances by switching folders: no patch written
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == -signal.SIGKILL, proc.stderr
    trainer = ToyTrainer(seed=13)
    for _ in range(steps):
        trainer.step()
    with Publisher(url, run, keyframe_every=3) as pub:  # the same cache folder, found from the environment
        assert pub.publish(trainer.state) == steps + 1
    assert_bits_equal(_synced(url, steps + 1), trainer.served())
    assert verify(Run(open_store(url), run)).ok


def _peak_anon(work: Any) -> int:
    """Peak anonymous memory (RssAnon, sampled) while ``work()`` runs, beyond its start."""

    def anon() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no RssAnon")

    start = peak = anon()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, anon())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return max(peak, anon()) - start


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_publishing_holds_a_fraction_of_the_model_beyond_the_callers_tensors(tmp_path: Path) -> None:
    """publish() of BF16 tensors and publish_checkpoint() read them in place, diff one at
    a time: a keyframe and a patch take well under the model's size (the code before
    held two to three copies)."""
    url, cache = str(tmp_path / "bucket"), tmp_path / "cache"
    rng = np.random.default_rng(0)
    state = {
        f"layers.{i}.weight": torch.from_numpy(rng.standard_normal((1024, 2048), dtype=np.float32) * 0.02).to(
            torch.bfloat16
        )
        for i in range(24)
    }  # 96 MiB of BF16
    model = sum(t.numel() * 2 for t in state.values())
    with Publisher(url, "run", keyframe_every=100, cache_dir=cache) as pub:
        keyframe = _peak_anon(lambda: pub.publish(state))
        for tensor in state.values():  # an Adam-like step: 0.4% of elements move one BF16 step
            flat = tensor.view(-1).view(torch.int16)
            where = torch.from_numpy(rng.choice(flat.numel(), size=flat.numel() // 250, replace=False))
            flat[where] += 1
        patch = _peak_anon(lambda: pub.publish(state))
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, *_specs_and_bits(state, rng))
    with Publisher(url, "run", keyframe_every=100, cache_dir=cache) as pub:
        checkpoint = _peak_anon(lambda: pub.publish_checkpoint(folder))
    for what, used in (("keyframe", keyframe), ("patch", patch), ("checkpoint", checkpoint)):
        assert used < 0.25 * model, f"{what} publish held {used / model:.2f}x the model beyond its tensors"
    with Checkpoint(folder) as ckpt:
        assert_bits_equal(_synced(url, 3), {name: np.array(ckpt.bits(name)) for name in ckpt})


def _specs_and_bits(state: dict[str, torch.Tensor], rng: np.random.Generator) -> tuple[Any, Any]:
    from patcher.patch import TensorSpec

    specs, bits = {}, {}
    for name, tensor in state.items():
        b = tensor.view(torch.int16).numpy().view(np.uint16).copy().reshape(-1)
        where = rng.choice(b.size, size=b.size // 250, replace=False)
        b[where] += 1
        specs[name] = TensorSpec(name, "BF16", tuple(tensor.shape))
        bits[name] = b.reshape(tensor.shape)
    return specs, bits


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_bench_scale_charges_a_patch_publish_only_the_publishers_memory(tmp_path: Path) -> None:
    """scripts/bench_scale.py counts a Python publish's memory from the moment the caller's
    tensors are loaded. Loaded as safetensors' ``load_file`` hands them out (views of a
    private memory map), the caller's in-place step between versions turns every page it
    touches anonymous, and the model's size was charged to the patch (1.07x, against
    bench_publish.py's 0.07x for the same publish): the script's tensors must own their
    memory, and the publisher then holds a fraction of the model, keyframe to patch."""
    from scripts import bench_scale

    model = bench_scale.Llama.of_size(96e6)
    order = list(model.shapes())
    v1, _ = bench_scale.ensure_versions(tmp_path / "folders", model, seed=0, share=0.004, shard_bytes=32 << 20)
    state = bench_scale.load_state(v1)

    def keyframe_step_patch() -> None:
        with Publisher(str(tmp_path / "bucket"), "run", keyframe_every=100, cache_dir=tmp_path / "cache") as pub:
            pub.publish(state, files=v1)
            bench_scale.apply_to_state(state, 2, order, 0.004, 0)
            pub.publish(state)

    used = _peak_anon(keyframe_step_patch)
    assert used < 0.25 * model.nbytes, f"held {used / model.nbytes:.2f}x the model beyond the caller's tensors"
    _, v2 = bench_scale.ensure_versions(tmp_path / "folders", model, seed=0, share=0.004, shard_bytes=32 << 20)
    assert_bits_equal(_synced(str(tmp_path / "bucket"), 2), dict(bench_scale.tensor_views(v2)))


@pytest.mark.parametrize("codec", ["auto", "context"])
def test_big_tensors_are_ranked_as_they_are_diffed_and_sync_exactly(tmp_path: Path, codec: str) -> None:
    """Tensors of at least SMALLEST elements take the diff that ranks as it scans
    (patcher.context_diff): their patches are context-coded with its windows and every
    version syncs to the trainer's bits."""
    url = str(tmp_path / "bucket")
    shapes = {"big.weight": (512, SMALLEST // 512 + 7), "norm.weight": (256,)}
    trainer = ToyTrainer(seed=4, shapes=shapes)
    served = []
    with Publisher(url, "run", keyframe_every=100, codec=codec, cache_dir=tmp_path / "c") as pub:
        for step in range(4):
            if step:
                trainer.step(lr=3e-6)
            pub.publish(trainer.state)
            served.append(trainer.served())
    run = Run(open_store(url), "run")
    specs = {name: TensorSpec(name, "BF16", shape) for name, shape in shapes.items()}
    distinct = 0  # versions where the ranked window is not the plain encoder's: the check bites
    for stored, (before, after) in zip(run.read_manifests([2, 3, 4]), itertools.pairwise(served), strict=True):
        patch = stored.manifest.patch
        assert isinstance(patch, PatchRefV2) and patch.codec == "context"
        ranked = diff_ranked(specs, before, after).tensors["big.weight"]
        assert isinstance(ranked, RankedDelta)
        windows = {
            entry.tensor: entry.window
            for data in run.download(patch.shards)
            for entry in read_shard_header(data).entries
            if isinstance(entry, ContextEntry)
        }
        assert windows["big.weight"] == ranked.window
        base = before["big.weight"]
        distinct += ranked.window != choose_window(base, "BF16", 0, base.size, ranked.indices)
    assert distinct
    for version, bits in enumerate(served, start=1):
        assert_bits_equal(_synced(url, version), bits)
