"""The sparse-patch fallback against vLLM's own MoE layer and sparse loader (optional:
needs vLLM's source, ``BULLETIN_TEST_VLLM_PATH``, as tests/tp/test_vllm_layers.py).

Each of ``tp`` spawned ranks (a real gloo group set up by vLLM's
``init_distributed_environment`` / ``initialize_model_parallel``) builds vLLM 0.33.0's
``FusedMoEFactory`` experts (commit ``4ba787ec9``: ``layers/fused_moe/layer.py``,
``routed_experts.py``; the class rules refuse MoE) next to a ``RowParallelLinear`` and an
``RMSNorm`` (patched in place), loads them with vLLM's ``AutoWeightsLoader``, and drives
the worker extension's :class:`~bulletin.engines.vllm.WorkerState` through JSON
requests as the sidecar does: bind (the probe of vLLM's ``RoutedExperts.weight_loader``
through ``load_checkpoint_weight_patches``), fingerprints, apply from encoded shards. The
one thing replaced is the MoE *kernel* choice (``select_unquantized_moe_backend``: no
CPU kernel imports here), never a loader.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

VLLM_PATH = os.environ.get("BULLETIN_TEST_VLLM_PATH")
pytestmark = pytest.mark.skipif(not VLLM_PATH, reason="BULLETIN_TEST_VLLM_PATH (vLLM's source) is not set")

EXPERTS, HIDDEN, INTER = 4, 16, 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _checkpoint_specs() -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {
        "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        "model.norm.weight": (HIDDEN,),
    }
    for e in range(EXPERTS):
        for proj, shape in (
            ("gate_proj", (INTER, HIDDEN)),
            ("up_proj", (INTER, HIDDEN)),
            ("down_proj", (HIDDEN, INTER)),
        ):
            out[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = shape
    return out


def _bits(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)  # finite BF16 values
    out = {}
    for n, shape in _checkpoint_specs().items():
        k = int(np.prod(shape))
        sign = rng.integers(0, 2, k).astype(np.uint16) << 15
        out[n] = sign | (rng.integers(0x70, 0x90, k).astype(np.uint16) << 7) | rng.integers(0, 128, k).astype(np.uint16)
    return out


def _rank(rank: int, tp: int, port: int, out: Any) -> None:
    sys.path[:0] = (VLLM_PATH or "").split(os.pathsep)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        out.put((rank, _run(rank, tp, port)))
    except BaseException as exc:
        out.put((rank, exc))
        raise


def _run(rank: int, tp: int, port: int) -> dict[str, Any]:
    import json

    import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method as unquantized
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm.model_executor.models.utils import AutoWeightsLoader

    from bulletin.engines.rank_layout import RankLayout
    from bulletin.engines.vllm import WorkerState
    from bulletin_kernels.dispatch import as_bits
    from patcher.encode import encode
    from patcher.fingerprint import fingerprint, format_fingerprint, parse_fingerprint
    from patcher.patch import Patch, TensorDelta, TensorSpec

    def fmt(fps: dict[str, int]) -> dict[str, str]:
        return {n: format_fingerprint(v) for n, v in fps.items()}

    # The kernel choice only (no MoE kernel runs here); the loaders are vLLM's.
    unquantized.select_unquantized_moe_backend = lambda moe_config: (UnquantizedMoeBackend.TRITON, None)  # type: ignore[assignment]
    bf16 = torch.bfloat16
    shapes = _checkpoint_specs()
    specs = {n: TensorSpec(n, "BF16", s) for n, s in shapes.items()}
    spec_json = [{"name": n, "dtype": "BF16", "shape": list(s)} for n, s in shapes.items()]

    class Root(torch.nn.Module):
        def load_weights(self, weights: Any) -> set[str]:
            return AutoWeightsLoader(self).load_weights(weights)

    def build() -> Root:
        # A config of its own per model: vLLM registers each MoE layer's name in it.
        with set_current_vllm_config(VllmConfig()):
            root = Root()
            root.model = torch.nn.Module()
            layer = torch.nn.Module()
            layer.self_attn = torch.nn.Module()
            layer.self_attn.o_proj = RowParallelLinear(HIDDEN, HIDDEN, bias=False, params_dtype=bf16)
            layer.mlp = torch.nn.Module()
            layer.mlp.experts = FusedMoEFactory(
                num_experts=EXPERTS, top_k=2, hidden_size=HIDDEN, intermediate_size=INTER, params_dtype=bf16,
                prefix="model.layers.0.mlp.experts",
            )  # fmt: skip
            root.model.layers = torch.nn.ModuleList([layer])
            root.model.norm = RMSNorm(HIDDEN).to(bf16)
            return root

    def load(root: Root, bits: dict[str, np.ndarray]) -> None:
        root.load_weights(
            [(n, torch.from_numpy(b.view(np.int16).copy()).view(bf16).reshape(shapes[n])) for n, b in bits.items()]
        )

    def state(root: Root) -> dict[str, np.ndarray]:
        return {n: as_bits(p.data).copy() for n, p in root.named_parameters()}

    def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
        return a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)

    def patch_of(base: dict[str, np.ndarray], seed: int) -> tuple[Patch, dict[str, np.ndarray]]:
        rng = np.random.default_rng(seed)
        tds, new_bits = {}, {}
        for n, s in specs.items():
            idx = np.sort(rng.choice(s.numel, size=max(1, s.numel // 25), replace=False)).astype(np.int64)
            new = base[n].copy()
            new[idx] ^= rng.integers(1, 64, idx.size).astype(np.uint16)  # mantissa bits: finite
            new_bits[n] = new
            tds[n] = TensorDelta(s, idx, new[idx] - base[n][idx], fingerprint(base[n]), fingerprint(new))
        return Patch(tds), new_bits

    def shards(patch: Patch, folder: Path, stem: str) -> list[str]:
        paths = []
        for i, shard in enumerate(encode(patch, codec="lz4")):
            path = folder / f"{stem}-{i}.bpatch"
            path.write_bytes(shard)
            paths.append(str(path))
        return paths

    with set_current_vllm_config(VllmConfig()), tempfile.TemporaryDirectory() as tmp:
        init_distributed_environment(
            world_size=tp, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=rank, backend="gloo"
        )
        initialize_model_parallel(tensor_model_parallel_size=tp)
        folder = Path(tmp)
        base_bits = _bits(1)
        root = build()
        load(root, base_bits)
        loaded = state(root)
        worker = WorkerState(root)
        bound = worker.handle("bind", json.dumps({"specs": spec_json}))
        assert bound["ok"], bound
        layout = RankLayout.from_json(bound["layout"])
        unchanged_by_bind = same(state(root), loaded)
        key = layout.key
        full = {n: b.reshape(shapes[n]) for n, b in base_bits.items()}
        held = worker.handle("fingerprints", "{}")
        assert held["ok"], held
        base = {n: parse_fingerprint(v) for n, v in held["fingerprints"].items()}

        # 1. A patch through the fallback (experts) and in place (o_proj, norm).
        patch, new_bits = patch_of(base_bits, 2)
        after = layout.partials({n: b.reshape(shapes[n]) for n, b in new_bits.items()})
        applied = worker.handle(
            "apply", json.dumps({"shards": shards(patch, folder, "a"), "fingerprints": {key: fmt(base)},
                                 "expect": {key: fmt(after)}})
        )  # fmt: skip
        assert applied["ok"], applied
        worker.handle("activate", json.dumps({"version": 1}))
        patched = state(root)
        fresh = build()
        load(fresh, new_bits)
        bit_exact = same(patched, state(fresh))

        # 2. A corrupted element of this rank's experts: refused before anything is written.
        w13 = as_bits(root.model.layers[0].mlp.experts.routed_experts.w13_weight.data).reshape(-1)
        w13[-1] ^= 1
        damaged = state(root)
        patch2, new2 = patch_of(new_bits, 3)
        after2 = layout.partials({n: b.reshape(shapes[n]) for n, b in new2.items()})
        body2 = {"shards": shards(patch2, folder, "b"), "fingerprints": {key: fmt(after)}, "expect": {key: fmt(after2)}}
        corrupted = worker.handle("apply", json.dumps(body2))
        corrupted_kept = same(state(root), damaged)
        w13[-1] ^= 1

        # 3. A NaN new value in an element this rank holds: refused with its own error.
        name = "model.layers.0.mlp.experts.1.down_proj.weight"
        piece = layout.pieces[name]
        at = int(piece.where.of(np.array([5], dtype=np.int64))[0])
        nan_bits = {n: b.copy() for n, b in new2.items()}
        nan_bits[name][at] = 0x7FC1
        td = patch2.tensors[name]
        idx = np.union1d(td.indices, [at]).astype(np.int64)
        old = new_bits[name]
        nan_td = TensorDelta(
            specs[name], idx, nan_bits[name][idx] - old[idx], fingerprint(old), fingerprint(nan_bits[name])
        )
        patch3 = Patch({**patch2.tensors, name: nan_td})
        after3 = layout.partials({n: b.reshape(shapes[n]) for n, b in nan_bits.items()})
        before3 = state(root)
        body3 = {"shards": shards(patch3, folder, "c"), "fingerprints": {key: fmt(after)}, "expect": {key: fmt(after3)}}
        nan = worker.handle("apply", json.dumps(body3))
        nan_kept = same(state(root), before3)

        # 4. A loader that scales what it loads (vLLM's own loader, wrapped): refused at bind.
        scaled = build()
        load(scaled, base_bits)
        w2 = scaled.model.layers[0].mlp.experts.routed_experts.w2_weight
        original = w2.weight_loader

        def scaling(param: Any, loaded_weight: Any, *args: Any, **kwargs: Any) -> Any:
            return original(param, loaded_weight * 2, *args, **kwargs)

        w2.weight_loader = scaling
        before4 = state(scaled)
        refused = WorkerState(scaled).handle("bind", json.dumps({"specs": spec_json}))
        refused_kept = same(state(scaled), before4)

        return {
            "layout": layout.to_json(),
            "sparse": sorted(n for n in layout.pieces if ".experts." in n),
            "unchanged_by_bind": unchanged_by_bind,
            "base": {n: int(v) for n, v in base.items()},
            "expected_base": {n: int(v) for n, v in layout.partials(full).items()},
            "applied": {n: int(parse_fingerprint(v)) for n, v in applied["fingerprints"].items()},
            "after": {n: int(v) for n, v in after.items()},
            "bit_exact": bit_exact,
            "corrupted": (corrupted["ok"], corrupted.get("code"), corrupted.get("message")),
            "corrupted_kept": corrupted_kept,
            "nan": (nan["ok"], nan.get("code"), nan.get("message")),
            "nan_at": at,
            "nan_kept": nan_kept,
            "refused": (refused["ok"], refused.get("code"), refused.get("message")),
            "refused_kept": refused_kept,
            "full_before": {n: fingerprint(b) for n, b in base_bits.items()},
            "full_after": {n: fingerprint(b) for n, b in new_bits.items()},
        }


def _spawn(tp: int) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, tp, port, out)) for r in range(tp)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    for _ in range(tp):
        rank, value = out.get(timeout=300)
        if isinstance(value, BaseException):
            raise value
        results[rank] = value
    for p in procs:
        p.join(timeout=60)
    return [results[r] for r in range(tp)]


def test_moe_experts_are_patched_through_vllms_sparse_patches_verified() -> None:
    from bulletin.engines.rank_layout import RankLayout, ReplicaPlan
    from patcher.patch import TensorSpec

    tp = 2
    results = _spawn(tp)
    specs = {n: TensorSpec(n, "BF16", s) for n, s in _checkpoint_specs().items()}
    layouts = [RankLayout.from_json(r["layout"]) for r in results]
    plan = ReplicaPlan(layouts, specs)  # the probed pieces cover every element once
    for r in results:
        assert len(r["sparse"]) == 3 * EXPERTS  # every expert tensor, on every rank
        assert r["unchanged_by_bind"]  # the probe wrote nothing live
        assert r["base"] == r["expected_base"]  # partials read back == partials of the checkpoint
        assert r["applied"] == r["after"]
        assert r["bit_exact"]  # patched == a fresh load of the new bits by vLLM's loaders
        ok, code, message = r["corrupted"]
        assert (ok, code) == (False, "verification_failed") and "nothing was written" in message
        assert r["corrupted_kept"]
        ok, code, message = r["nan"]
        assert (ok, code) == (False, "unrepresentable_nan") and f"element {r['nan_at']}" in message
        assert r["nan_kept"]
        ok, code, message = r["refused"]
        assert (ok, code) == (False, "incompatible_layout") and "transforms values" in message
        assert r["refused_kept"]
    # The ranks' partials sum to the manifest's fingerprints, before and after.
    assert plan.combine([r["base"] for r in results]) == results[0]["full_before"]
    assert plan.combine([r["applied"] for r in results]) == results[0]["full_after"]
    down = layouts[1].pieces["model.layers.0.mlp.experts.0.down_proj.weight"]
    assert (down.where.rows, down.where.run, down.where.stride) == (HIDDEN, INTER // tp, INTER)  # a column slice
