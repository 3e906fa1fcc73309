"""A tiny RL-style corpus (scripts/corpora.py at toy sizes), built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts import corpora

#: The real run's recipe at toy sizes: a few seconds to build on one core.
TINY = corpora.LlamaShape(
    vocab=384,
    hidden=32,
    intermediate=64,
    layers=2,
    heads=4,
    kv_heads=2,
    max_positions=64,
    pretrain_steps=3,
    pretrain_batch=2,
    pretrain_length=32,
    prompts=4,
    group=4,
    prompt_length=4,
    completion_length=8,
)


def tiny_spec(steps: int = 5) -> corpora.CorpusSpec:
    return corpora.CorpusSpec("llama-rl", 1e-6, warmup=1, steps=steps, llama=TINY)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A build cache holding the tiny corpus (5 measured steps)."""
    cache = tmp_path_factory.mktemp("corpus-cache")
    corpora.build(tiny_spec(), cache, log=lambda _: None)
    return cache
