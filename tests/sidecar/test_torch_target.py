"""TorchTarget: in-place patches on live torch tensors, aliases, rollback, packed views."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch

from bulletin.engines.torch_module import TorchTarget, module_tensors, packed_views
from bulletin.errors import CorruptData, IncompatibleTensors, InvalidInput, VerificationFailed, WrongBase
from bulletin.publisher import Publisher
from bulletin.snapshot import snapshot
from bulletin.subscriber import Subscriber
from patcher.diff import diff
from patcher.fingerprint import fingerprint
from patcher.patch import Patch, TensorDelta, TensorSpec
from scripts._common import llama, llama_config, serving

TINY = llama_config(vocab=96, hidden=32, intermediate=64, layers=1)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().reshape(-1).view(torch.uint8).numpy().view(np.uint16).copy()


def _version(model: torch.nn.Module) -> tuple[dict[str, TensorSpec], dict[str, np.ndarray]]:
    snap = snapshot(model.state_dict(), dtype="BF16")
    return snap.specs, snap.bits


def test_tied_weights_are_served_once_under_the_trainers_name() -> None:
    trainer = llama(TINY, 0)
    served = llama(TINY, 1, dtype=torch.bfloat16)
    target = TorchTarget.from_module(served)
    snap = snapshot(trainer.state_dict(), dtype="BF16")
    assert dict(target.layout()) == snap.specs  # same names, dtypes, shapes as the trainer's
    assert target.aliases == snap.aliases == {"model.embed_tokens.weight": "lm_head.weight"}
    assert "model.rotary_emb.inv_freq" not in target.layout()  # derived, not a weight


def test_load_full_then_patch_in_place_matches_the_trainer_bit_for_bit() -> None:
    trainer = llama(TINY, 0)
    served = llama(TINY, 1, dtype=torch.bfloat16)
    target = TorchTarget.from_module(served)
    specs, v1 = _version(trainer)
    target.load_full(v1, specs)
    storage = served.model.embed_tokens.weight.data_ptr()
    assert target.full_fingerprints() == {n: fingerprint(b) for n, b in v1.items()}
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    _, v2 = _version(trainer)
    patch = diff(specs, v1, v2)
    fps = target.apply(patch, {n: fingerprint(b) for n, b in v1.items()})
    assert fps == {n: fingerprint(b) for n, b in v2.items()}
    for name, tensor in served.state_dict().items():
        if name in v2:
            assert np.array_equal(_bits(tensor), v2[name].reshape(-1)), name
    # The tie survives (one storage, both names) and nothing was reallocated.
    assert served.lm_head.weight.data_ptr() == served.model.embed_tokens.weight.data_ptr() == storage
    assert np.array_equal(_bits(served.model.embed_tokens.weight), v2["lm_head.weight"].reshape(-1))


def _setup() -> tuple[TorchTarget, torch.nn.Linear, Patch, dict[str, int], dict[str, np.ndarray]]:
    torch.manual_seed(3)
    served = serving(torch.nn.Linear(8, 4))
    target = TorchTarget.from_module(served)
    specs = dict(target.layout())
    old = {n: _bits(t).reshape(specs[n].shape) for n, t in target.tensors.items()}
    new = {n: b.copy() for n, b in old.items()}
    new["weight"].reshape(-1)[[1, 5, 30]] += np.uint16(3)
    new["bias"].reshape(-1)[2] ^= np.uint16(0x8000)
    fps = {n: fingerprint(b) for n, b in old.items()}
    return target, served, diff(specs, old, new), fps, old


def test_wrong_base_is_refused_before_anything_changes() -> None:
    target, served, patch, fps, old = _setup()
    wrong = dict(fps, bias=fps["bias"] ^ 1)
    with pytest.raises(WrongBase):
        target.apply(patch, wrong)
    with pytest.raises(WrongBase):
        target.apply(patch, {"weight": fps["weight"]})  # nothing known about bias
    assert np.array_equal(_bits(served.weight), old["weight"].reshape(-1))
    assert np.array_equal(_bits(served.bias), old["bias"].reshape(-1))


def test_a_result_that_does_not_verify_is_rolled_back() -> None:
    target, served, patch, fps, old = _setup()
    bad = dict(patch.tensors)
    td = bad["bias"]
    bad["bias"] = TensorDelta(td.spec, td.indices, td.delta, td.base_fingerprint, td.target_fingerprint ^ 1)
    with pytest.raises(VerificationFailed):
        target.apply(Patch(bad), fps)
    assert np.array_equal(_bits(served.weight), old["weight"].reshape(-1))  # applied first, taken back
    assert np.array_equal(_bits(served.bias), old["bias"].reshape(-1))
    assert target.full_fingerprints() == fps


def test_inconsistent_unchanged_tensor_is_corrupt() -> None:
    target, _, patch, fps, _ = _setup()
    tensors = dict(patch.tensors)
    spec = tensors["bias"].spec
    empty = np.zeros(0, np.int64), np.zeros(0, np.uint16)
    tensors["bias"] = TensorDelta(spec, *empty, fps["bias"], fps["bias"] ^ 7)
    with pytest.raises(CorruptData):
        target.apply(Patch(tensors), fps)


def test_abort_puts_the_previous_version_back_and_activate_commits() -> None:
    target, served, patch, fps, old = _setup()
    new_fps = target.apply(patch, fps)
    assert target.full_fingerprints() == new_fps != fps
    target.abort()
    assert target.full_fingerprints() == fps
    assert np.array_equal(_bits(served.weight), old["weight"].reshape(-1))
    target.abort()  # nothing pending: no-op
    activated: list[int] = []
    target2 = TorchTarget(target.tensors, on_activate=activated.append)
    target2.apply(patch, fps)
    target2.activate(7)
    target2.abort()  # committed: abort has nothing to undo
    assert target2.full_fingerprints() == new_fps and activated == [7] and target2.version == 7


def test_layout_mismatches_are_refused() -> None:
    target, _, _, _, old = _setup()
    specs = dict(target.layout())
    with pytest.raises(IncompatibleTensors):
        target.load_full({"weight": old["weight"]}, {"weight": specs["weight"]})
    wrong = dict(specs, bias=TensorSpec("bias", "F16", specs["bias"].shape))
    with pytest.raises(IncompatibleTensors):
        target.load_full(old, wrong)
    with pytest.raises(IncompatibleTensors):
        target.load_full({**old, "bias": old["bias"].astype(np.uint32)}, specs)


def test_unsupported_tensors_are_refused() -> None:
    with pytest.raises(InvalidInput):
        TorchTarget({})
    with pytest.raises(IncompatibleTensors):
        TorchTarget({"w": torch.zeros(4, 4, dtype=torch.bfloat16).t()})
    with pytest.raises(IncompatibleTensors):
        TorchTarget({"w": torch.zeros(4, dtype=torch.bfloat16, device="meta")})


def test_module_tensors_can_leave_buffers_out() -> None:
    bn = torch.nn.BatchNorm1d(4)
    with_buffers, _ = module_tensors(bn)
    without, _ = module_tensors(bn, include_buffers=False)
    assert "running_mean" in with_buffers and "running_mean" not in without
    assert set(without) == {"weight", "bias"}


class _Fused(torch.nn.Module):
    """Parameters laid out as vLLM lays out a Llama layer: fused and padded."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = torch.nn.Parameter(torch.zeros(8 + 4 + 4, 8, dtype=torch.bfloat16))
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(12 + 12, 8, dtype=torch.bfloat16))
        self.embed = torch.nn.Parameter(torch.zeros(16, 8, dtype=torch.bfloat16))  # vocab 10, padded to 16


