"""TorchTarget on CUDA tensors: the kernels patch live GPU parameters in place and
land on the same bits and fingerprints as the NumPy twin on the CPU; context-coded
patches are resolved on the device (kernels/bulletin_kernels/select.cu) to the CPU path's indices.

Skipped as a whole where torch has no CUDA device or CuPy is missing (CI); run with
``pytest -m gpu tests/sidecar`` on a GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from bulletin import Publisher, Subscriber
from bulletin.engines.torch_module import TorchTarget
from bulletin.errors import VerificationFailed, WrongBase
from bulletin.run import Run
from bulletin.snapshot import snapshot
from bulletin.storage import open_store
from bulletin.target import Held
from patcher.context_decode import decode_changes
from patcher.decode import shard_views
from patcher.diff import diff
from patcher.fingerprint import fingerprint
from patcher.format import DEFAULT_LIMITS
from patcher.patch import Patch, TensorDelta
from scripts._common import llama, llama_config
from tests.run.helpers import ToyTrainer

pytest.importorskip("cupy")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu

CONFIG = llama_config(vocab=512, hidden=128, intermediate=256)


def _models() -> tuple[LlamaForCausalLM, LlamaForCausalLM, LlamaForCausalLM]:
    return llama(CONFIG, 0), llama(CONFIG, 1, dtype=torch.bfloat16), llama(CONFIG, 2, device="cuda")


def test_cuda_and_cpu_targets_agree_bit_for_bit() -> None:
    trainer, cpu, gpu = _models()
    on_cpu, on_gpu = TorchTarget.from_module(cpu), TorchTarget.from_module(gpu)
    v1 = snapshot(trainer.state_dict(), dtype="BF16")
    on_cpu.load_full(v1.bits, v1.specs)
    on_gpu.load_full(v1.bits, v1.specs)
    fps = {n: fingerprint(b) for n, b in v1.bits.items()}
    assert on_gpu.full_fingerprints() == on_cpu.full_fingerprints() == fps
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    v2 = snapshot(trainer.state_dict(), dtype="BF16")
    patch = diff(v1.specs, v1.bits, v2.bits)
    assert on_gpu.apply(patch, fps) == on_cpu.apply(patch, fps)
    for (name, a), b in zip(cpu.state_dict().items(), gpu.state_dict().values(), strict=True):
        assert torch.equal(a.view(torch.int16), b.cpu().view(torch.int16)), name
    storage = gpu.model.embed_tokens.weight.data_ptr()
    assert gpu.lm_head.weight.data_ptr() == storage  # patched in place, tie intact


def test_cuda_failures_leave_the_old_bits() -> None:
    trainer, _, gpu = _models()
    target = TorchTarget.from_module(gpu)
    v1 = snapshot(trainer.state_dict(), dtype="BF16")
    target.load_full(v1.bits, v1.specs)
    fps = {n: fingerprint(b) for n, b in v1.bits.items()}
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    v2 = snapshot(trainer.state_dict(), dtype="BF16")
    patch = diff(v1.specs, v1.bits, v2.bits)
    with pytest.raises(WrongBase):
        target.apply(patch, dict(fps, **{"model.norm.weight": 0}))
    tensors = dict(patch.tensors)
    name = max(tensors, key=lambda n: tensors[n].changed)
    td = tensors[name]
    tensors[name] = TensorDelta(td.spec, td.indices, td.delta, td.base_fingerprint, td.target_fingerprint ^ 1)
    with pytest.raises(VerificationFailed):
        target.apply(Patch(tensors), fps)
    assert target.full_fingerprints() == fps
    target.apply(patch, fps)
    target.abort()
    assert target.full_fingerprints() == fps
    assert np.array_equal(
        gpu.model.norm.weight.cpu().view(torch.int16).numpy(), v1.bits["model.norm.weight"].view(np.int16)
    )


def test_cuda_target_resolves_context_patches_as_the_cpu_one_does(tmp_path: Path) -> None:
    shapes = {"embed.weight": (4096, 256), "proj.weight": (512, 256), "proj.bias": (512,)}
    trainer = ToyTrainer(seed=5, shapes=shapes)
    store = tmp_path / "bucket"
    with Publisher(store, "run", keyframe_every=100, codec="context") as pub:
        for i in range(5):
            if i:
                trainer.step()
            pub.publish(trainer.state)
    on_cpu = TorchTarget({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()})
    on_gpu = TorchTarget({n: torch.zeros(s, dtype=torch.bfloat16, device="cuda") for n, s in shapes.items()})
    assert on_gpu.resolves_context and on_gpu.context_bits() is None
    cpu_sub, gpu_sub = Subscriber(store, "run", target=on_cpu), Subscriber(store, "run", target=on_gpu)
    for version, transitions in ((1, 0), (2, 1), (4, 2)):  # one behind, then two
        assert cpu_sub.sync(version) == gpu_sub.sync(version) == version
        report = gpu_sub.stats.last_report
        assert report is not None and report.transitions == transitions
        assert report.keyframe == (1 if version == 1 else None)  # never a keyframe route again
        _assert_same(on_cpu, on_gpu)
    # The resolve stage itself: the kernel's indices are the NumPy twin's.
    run = Run(open_store(store), "run")
    ref = run.read_manifest(5).manifest.patch
    assert ref is not None
    views, headers, infos = shard_views(run.download(ref.shards), DEFAULT_LIMITS)
    changes = [c for view, header in zip(views, headers, strict=True) for c in decode_changes(view, header)]
    fps = Held.at(run.read_manifest(4)).fingerprints
    want, got = on_cpu.resolve_context(changes, infos, fps), on_gpu.resolve_context(changes, infos, fps)
    for name, td in want.tensors.items():
        assert np.array_equal(got.tensors[name].indices, td.indices), name
        assert np.array_equal(got.tensors[name].delta, td.delta), name
    assert cpu_sub.sync(5) == gpu_sub.sync(5) == 5
    report = gpu_sub.stats.last_report
    assert report is not None and report.keyframe is None and report.transitions == 1
    _assert_same(on_cpu, on_gpu)


def _assert_same(on_cpu: TorchTarget, on_gpu: TorchTarget) -> None:
    assert on_gpu.full_fingerprints() == on_cpu.full_fingerprints()
    for name, tensor in on_cpu.tensors.items():
        assert torch.equal(tensor.view(torch.int16), on_gpu.tensors[name].cpu().view(torch.int16)), name
