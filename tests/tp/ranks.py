"""What the TP tests run inside each rank process (``scripts/_vllm_tp.Cluster.run``).

Each function takes the rank's :class:`~scripts._vllm_tp.RankState` first; vLLM is
importable there (``scripts/_vllm_tp.use_vllm``). Results travel back pickled: NumPy
arrays, strings, plain containers.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig

from scripts._common import llama_config
from scripts._vllm_tp import RankState, VllmTpLlama, build_llama, set_tp

#: The model of every TP test: GQA with fewer KV heads than 4 ranks, a vocabulary
#: (101) that no TP size divides, so that vLLM pads it; an untied LM head.
SIZES: dict[str, Any] = {
    "vocab": 101,
    "hidden": 64,
    "intermediate": 96,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "tied": False,
}


def config() -> LlamaConfig:
    return llama_config(**SIZES)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(torch.int16).numpy().copy()


def _checkpoint(path: str) -> dict[str, torch.Tensor]:
    from bulletin.checkpoint import Checkpoint
    from bulletin.engines.torch_module import torch_dtype

    with Checkpoint(Path(path)) as ckpt:
        specs = ckpt.specs
        return {
            n: torch.from_numpy(np.array(ckpt.bits(n), copy=True)).view(torch_dtype(s.dtype)).reshape(s.shape)
            for n, s in specs.items()
        }


def engine(state: RankState, tp: int, variant: str | None = None) -> dict[str, Any]:
    """Build this rank's engine model (zeros) for TP size ``tp`` and a vLLM worker with
    Bulletin's extension over it. ``variant`` breaks the layout on purpose:
    ``"replicated_subclass"`` (o_proj of layer 0 a subclass of ReplicatedLinear),
    ``"packed"`` (a quantized-looking parameter: ``packed_dim`` set) or ``"derived"``
    (down_proj of layer 0 a subclass of RowParallelLinear whose loader derives its
    weight from the checkpoint's, as MLA's do: no placement of checkpoint elements)."""
    from vllm.model_executor.layers.linear import ReplicatedLinear, RowParallelLinear

    from tests.sidecar.engine_servers import extended_worker

    set_tp(state, tp)
    model = build_llama(config())
    if variant == "replicated_subclass":

        class MyReplicatedLinear(ReplicatedLinear):  # may shard otherwise: unknown to the rules
            pass

        attn = model.model.layers[0].self_attn
        attn.o_proj = MyReplicatedLinear(64, 64, bias=False, params_dtype=torch.bfloat16)
    elif variant == "packed":
        model.model.layers[1].mlp.down_proj.weight.packed_dim = 1
    elif variant == "derived":

        class DerivedRowParallelLinear(RowParallelLinear):
            def weight_loader(self, param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
                super().weight_loader(param, loaded_weight * 2)

        inter, hidden = SIZES["intermediate"], SIZES["hidden"]
        mlp = model.model.layers[0].mlp
        mlp.down_proj = DerivedRowParallelLinear(inter, hidden, bias=False, params_dtype=torch.bfloat16)
        mlp.down_proj.cpu_linear = torch.nn.functional.linear
    elif variant is not None:
        raise ValueError(variant)
    state.models["engine"] = model
    state.worker = extended_worker(model)
    return {"rank": state.rank, "engine": state.engine, "tp_rank": state.tp_rank}


def logits(state: RankState, tokens: list[list[int]]) -> np.ndarray:
    """The engine's logits (bits) for ``tokens``; every rank of the engine must run it."""
    model: VllmTpLlama = state.models["engine"]
    return _bits(model(torch.tensor(tokens)))