def test_packed_views_find_members_inside_fused_parameters() -> None:
    fused = _Fused()
    specs = {
        "q_proj": TensorSpec("q_proj", "BF16", (8, 8)),
        "k_proj": TensorSpec("k_proj", "BF16", (4, 8)),
        "v_proj": TensorSpec("v_proj", "BF16", (4, 8)),
        "gate_proj": TensorSpec("gate_proj", "BF16", (12, 8)),
        "up_proj": TensorSpec("up_proj", "BF16", (12, 8)),
        "embed": TensorSpec("embed", "BF16", (10, 8)),
    }
    views = packed_views(dict(fused.named_parameters()), specs, fused.packed_modules_mapping)
    with torch.no_grad():
        views["k_proj"].fill_(1.0)
        views["up_proj"].fill_(2.0)
        views["embed"].fill_(3.0)
    assert torch.all(fused.qkv_proj[8:12] == 1) and torch.all(fused.qkv_proj[:8] == 0)
    assert torch.all(fused.qkv_proj[12:] == 0)
    assert torch.all(fused.gate_up_proj[12:] == 2) and torch.all(fused.gate_up_proj[:12] == 0)
    assert torch.all(fused.embed[:10] == 3) and torch.all(fused.embed[10:] == 0)


def test_packed_views_refuse_what_they_cannot_place() -> None:
    fused = _Fused()
    params = dict(fused.named_parameters())
    sharded = {
        "q_proj": TensorSpec("q_proj", "BF16", (16, 8)),  # members no longer tile qkv_proj
        "k_proj": TensorSpec("k_proj", "BF16", (4, 8)),
        "v_proj": TensorSpec("v_proj", "BF16", (4, 8)),
    }
    with pytest.raises(IncompatibleTensors, match="q_proj"):
        packed_views(params, sharded, fused.packed_modules_mapping)
    with pytest.raises(IncompatibleTensors):
        packed_views(params, {"embed": TensorSpec("embed", "F16", (10, 8))})
    with pytest.raises(IncompatibleTensors):
        packed_views(params, {"missing": TensorSpec("missing", "BF16", (1,))})


