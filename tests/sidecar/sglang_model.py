"""One TP rank of an SGLang Llama, built from imitations of SGLang's own parallel layers.

SGLang 0.5.23 (the PyPI wheel ``sglang-0.5.23``, ``sglang/srt/``) does not import on a
CPU-only machine without its kernels, so its layers are reproduced here as far as the
adapters depend on them: the class names, the attributes Bulletin's rank layout reads,
and the weight loaders that place checkpoint tensors into each rank's parameters, which
are what the tests check the in-place patches against (after every version each rank's
parameters must equal what SGLang's own loader puts there from the checkpoint).

- ``layers/linear.py``: ``LinearBase`` (``tp_group``, ``quant_method`` =
  ``UnquantizedLinearMethod``), ``ColumnParallelLinear`` (``weight`` with
  ``output_dim=0``, ``input_dim=1``; ``weight_loader`` narrows ``output_dim`` from
  ``tp_rank * shard_size``), ``MergedColumnParallelLinear`` (``output_sizes``; shard
  ``i`` at ``sum(output_sizes[:i]) // tp``), ``QKVParallelLinear`` (``num_heads``,
  ``num_kv_heads``, ``num_kv_head_replicas`` from the KV group's size, K/V rows of KV
  group ``kv_tp_rank // num_kv_head_replicas``, ``kv_tp_group``), ``RowParallelLinear``
  (narrows ``input_dim``);
- ``layers/vocab_parallel_embedding.py``: ``VocabParallelEmbedding`` / ``ParallelLMHead``
  (``padding_size *= tp_size`` when the padded vocabulary does not divide by tp,
  ``shard_indices`` from ``_get_indices``, the loader copies rows
  ``org_vocab_start_index .. end`` and zero-fills the padding after them);
- ``distributed/utils.py``: ``get_group_rank_size`` (``(0, 1)`` for no group);
- ``models/llama.py``: ``LlamaForCausalLM`` (``stacked_params_mapping``,
  ``_legacy_load_weights``: fused members through their shard ids, the rest through
  the parameter's ``weight_loader``; ``rotary_emb.inv_freq`` skipped; with pipeline
  stages, layers outside the stage's ``[start_layer, end_layer)`` skipped and names the
  stage has no parameter for skipped with a warning), ``pp_group`` on the model;
  ``LlamaModel``: ``embed_tokens`` on the first stage, ``norm`` on the last, the other
  stages' ``PPMissingLayer`` (``layers/utils/common.py``), layers from
  ``make_pp_layers`` (``PPMissingLayer`` outside the stage) split by ``get_pp_indices``
  (``distributed/utils.py``: even, the last ``remainder`` stages one more; no
  ``SGLANG_PP_LAYER_PARTITION``); the untied ``lm_head`` is built on every stage.

Deviations: no forward pass (the imitation server computes its numbers from TP rank 0's
state dict); no quantization, bitsandbytes, presharded or CPU-padding branches; the
groups are plain records (SGLang's ``_LogicalGroup``) rather than process groups.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

DEFAULT_VOCAB_PADDING_SIZE = 64


@dataclass(frozen=True)
class Group:
    """A TP group as a layer holds it (SGLang's ``_LogicalGroup``)."""

    rank_in_group: int
    world_size: int


class PPMissingLayer(nn.Identity):
    """A layer another pipeline stage holds: no parameters."""


def get_pp_indices(layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """``[start, end)`` of stage ``pp_rank``'s layers: an even split, the last
    ``layers % pp_size`` stages one layer more."""
    base, remainder = divmod(layers, pp_size)
    start = pp_rank * base + max(0, pp_rank - (pp_size - remainder))
    return start, start + base + (1 if pp_rank >= pp_size - remainder else 0)


def _rank_size(group: Group | None) -> tuple[int, int]:
    return (0, 1) if group is None else (group.rank_in_group, group.world_size)


class UnquantizedLinearMethod:
    pass


class UnquantizedEmbeddingMethod:
    pass


def _param(shape: tuple[int, ...], dtype: torch.dtype, **attrs: object) -> nn.Parameter:
    param = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    for key, value in attrs.items():
        setattr(param, key, value)
    return param


class LinearBase(nn.Module):
    tp_group: Group | None = None

    def __init__(self, input_size: int, output_size: int, group: Group | None) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_group = group
        self.quant_method = UnquantizedLinearMethod()


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, group: Group | None, dtype: torch.dtype) -> None:
        super().__init__(input_size, output_size, group)
        _, tp = _rank_size(group)
        self.weight = _param((output_size // tp, input_size), dtype, output_dim=0, input_dim=1)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rank, _ = _rank_size(self.tp_group)
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, input_size: int, output_sizes: list[int], group: Group | None, dtype: torch.dtype) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), group, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:  # type: ignore[override]
        assert shard_id is not None
        rank, tp = _rank_size(self.tp_group)
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(
        self,
        hidden: int,
        head_size: int,
        heads: int,
        kv_heads: int,
        group: Group | None,
        dtype: torch.dtype,
        kv_group: Group | None = None,
    ) -> None:
        _, tp = _rank_size(group)
        self.kv_tp_group = group if kv_group is None else kv_group
        _, kv_tp = _rank_size(self.kv_tp_group)
        self.head_size = self.v_head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = heads, kv_heads
        self.num_heads = heads // tp
        if kv_tp >= kv_heads:
            self.num_kv_heads, self.num_kv_head_replicas = 1, kv_tp // kv_heads
        else:
            self.num_kv_heads, self.num_kv_head_replicas = kv_heads // kv_tp, 1
        self.output_sizes = [n * head_size * tp for n in (self.num_heads, self.num_kv_heads, self.num_kv_heads)]
        super().__init__(hidden, sum(self.output_sizes), group, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:  # type: ignore[override]
        rank, _ = _rank_size(self.tp_group)
        kv_rank, _ = _rank_size(self.kv_tp_group)
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[str(shard_id)]
        shard = rank if shard_id == "q" else kv_rank // self.num_kv_head_replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, shard * size, size))


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, group: Group | None, dtype: torch.dtype) -> None:
        super().__init__(input_size, output_size, group)
        _, tp = _rank_size(group)
        self.weight = _param((output_size, input_size // tp), dtype, output_dim=0, input_dim=1)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rank, _ = _rank_size(self.tp_group)
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, rank * size, size))


def pad_vocab_size(vocab: int, pad_to: int) -> int:
    return ((vocab + pad_to - 1) // pad_to) * pad_to


@dataclass(frozen=True)
class ShardIndices:
    org_vocab_start_index: int
    org_vocab_end_index: int


class VocabParallelEmbedding(nn.Module):
    tp_group: Group | None = None

    def __init__(
        self,
        vocab: int,
        dim: int,
        group: Group | None,
        dtype: torch.dtype,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
    ) -> None:
        super().__init__()
        self.tp_group = group
        rank, self.tp_size = _rank_size(group)
        self.num_embeddings = self.org_vocab_size = vocab
        self.num_added_embeddings = 0
        if pad_vocab_size(vocab, padding_size) % self.tp_size != 0:
            padding_size *= self.tp_size
        self.padding_size = padding_size
        padded = pad_vocab_size(vocab, padding_size)
        per = padded // self.tp_size
        self.shard_indices = ShardIndices(min(rank * per, vocab), min((rank + 1) * per, vocab))
        self.quant_method = UnquantizedEmbeddingMethod()
        self.weight = _param((per, dim), dtype, output_dim=0)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        start = self.shard_indices.org_vocab_start_index
        rows = loaded.narrow(0, start, self.shard_indices.org_vocab_end_index - start)
        param.data[: rows.shape[0]].copy_(rows)
        param.data[rows.shape[0] :].fill_(0)


class ParallelLMHead(VocabParallelEmbedding):
    pass


class RMSNorm(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)


class _Attention(nn.Module):
    def __init__(
        self, hidden: int, heads: int, kv_heads: int, group: Group | None, kv: Group | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        head = hidden // heads
        self.qkv_proj = QKVParallelLinear(hidden, head, heads, kv_heads, group, dtype, kv)
        self.o_proj = RowParallelLinear(heads * head, hidden, group, dtype)


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, group: Group | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], group, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, group, dtype)


class _Layer(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        heads: int,
        kv_heads: int,
        group: Group | None,
        attn: Group | None,
        kv: Group | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.self_attn = _Attention(hidden, heads, kv_heads, attn, kv, dtype)
        self.mlp = _MLP(hidden, intermediate, group, dtype)
        self.input_layernorm = RMSNorm(hidden, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, dtype)


class _Model(nn.Module):
    def __init__(
        self,
        config: object,
        group: Group | None,
        attn: Group | None,
        kv: Group | None,
        dtype: torch.dtype,
        padding_size: int,
        stage: Group,
    ) -> None:
        super().__init__()
        c = config
        first, last = stage.rank_in_group == 0, stage.rank_in_group == stage.world_size - 1
        self.start_layer, self.end_layer = get_pp_indices(c.num_hidden_layers, stage.rank_in_group, stage.world_size)  # type: ignore[attr-defined]
        self.embed_tokens: nn.Module = (
            VocabParallelEmbedding(c.vocab_size, c.hidden_size, group, dtype, padding_size)  # type: ignore[attr-defined]
            if first
            else PPMissingLayer()
        )
        self.layers = nn.ModuleList(
            PPMissingLayer()
            if not self.start_layer <= i < self.end_layer
            else _Layer(
                c.hidden_size,  # type: ignore[attr-defined]
                c.intermediate_size,  # type: ignore[attr-defined]
                c.num_attention_heads,  # type: ignore[attr-defined]
                c.num_key_value_heads,  # type: ignore[attr-defined]
                group,
                attn,
                kv,
                dtype,
            )
            for i in range(c.num_hidden_layers)  # type: ignore[attr-defined]
        )
        self.norm: nn.Module = RMSNorm(c.hidden_size, dtype) if last else PPMissingLayer()  # type: ignore[attr-defined]


class LlamaForCausalLM(nn.Module):
    """TP rank ``rank`` of ``tp`` of SGLang's Llama (untied LM head). ``attn_tp``: the
    attention TP size with data-parallel attention (``--enable-dp-attention``: attention
    layers over the attention TP group, rank ``tp_rank % attn_tp``, ``layers/
    dp_attention.py``), by default ``tp``. ``kv_tp``: the size of QKV's own KV group
    (``kv_parallel_group``, rank ``tp_rank % kv_tp``), by default the query's.
    ``pp_rank`` of ``pp``: the pipeline stage (its ``pp_group``)."""

    def __init__(
        self,
        config: object,
        rank: int,
        tp: int,
        *,
        attn_tp: int | None = None,
        kv_tp: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        padding_size: int = 64,
        pp_rank: int = 0,
        pp: int = 1,
    ) -> None:
        super().__init__()
        self.config, self.tp = config, tp
        self.shape = {"attn_tp": attn_tp, "kv_tp": kv_tp, "padding_size": padding_size, "pp": pp}
        self.pp_group = Group(pp_rank, pp)
        group = Group(rank, tp) if tp > 1 else None
        attn_tp = tp if attn_tp is None else attn_tp
        attn = Group(rank % attn_tp, attn_tp) if attn_tp > 1 else None
        kv = None if kv_tp is None else Group(rank % kv_tp, kv_tp)
        self.model = _Model(config, group, attn, kv, dtype, padding_size, self.pp_group)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, group, dtype, padding_size)  # type: ignore[attr-defined]
        self.stacked_params_mapping = [
            (".qkv_proj", ".q_proj", "q"),
            (".qkv_proj", ".k_proj", "k"),
            (".qkv_proj", ".v_proj", "v"),
            (".gate_up_proj", ".gate_proj", 0),
            (".gate_up_proj", ".up_proj", 1),
        ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``_legacy_load_weights`` of ``models/llama.py``, reduced to these layers."""
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, loaded in weights:
                parts = name.split(".")
                layer = int(parts[2]) if parts[:2] == ["model", "layers"] and parts[2].isdigit() else None
                if layer is not None and not self.model.start_layer <= layer < self.model.end_layer:
                    continue  # another pipeline stage's
                if "rotary_emb.inv_freq" in name:
                    continue
                for param_name, weight_name, shard_id in self.stacked_params_mapping:
                    if weight_name in name:
                        fused = name.replace(weight_name, param_name)
                        if fused in params:
                            params[fused].weight_loader(params[fused], loaded, shard_id)  # type: ignore[attr-defined]
                        break
                else:
                    param = params.get(name)
                    if param is None:
                        continue  # "Parameter ... not found in params_dict" (a warning)
                    loader = getattr(param, "weight_loader", None)
                    if loader is None:
                        param.data.copy_(loaded)  # default_weight_loader
                    else:
                        loader(param, loaded)


def sglang_ranks(
    config: object,
    tp: int,
    *,
    attn_tp: int | None = None,
    kv_tp: int | None = None,
    padding_size: int = 64,
    pp: int = 1,
) -> list[LlamaForCausalLM]:
    """The ``tp * pp`` ranks of one engine, stage by stage (TP rank ``r`` of stage ``s``
    at ``s * tp + r``)."""
    return [
        LlamaForCausalLM(config, r, tp, attn_tp=attn_tp, kv_tp=kv_tp, padding_size=padding_size, pp_rank=s, pp=pp)
        for s in range(pp)
        for r in range(tp)
    ]


def loaded_like(ranks: list[LlamaForCausalLM], state: dict[str, torch.Tensor]) -> list[LlamaForCausalLM]:
    """Fresh ranks of the same engine with what SGLang's loader puts into each of them
    from checkpoint tensors ``state`` (cast to BF16, as the publisher does)."""
    first = ranks[0]
    fresh = sglang_ranks(first.config, first.tp, **first.shape)  # type: ignore[arg-type]
    for model in fresh:
        model.load_weights((n, t.detach().to(torch.bfloat16)) for n, t in state.items())
    return fresh
