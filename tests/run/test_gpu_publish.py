"""The trainer's GPU path gives the same versions as the CPU path (needs a CUDA GPU)."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest

from bulletin import Publisher, Subscriber
from bulletin.run import Run
from bulletin.storage import open_store
from bulletin.target import ArrayTarget

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _pair(publisher: Any) -> tuple[tuple[str, str], tuple[Any, Any]]:
    """Two memory stores and a publisher of each: the CPU's and the GPU's."""
    urls = (f"memory://{uuid.uuid4().hex}", f"memory://{uuid.uuid4().hex}")
    return urls, (publisher(urls[0], "run", keyframe_every=3), publisher(urls[1], "run", keyframe_every=3))


def test_cuda_tensors_publish_the_same_bytes_as_cpu_tensors() -> None:
    torch.manual_seed(0)
    masters = {
        "w": torch.randn(1024, 513) * 0.02,
        "b": torch.randn(513) * 0.02,
        "e": (torch.randn(300, 64) * 0.02).to(torch.bfloat16),
        "n": torch.arange(7),
    }
    (cpu_url, gpu_url), (cpu, gpu) = _pair(Publisher)
    for step in range(7):
        if step:
            for tensor in masters.values():
                if tensor.is_floating_point():
                    tensor.add_((1e-4 * torch.randn(tensor.shape)).to(tensor.dtype))
        cpu.publish(masters)
        gpu.publish({n: t.cuda() for n, t in masters.items()})
    cpu.close()
    gpu.close()
    a, b = Run(open_store(cpu_url), "run"), Run(open_store(gpu_url), "run")
    for version in range(1, 8):
        ma, mb = a.read_manifest(version).manifest, b.read_manifest(version).manifest
        assert ma.tensors == mb.tensors
        assert (ma.patch is None) == (mb.patch is None)
        if ma.patch and mb.patch:
            assert [s.sha256 for s in ma.patch.shards] == [s.sha256 for s in mb.patch.shards]
    target = ArrayTarget()
    Subscriber(gpu_url, "run", target=target).sync()
    for name, t in masters.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        width = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}[want.element_size()]
        assert np.array_equal(target.arrays[name], want.contiguous().view(width).numpy()), name


def test_cuda_blocks_of_a_sharded_job_publish_the_bytes_of_cpu_blocks() -> None:
    # One rank (no process group): each tensor one LocalShard block on the GPU,
    # diffed there (bulletin.base.PublishedBase.device_changes), against the same blocks
    # on the CPU: the same manifests' tensors and patch entries.
    from bulletin.distributed import LocalShard, ShardedPublisher

    torch.manual_seed(1)
    masters = {"w": torch.randn(1024, 513) * 0.02, "b": torch.randn(513) * 0.02}
    (cpu_url, gpu_url), (cpu, gpu) = _pair(ShardedPublisher)
    for step in range(6):
        if step:
            for tensor in masters.values():
                tensor.add_(1e-4 * torch.randn(tensor.shape))
        for pub, device in ((cpu, "cpu"), (gpu, "cuda")):
            pub.publish({n: LocalShard(t.to(device), tuple(t.shape), (0,) * t.ndim) for n, t in masters.items()})
    cpu.close()
    gpu.close()
    a, b = Run(open_store(cpu_url), "run"), Run(open_store(gpu_url), "run")
    for version in range(1, 7):
        ma, mb = a.read_manifest(version).manifest, b.read_manifest(version).manifest
        assert ma.tensors == mb.tensors and (ma.patch is None) == (mb.patch is None)
