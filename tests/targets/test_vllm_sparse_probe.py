"""The sparse-patch fallback without vLLM: affine compression, the bind-time probe and
the verified writes, against a stand-in model whose loaders place (or transform)
checkpoint elements and a stand-in of vLLM's sparse loader.

The stand-in loader is the contract of vLLM 0.33.0's
``model_executor/model_loader/checkpoint_weight_patch.py`` (commit ``4ba787ec9``): a
checkpoint-shaped NaN tensor per patch, the values placed at their indices, and the
model's ``load_weights`` run with ``Tensor.copy_`` replaced by a NaN-masked
``torch.where(..., out=destination)``. tests/tp/test_vllm_sparse.py runs vLLM's own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from bulletin.engines.rank_layout import ReplicaPlan  # noqa: E402
from bulletin.engines.torch_module import GlobalIndex  # noqa: E402
from bulletin.engines.vllm_sparse import CheckpointPatch, SparseTarget, bind_rank, compress  # noqa: E402
from bulletin.errors import IncompatibleLayout, UnrepresentableNaN, VerificationFailed  # noqa: E402
from bulletin_kernels.dispatch import as_bits  # noqa: E402
from patcher.fingerprint import fingerprint  # noqa: E402
from patcher.patch import Patch, TensorDelta, TensorSpec  # noqa: E402

E, H, I = 3, 8, 12  # experts, hidden, intermediate  # noqa: E741
BF16 = torch.bfloat16


def nan_masked_load(model: Any, patches: list[CheckpointPatch]) -> object:
    """vLLM's ``load_checkpoint_weight_patches`` contract (see the module notes)."""
    weights = []
    for p in patches:
        flat = torch.full((math.prod(p.shape),), float("nan"), dtype=p.dtype)
        flat.index_copy_(0, p.indices.to(torch.long), p.values.to(p.dtype))
        weights.append((p.name, flat.view(p.shape)))
    original = torch.Tensor.copy_

    def copy_non_nan_(destination: Any, source: Any, non_blocking: bool = False) -> Any:
        if not (destination.is_floating_point() and source.is_floating_point() and destination.shape == source.shape):
            raise NotImplementedError("a same-shaped floating-point final copy")
        source = source.to(dtype=destination.dtype, device=destination.device)
        return torch.where(torch.isnan(source), destination, source, out=destination)

    torch.Tensor.copy_ = copy_non_nan_  # type: ignore[method-assign]
    try:
        return model.load_weights(weights)
    finally:
        torch.Tensor.copy_ = original  # type: ignore[method-assign]


class ToyMoE(torch.nn.Module):  # type: ignore[misc]
    """Experts as vLLM's ``RoutedExperts`` holds them (``w13``: gate and up stacked,
    sliced by rows per rank; ``w2``: down, sliced by columns); the class name is one the
    in-place rules refuse. ``how`` makes the loader transform instead of place."""

    def __init__(self, rank: int, tp: int, how: str = "place") -> None:
        super().__init__()
        self.rank, self.tp, self.how, self.part = rank, tp, how, I // tp
        self.w13 = torch.nn.Parameter(torch.zeros(E, 2 * self.part, H, dtype=BF16), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.zeros(E, H, self.part, dtype=BF16), requires_grad=False)
        self.calls = 0
        self.fail_on: set[int] = set()  # calls that raise

    def weight_loader(self, param: Any, loaded: Any, shard: str, expert: int) -> None:
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError("loader failed midway")
        part = self.part
        if shard == "down":
            src, dst = loaded.narrow(1, self.rank * part, part), param.data[expert]
        else:
            src = loaded.narrow(0, self.rank * part, part)
            dst = param.data[expert].narrow(0, 0 if shard == "gate" else part, part)
        if self.how == "scale":
            src = src * 2
        elif self.how == "offset":
            src = src + 1
        elif self.how == "fill":
            dst.fill_(0)
        dst.copy_(src)


class Toy(torch.nn.Module):  # type: ignore[misc]
    def __init__(self, rank: int = 0, tp: int = 1, how: str = "place") -> None:
        super().__init__()
        layer = torch.nn.Module()
        layer.experts = ToyMoE(rank, tp, how)
        layer.norm = torch.nn.Parameter(torch.zeros(H, dtype=BF16), requires_grad=False)
        self.layers = torch.nn.ModuleList([layer])

    @property
    def experts(self) -> ToyMoE:
        return self.layers[0].experts  # type: ignore[no-any-return]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        done = set()
        for name, tensor in weights:
            if name == "layers.0.norm":
                self.layers[0].norm.data.copy_(tensor)
            else:
                _, _, _, expert, proj, _ = name.split(".")
                shard = proj.removesuffix("_proj")
                param = self.experts.w2 if shard == "down" else self.experts.w13
                self.experts.weight_loader(param, tensor, shard, int(expert))
            done.add(name)
        return done


