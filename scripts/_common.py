"""What the scripts and the tests share: a tiny Llama-style causal LM, built from nothing.

``transformers`` builds it from a config with random weights from a fixed seed; nothing
is downloaded. The default sizes are the end-to-end test's model (and the ``tiny``
preset of ``scripts/bench_pause.py``); a test that depends on a size (a vocabulary
padded by an engine, a prompt longer than the context) names it.

Tests import this as ``scripts._common``; a script puts the repository root on
``sys.path`` first and imports it by the same name.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Self, TypeVar

import torch
from transformers import LlamaConfig, LlamaForCausalLM

__all__ = ["MemoryPeak", "llama", "llama_config", "memory_status", "serving"]

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


def memory_status(pid: int | str = "self") -> dict[str, int]:
    """``RssAnon``, ``RssFile``, ``VmRSS`` and ``VmHWM`` of a process, in bytes, from
    ``/proc/<pid>/status`` (Linux): anonymous memory is what a process holds itself;
    file-backed pages (memory maps) are the page cache's, reclaimable."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


class MemoryPeak:
    """The peak anonymous memory of a process (``RssAnon``, sampled every ``interval``
    seconds on a thread; the kernel keeps no peak of it) while the ``with`` block runs.

    >>> with MemoryPeak() as peak:
    ...     work()
    >>> peak.anon, peak.start   # bytes: the peak, and what was held when the block began
    """

    def __init__(self, pid: int | str = "self", interval: float = 0.002) -> None:
        self.pid, self.interval = pid, interval
        self.start = self.anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self.anon = max(self.anon, memory_status(self.pid)["RssAnon"])
            except (FileNotFoundError, ProcessLookupError, KeyError):  # the process is gone
                return
            time.sleep(self.interval)

    def __enter__(self) -> Self:
        self.start = self.anon = memory_status(self.pid)["RssAnon"]
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(FileNotFoundError, KeyError):
            self.anon = max(self.anon, memory_status(self.pid)["RssAnon"])

    @property
    def beyond(self) -> int:
        """Bytes of anonymous memory above what was held when the block began."""
        return self.anon - self.start