def fresh_check(state: RankState, path: str, tokens: list[list[int]]) -> dict[str, Any]:
    """A fresh engine loaded from checkpoint ``path`` with vLLM's own loaders: its logits,
    and which of the patched engine's parameters (padding included) or pieces (this
    rank's part of each checkpoint tensor, by the rank layout) differ from it, bitwise."""
    patched: VllmTpLlama = state.models["engine"]
    weights = _checkpoint(path)
    fresh = build_llama(config())
    fresh.load_weights(iter(weights.items()))
    ours = dict(patched.named_parameters())
    params = [n for n, p in fresh.named_parameters() if not np.array_equal(_bits(p), _bits(ours[n]))]
    layout = state.worker.bulletin_state().layout
    views = layout.views(patched)
    pieces = [
        n
        for n, piece in layout.pieces.items()
        if not np.array_equal(_bits(views[n]), piece.take(weights[n].contiguous().view(torch.int16).numpy()))
    ]
    return {"logits": _bits(fresh(torch.tensor(tokens))), "params": params, "pieces": pieces}


def digest(state: RankState) -> dict[str, str]:
    """SHA-256 of each parameter's bytes: what this rank holds."""
    model: VllmTpLlama = state.models["engine"]
    return {n: hashlib.sha256(_bits(p).tobytes()).hexdigest() for n, p in model.named_parameters()}


def damage(state: RankState, param: str, delta: int) -> None:
    """Add ``delta`` to every element's bits of one parameter of this rank (a bad rank)."""
    model: VllmTpLlama = state.models["engine"]
    with torch.no_grad():
        dict(model.named_parameters())[param].view(torch.int16).add_(delta)


def probe(state: RankState, tp: int) -> dict[str, Any]:
    """Index tensors (element ``i`` holds ``i``) through vLLM's own loaders into a fresh
    engine: where each checkpoint element landed, next to where the rank layout says
    it is; and what was left unwritten."""
    from bulletin.engines.rank_layout import RankLayout
    from bulletin_kernels.dispatch import as_bits
    from patcher.patch import TensorSpec

    set_tp(state, tp)
    model = build_llama(config())
    shapes = {n: tuple(p.shape) for n, p in _hf_shapes().items()}
    for p in model.parameters():
        p.data.view(torch.int16).fill_(-1)
    # Each tensor's own codes (element i of tensor t holds (i + base_t) mod 2**15), so
    # that a piece read from the wrong tensor's rows (k for v) does not pass.
    base = {n: (t * 4099) % 32768 for t, n in enumerate(sorted(shapes))}
    index = {
        n: ((torch.arange(int(np.prod(s))) + base[n]) % 32768).to(torch.int16).view(torch.bfloat16).reshape(s)
        for n, s in shapes.items()
    }
    model.load_weights(iter(index.items()))
    specs = {n: TensorSpec(n, "BF16", s) for n, s in shapes.items()}
    layout = RankLayout.of_module(model, specs)
    placed = {n: as_bits(v).astype(np.int64) for n, v in layout.views(model).items()}
    expect = {
        n: (piece.where.of(np.arange(piece.numel, dtype=np.int64)) + base[n]) % 32768
        for n, piece in layout.pieces.items()
    }
    untouched = sum(int((p.data.view(torch.int16) == -1).sum()) for p in model.parameters())
    return {"layout": layout.to_json(), "placed": placed, "expect": expect, "untouched": untouched}


def _hf_shapes() -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return dict(LlamaForCausalLM(config()).state_dict())


def refusals(state: RankState, tp: int) -> dict[str, str]:
    """What the rank layout says of layouts it cannot map, per variant (built here at
    TP size ``tp``: every rank must run it)."""
    from bulletin.engines.rank_layout import RankLayout
    from bulletin.errors import IncompatibleLayout
    from patcher.patch import TensorSpec

    specs = {n: TensorSpec(n, "BF16", tuple(t.shape)) for n, t in _hf_shapes().items()}
    out: dict[str, str] = {}
    for variant in ("replicated_subclass", "packed", "derived"):
        engine(state, tp, variant)
        try:
            RankLayout.of_module(state.models["engine"], specs)
        except IncompatibleLayout as exc:
            out[variant] = str(exc)
        else:
            out[variant] = "mapped"
    return out
