"""TorchTarget on CUDA tensors: the kernels patch live GPU parameters in place and
land on the same bits and fingerprints as the NumPy twin on the CPU.

Skipped as a whole where torch has no CUDA device or CuPy is missing (CI); run with
``pytest -m gpu tests/sidecar`` on a GPU machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from bulletin.engines.torch_module import TorchTarget
from bulletin.errors import VerificationFailed, WrongBase
from bulletin.snapshot import snapshot
from patcher.diff import diff
from patcher.fingerprint import fingerprint
from patcher.patch import Patch, TensorDelta
from scripts._common import llama, llama_config

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