def _specs() -> dict[str, TensorSpec]:
    specs = {"layers.0.norm": TensorSpec("layers.0.norm", "BF16", (H,))}
    for e in range(E):
        for proj, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            name = f"layers.0.experts.{e}.{proj}_proj.weight"
            specs[name] = TensorSpec(name, "BF16", shape)
    return specs


def _random_bits(specs: dict[str, TensorSpec], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    # Finite BF16 values: sign, exponent 0x70..0x8f, any mantissa.
    out = {}
    for n, s in specs.items():
        sign = rng.integers(0, 2, s.numel).astype(np.uint16) << 15
        exp = rng.integers(0x70, 0x90, s.numel).astype(np.uint16) << 7
        out[n] = (sign | exp | rng.integers(0, 128, s.numel).astype(np.uint16)).reshape(s.shape)
    return out


def _tensors(bits: dict[str, np.ndarray]) -> list[tuple[str, Any]]:
    return [(n, torch.from_numpy(b.view(np.int16).copy()).view(BF16)) for n, b in bits.items()]


def _state(model: Any) -> dict[str, np.ndarray]:
    return {n: as_bits(p.data).copy() for n, p in model.named_parameters()}


def _patch(specs: dict[str, TensorSpec], base: dict[str, np.ndarray], seed: int) -> tuple[Patch, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    tds, new_bits = {}, {}
    for n, s in specs.items():
        flat = base[n].reshape(-1)
        idx = np.sort(rng.choice(s.numel, size=max(1, s.numel // 20), replace=False)).astype(np.int64)
        new = flat.copy()
        new[idx] ^= rng.integers(1, 64, idx.size).astype(np.uint16)  # mantissa bits: stays finite
        delta = (new[idx] - flat[idx]).astype(np.uint16)
        new_bits[n] = new.reshape(s.shape)
        tds[n] = TensorDelta(s, idx, delta, fingerprint(flat), fingerprint(new))
    return Patch(tds), new_bits


# -- compression -----------------------------------------------------------------------------


def test_compress_finds_one_run_or_rows_at_a_stride() -> None:
    assert compress(np.arange(5, 11), np.arange(40, 46), "t") == (5, GlobalIndex(40, 1, 6, 6))
    m = np.arange(12)
    rows = 3 + (m // 4) * 10 + m % 4  # 3 rows of 4 at stride 10
    assert compress(m + 7, rows, "t") == (7, GlobalIndex(3, 3, 4, 10))


@pytest.mark.parametrize(
    ("positions", "indices", "why"),
    [
        (np.array([0, 1, 3]), np.array([0, 1, 2]), "contiguous range"),
        (np.arange(6), np.array([0, 3, 1, 4, 2, 5]), "not compressible"),  # a transpose
        (np.arange(6), np.array([0, 1, 2, 10, 11, 20]), "not compressible"),  # unequal runs
        (np.arange(4), np.array([0, 1, 1, 2]), "not compressible"),  # overlapping rows
    ],
)
def test_compress_refuses_what_one_affine_run_cannot_say(positions: Any, indices: Any, why: str) -> None:
    with pytest.raises(IncompatibleLayout, match=why):
        compress(positions.astype(np.int64), indices.astype(np.int64), "t")


# -- the probe -------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
def test_the_probe_finds_each_experts_piece_and_writes_nothing(tp: int) -> None:
    specs = _specs()
    bits = _random_bits(specs, 1)
    layouts = []
    for rank in range(tp):
        model = Toy(rank, tp)
        model.load_weights(_tensors(bits))
        before = _state(model)
        layout, target = bind_rank(model, specs, tp_rank=rank, tp_size=tp, load=nan_masked_load)
        assert _state(model).keys() == before.keys()
        assert all(np.array_equal(_state(model)[n], before[n]) for n in before)  # the probe changed nothing live
        assert isinstance(target, SparseTarget) and target.inner is not None  # the norm stays in place
        part = I // tp
        gate = layout.pieces["layers.0.experts.1.gate_proj.weight"]
        assert (gate.param, gate.offset) == ("layers.0.experts.w13", 2 * part * H)
        assert gate.where == GlobalIndex(rank * part * H, 1, part * H, part * H)
        down = layout.pieces["layers.0.experts.2.down_proj.weight"]
        assert (down.param, down.offset) == ("layers.0.experts.w2", 2 * H * part)
        assert down.where == (GlobalIndex(rank * part, H, part, I) if tp > 1 else GlobalIndex(0, 1, H * I, H * I))
        # The partials read from the live parameters are those of the checkpoint bits.
        assert target.full_fingerprints() == layout.partials(bits)
        layouts.append(layout)
    plan = ReplicaPlan(layouts, specs)  # the ranks' pieces cover every element once
    assert plan.combine(plan.expected(bits)) == {n: fingerprint(b) for n, b in bits.items()}


@pytest.mark.parametrize(("how", "why"), [("scale", "transforms values"), ("offset", "transforms values"),
                                          ("fill", "fill_ writes")])  # fmt: skip
def test_a_loader_that_does_not_only_place_is_refused_at_bind(how: str, why: str) -> None:
    specs = _specs()
    model = Toy(0, 2, how)
    model.load_weights(_tensors(_random_bits(specs, 2)))
    before = _state(model)
    with pytest.raises(IncompatibleLayout, match=why):
        bind_rank(model, specs, tp_rank=0, tp_size=2, load=nan_masked_load)
    assert all(np.array_equal(_state(model)[n], before[n]) for n in before)  # nothing live was written


def test_without_a_sparse_loader_the_in_place_refusal_stands() -> None:
    with pytest.raises(IncompatibleLayout, match="MoE"):
        bind_rank(Toy(), _specs())  # no vLLM here: no loader to fall back on


# -- verified writes -------------------------------------------------------------------------


def _bound(rank: int = 1, tp: int = 2, seed: int = 3) -> tuple[Toy, Any, SparseTarget, dict[str, np.ndarray]]:
    specs = _specs()
    bits = _random_bits(specs, seed)
    model = Toy(rank, tp)
    model.load_weights(_tensors(bits))
    layout, target = bind_rank(model, specs, tp_rank=rank, tp_size=tp, load=nan_masked_load)
    assert isinstance(target, SparseTarget)
    return model, layout, target, bits


def test_a_patch_lands_bit_exact_as_a_fresh_load_does() -> None:
    model, layout, target, bits = _bound()
    specs = _specs()
    patch, new_bits = _patch(specs, bits, 4)
    base = target.full_fingerprints()
    after = layout.partials(new_bits)
    assert target.apply(layout.local_patch(patch, base, after), base) == after
    assert target.full_fingerprints() == after
    patched = _state(model)
    fresh = Toy(1, 2)
    fresh.load_weights(_tensors(new_bits))
    assert all(np.array_equal(patched[n], b) for n, b in _state(fresh).items())
    target.abort()  # not activated: the old bits come back through the same API
    assert target.full_fingerprints() == base


def test_a_corrupted_element_is_refused_before_anything_is_written() -> None:
    model, layout, target, bits = _bound()
    patch, new_bits = _patch(_specs(), bits, 5)
    base = target.full_fingerprints()
    w13 = as_bits(model.experts.w13.data).reshape(-1)
    w13[-1] ^= 1  # an element the patch may not even touch
    damaged = _state(model)
    with pytest.raises(VerificationFailed, match="nothing was written"):
        target.apply(layout.local_patch(patch, base, layout.partials(new_bits)), base)
    assert all(np.array_equal(_state(model)[n], damaged[n]) for n in damaged)


def test_a_nan_new_value_is_refused_with_its_own_error() -> None:
    model, layout, target, bits = _bound()
    specs = _specs()
    name = "layers.0.experts.0.up_proj.weight"
    patch, new_bits = _patch(specs, bits, 6)
    held = layout.pieces[name].where.of(np.arange(layout.pieces[name].numel, dtype=np.int64))
    at = int(held[3])
    flat = new_bits[name].reshape(-1)
    old = bits[name].reshape(-1)
    flat[at] = 0x7FC1  # a NaN bit pattern
    idx = np.union1d(patch.tensors[name].indices, [at]).astype(np.int64)
    patch.tensors[name] = TensorDelta(specs[name], idx, flat[idx] - old[idx], fingerprint(old), fingerprint(flat))
    base = target.full_fingerprints()
    before = _state(model)
    with pytest.raises(UnrepresentableNaN, match=f"element {at}"):
        target.apply(layout.local_patch(patch, base, layout.partials(new_bits)), base)
    assert all(np.array_equal(_state(model)[n], before[n]) for n in before)


def test_a_failure_midway_is_restored_through_the_same_api() -> None:
    model, layout, target, bits = _bound()
    patch, new_bits = _patch(_specs(), bits, 7)
    base = target.full_fingerprints()
    before = _state(model)
    model.experts.calls, model.experts.fail_on = 0, {4}  # three tensors written, then a failure
    with pytest.raises(VerificationFailed, match="previous bits are restored"):
        target.apply(layout.local_patch(patch, base, layout.partials(new_bits)), base)
    assert target.full_fingerprints() == base
    assert all(np.array_equal(_state(model)[n], before[n]) for n in before)


def test_a_restore_that_cannot_run_reports_the_rank_unverified() -> None:
    model, layout, target, bits = _bound()
    patch, new_bits = _patch(_specs(), bits, 8)
    base = target.full_fingerprints()
    model.experts.calls, model.experts.fail_on = 0, set(range(4, 1000))  # fails midway, and when restoring
    with pytest.raises(VerificationFailed, match="unverified"):
        target.apply(layout.local_patch(patch, base, layout.partials(new_bits)), base)


def test_a_keyframe_loads_through_the_same_api_and_is_read_back() -> None:
    model, layout, target, _ = _bound()
    other = _random_bits(_specs(), 9)
    target.load_full(layout.local_bits(other), target.layout())
    assert target.full_fingerprints() == layout.partials(other)
    fresh = Toy(1, 2)
    fresh.load_weights(_tensors(other))
    assert all(np.array_equal(_state(model)[n], b) for n, b in _state(fresh).items())
