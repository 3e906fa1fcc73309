"""What the scripts and the tests share: a tiny Llama-style causal LM, built from nothing.

``transformers`` builds it from a config with random weights from a fixed seed; nothing
is downloaded. The default sizes are the end-to-end test's model (and the ``tiny``
preset of ``scripts/bench_pause.py``); a test that depends on a size (a vocabulary
padded by an engine, a prompt longer than the context) names it.

Tests import this as ``scripts._common``; a script puts the repository root on
``sys.path`` first and imports it by the same name.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from transformers import LlamaConfig, LlamaForCausalLM

__all__ = ["llama", "llama_config", "serving"]

M = TypeVar("M", bound=torch.nn.Module)


def llama_config(
    *,
    vocab: int = 256,
    hidden: int = 64,
    intermediate: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 64,
    tied: bool = True,
) -> LlamaConfig:
    """A Llama config of these sizes; ``tied``: the LM head is the embedding (served once)."""
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
    )


def llama(
    config: LlamaConfig | None = None,
    seed: int = 0,
    *,
    dtype: torch.dtype | None = None,
    device: str | None = None,
) -> LlamaForCausalLM:
    """A Llama with random weights drawn from ``seed`` (``config`` defaults to :func:`llama_config`).

    FP32 and in training mode, as a trainer holds it; with ``dtype`` or ``device``, cast
    and moved for serving, in eval mode (see :func:`serving`).
    """
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config if config is not None else llama_config())
    if dtype is None and device is None:
        return model
    return serving(model, dtype if dtype is not None else torch.bfloat16, device)


def serving(model: M, dtype: torch.dtype = torch.bfloat16, device: str | None = None) -> M:
    """``model.to(device, dtype).eval()`` in place, typed (transformers' own stubs confuse mypy)."""
    torch.nn.Module.to(model, device=device, dtype=dtype)
    torch.nn.Module.eval(model)
    return model