def test_subscriber_drives_a_live_model(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    trainer = llama(TINY, 0)
    served = llama(TINY, 1, dtype=torch.bfloat16)
    target = TorchTarget.from_module(served)
    with Publisher(store, "r", keyframe_every=2) as pub:
        sub = Subscriber(store, "r", target=target)
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
        for step in range(3):
            if step:
                x = torch.randint(0, TINY.vocab_size, (2, 8))
                trainer(input_ids=x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
            version = pub.publish(trainer.state_dict())
            assert sub.sync() == version
            _, expected = _version(trainer)
            live = served.state_dict()
            for name, bits in expected.items():
                assert np.array_equal(_bits(live[name]), bits.reshape(-1)), name


def test_prepare_reads_only_and_apply_then_writes_exactly_that() -> None:
    target, served, patch, fps, old = _setup()
    target.prepare(patch, fps)
    assert np.array_equal(_bits(served.weight), old["weight"].reshape(-1))  # nothing written yet
    assert target.full_fingerprints() == fps
    new = target.apply(patch, fps)
    assert target.full_fingerprints() == new
    assert {n: td.target_fingerprint for n, td in patch.tensors.items()} == new
    # A plan made for other fingerprints is not reused: the apply re-checks and refuses.
    target.abort()
    target.prepare(patch, fps)
    with pytest.raises(WrongBase):
        target.apply(patch, dict(fps, weight=fps["weight"] ^ 1))
    assert target.full_fingerprints() == fps


def test_a_keyframe_is_read_back_from_the_live_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    from bulletin.engines import torch_module

    specs, bits = _version(llama(TINY, 0))
    target = TorchTarget.from_module(llama(TINY, 1, dtype=torch.bfloat16))
    real = torch_module._Slot.overwrite

    def lossy(slot: torch_module._Slot, source: np.ndarray) -> None:
        real(slot, source)
        if slot.spec.name == "model.norm.weight":
            slot.bits.reshape(-1)[0] ^= 1  # a copy that did not land bit for bit

    monkeypatch.setattr(torch_module._Slot, "overwrite", lossy)
    with pytest.raises(VerificationFailed, match=r"model\.norm\.weight"):
        target.load_full(bits, specs)
    monkeypatch.setattr(torch_module._Slot, "overwrite", real)
    target.load_full(bits, specs)
    assert target.full_fingerprints() == {n: fingerprint(b) for n, b in bits.items()}
