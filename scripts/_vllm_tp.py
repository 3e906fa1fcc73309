"""A tensor-parallel Llama built from vLLM's own layers, one process per rank (gloo, CPU).

What the TP tests (``tests/tp``) and ``scripts/bench_pause.py --tp`` share. vLLM's code
comes from the kit ``scripts/vllm_source.py`` builds (its ``.py`` files and the few
dependencies they import; ``BULLETIN_TEST_VLLM_PATH``), run with
``VLLM_TARGET_DEVICE=cpu`` and this environment's torch. vllm-project/vllm 0.33.0,
commit ``4ba787ec9``:

- groups: ``vllm.distributed.init_distributed_environment`` /
  ``initialize_model_parallel`` (``distributed/parallel_state.py``) over gloo; a world
  of ``w`` ranks with TP size ``t`` is ``w / t`` independent engines (vLLM's outer,
  external data-parallel dimension), each of ``t`` ranks;
- layers (``model_executor/layers/linear.py``, ``model_executor/layers/vocab_parallel_embedding.py``):
  ``VocabParallelEmbedding``, ``QKVParallelLinear``, ``RowParallelLinear``,
  ``MergedColumnParallelLinear``, ``ParallelLMHead``, each with its own forward (and
  the all-reduces it does through ``tensor_model_parallel_all_reduce``); logits as
  ``LogitsProcessor._get_logits`` makes them (``layers/logits_processor.py``: the head's
  ``quant_method.apply``, ``tensor_model_parallel_all_gather``, the padding cut off);
- loading: vLLM's ``AutoWeightsLoader`` with ``LlamaModel.hf_to_vllm_mapper`` (the
  stacked-params mapping, ``models/llama.py`` / ``models/utils.py``): every checkpoint
  tensor goes through its parameter's own ``weight_loader`` with its shard id;
- unquantized GEMMs on CPU call ``layer.cpu_linear``, which vLLM's
  ``dispatch_cpu_unquantized_gemm`` (``layers/utils.py``) sets; without vLLM's compiled
  ops it ends on ``torch.nn.functional.linear``, set here directly (the compiled paths
  repack the weights, which :class:`~bulletin.engines.rank_layout.RankLayout` refuses).

Norms, rotary embeddings and attention are transformers' (``LlamaRMSNorm``,
``LlamaRotaryEmbedding``, ``apply_rotary_pos_emb``) and a plain causal softmax: vLLM's
attention needs its scheduler's forward context, and what is checked is that the
sharded weights are the checkpoint's, bit for bit.

:class:`Cluster` (the caller's side) spawns the ranks and runs functions on them: a
function given by reference (``module.function``, picklable) is called in the rank as
``fn(rank_state, *args)``; :class:`RankWorker` makes one rank look like a vLLM worker
with ``BulletinWorkerExtension`` mixed in (``bulletin_*`` methods), for a loopback
``/collective_rpc`` server.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, ClassVar

import torch
import torch.multiprocessing as mp
from torch import nn
from transformers import LlamaConfig

__all__ = ["VLLM_PATH_ENV", "Cluster", "RankError", "RankState", "RankWorker", "build_llama", "vllm_path"]

#: Where vLLM's source kit is (``scripts/vllm_source.py`` prints it): ``os.pathsep``-separated.
VLLM_PATH_ENV = "BULLETIN_TEST_VLLM_PATH"


def vllm_path() -> str | None:
    return os.environ.get(VLLM_PATH_ENV) or None


def use_vllm(path: str) -> None:
    """Make vLLM's source importable in this process, on its CPU platform."""
    for entry in reversed(path.split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


# -- the model, inside a rank ----------------------------------------------------------------


def _out(result: Any) -> torch.Tensor:
    """vLLM's linear layers return ``(output, output_bias)``."""
    return result[0] if isinstance(result, tuple) else result


class _Attention(nn.Module):
    def __init__(self, config: LlamaConfig, dtype: torch.dtype) -> None:
        from vllm.distributed import get_tensor_model_parallel_world_size
        from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear

        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        hidden, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head = hidden // heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head, heads, kv, bias=False, params_dtype=dtype)
        self.o_proj = RowParallelLinear(heads * self.head, hidden, bias=False, params_dtype=dtype)
        # As LlamaAttention.__init__: KV heads replicated when tp exceeds them.
        self.heads = heads // tp
        self.kv_heads = max(1, kv // tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, n, _ = x.shape
        q, k, v = _out(self.qkv_proj(x)).split(
            [self.heads * self.head, self.kv_heads * self.head, self.kv_heads * self.head], dim=-1
        )
        q = q.view(b, n, self.heads, self.head).transpose(1, 2)
        k = k.view(b, n, self.kv_heads, self.head).transpose(1, 2)
        v = v.view(b, n, self.kv_heads, self.head).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        scores = (q.float() @ k.float().transpose(-1, -2)) / self.head**0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = (scores.softmax(-1) @ v.float()).to(x.dtype)
        return _out(self.o_proj(attn.transpose(1, 2).reshape(b, n, self.heads * self.head)))


class _Mlp(nn.Module):
    def __init__(self, config: LlamaConfig, dtype: torch.dtype) -> None:
        from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=False, params_dtype=dtype)
        self.down_proj = RowParallelLinear(inter, hidden, bias=False, params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _out(self.gate_up_proj(x)).chunk(2, dim=-1)
        return _out(self.down_proj(nn.functional.silu(gate) * up))


class _Layer(nn.Module):
    def __init__(self, config: LlamaConfig, dtype: torch.dtype) -> None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        super().__init__()
        self.self_attn = _Attention(config, dtype)
        self.mlp = _Mlp(config, dtype)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps).to(dtype)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps).to(dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Model(nn.Module):
    def __init__(self, config: LlamaConfig, dtype: torch.dtype) -> None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, params_dtype=dtype)
        self.layers = nn.ModuleList(_Layer(config, dtype) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps).to(dtype)
        self.rotary = LlamaRotaryEmbedding(config)  # buffers only: nothing the checkpoint holds

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm.model_executor.models.llama import LlamaModel
        from vllm.model_executor.models.utils import AutoWeightsLoader

        loaded: set[str] = AutoWeightsLoader(self).load_weights(weights, mapper=LlamaModel.hf_to_vllm_mapper)
        return loaded

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        positions = torch.arange(tokens.shape[1]).unsqueeze(0)
        cos, sin = self.rotary(x, positions)
        for layer in self.layers:
            x = layer(x, cos.to(x.dtype), sin.to(x.dtype))
        out: torch.Tensor = self.norm(x)
        return out


class VllmTpLlama(nn.Module):
    """One TP rank of a Llama built from vLLM's parallel layers (see the module notes)."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, config: LlamaConfig, dtype: torch.dtype = torch.bfloat16) -> None:
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        super().__init__()
        self.config = config
        self.model = _Model(config, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, params_dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        for module in self.modules():
            if hasattr(module, "quant_method"):
                module.cpu_linear = nn.functional.linear  # dispatch_cpu_unquantized_gemm's fallback

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``LlamaForCausalLM.load_weights``: vLLM's ``AutoWeightsLoader`` (checkpoint
        names, each through its parameter's own ``weight_loader``)."""
        from vllm.model_executor.models.utils import AutoWeightsLoader

        loaded: set[str] = AutoWeightsLoader(self).load_weights(weights)
        return loaded

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (every rank gets them)."""
        from vllm.distributed import tensor_model_parallel_all_gather

        hidden = self.model(tokens)
        logits = self.lm_head.quant_method.apply(self.lm_head, hidden)
        logits = tensor_model_parallel_all_gather(logits)
        out: torch.Tensor = logits[..., : self.config.vocab_size]
        return out


def build_llama(config: LlamaConfig, dtype: torch.dtype = torch.bfloat16) -> VllmTpLlama:
    """This rank's model (zeros until weights are loaded); the groups must be set up."""
    model = VllmTpLlama(config, dtype)
    for p in model.parameters():
        p.data.zero_()
    return model.eval()


# -- a rank process ---------------------------------------------------------------------------


@dataclass
class RankState:
    """What one rank process holds between calls: its place in the world, the vLLM
    config context, and whatever the functions run on it keep (``models``, ``worker``)."""

    rank: int
    world: int
    tp: int = 1
    models: dict[str, Any] = field(default_factory=dict)
    worker: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def engine(self) -> int:
        return self.rank // self.tp


def set_tp(state: RankState, tp: int) -> None:
    """Rebuild vLLM's model-parallel groups with TP size ``tp`` (``world / tp`` engines)."""
    from vllm.distributed.parallel_state import destroy_model_parallel, initialize_model_parallel

    if state.tp != tp or not state.extra.get("groups"):
        if state.extra.get("groups"):
            destroy_model_parallel()
        initialize_model_parallel(tensor_model_parallel_size=tp)
        state.tp = tp
        state.extra["groups"] = True
        state.models.clear()
        state.worker = None


def _serve(rank: int, world: int, port: int, path: str, conn: Connection, threads: int) -> None:
    use_vllm(path)
    torch.set_num_threads(threads)
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import init_distributed_environment

        config = set_current_vllm_config(VllmConfig())
        config.__enter__()  # for the life of the process: the layers read it
        init_distributed_environment(
            world_size=world,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
        state = RankState(rank, world)
        conn.send(("ok", None))
    except BaseException as exc:
        conn.send(("error", f"{exc!r}\n{traceback.format_exc()}"))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:  # vLLM's groups hold shared memory: give it back
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            with contextlib.suppress(Exception):
                destroy_model_parallel()
                destroy_distributed_environment()
            return
        fn, args = message
        try:
            conn.send(("ok", fn(state, *args)))
        except BaseException as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class RankError(RuntimeError):
    """A function raised in a rank: its message and the rank's traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """``world`` spawned rank processes in one gloo world with vLLM's groups.

    :meth:`run` calls ``fn(rank_state, *args)`` on the given ranks at once (functions
    that use collectives must run on every rank of the group) and returns their
    results in rank order; a rank's exception is raised as :class:`RankError` after
    every rank answered.
    """

    def __init__(self, world: int, path: str, *, threads: int = 1, timeout: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.world = world
        self.timeout = timeout
        self._conns: list[Connection] = []
        self._locks = [threading.Lock() for _ in range(world)]
        self._procs = []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world, port, path, child, threads), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect(range(world), "start")

    def _collect(self, ranks: Iterable[int], what: str) -> list[Any]:
        results, errors = [], []
        for rank in ranks:
            conn = self._conns[rank]
            if not conn.poll(self.timeout):
                raise RankError(f"rank {rank} did not answer {what} within {self.timeout:.0f} s")
            try:
                status, value = conn.recv()
            except EOFError:
                status, value = "error", f"the process ended (exit code {self._procs[rank].exitcode})"
            if status == "ok":
                results.append(value)
            else:
                errors.append(f"rank {rank}: {value}")
        if errors:
            raise RankError("\n".join(errors))
        return results

    def run(self, fn: Callable[..., Any], *args: Any, ranks: Sequence[int] | None = None) -> list[Any]:
        chosen = list(range(self.world)) if ranks is None else list(ranks)
        locks = [self._locks[r] for r in chosen]
        for lock in locks:
            lock.acquire()
        try:
            for rank in chosen:
                self._conns[rank].send((fn, args))
            return self._collect(chosen, getattr(fn, "__name__", "a call"))
        finally:
            for lock in locks:
                lock.release()

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _worker_call(state: RankState, method: str, args: tuple[Any, ...]) -> Any:
    if state.worker is None:
        raise RuntimeError("this rank has no worker (bind a model to it first)")
    return getattr(state.worker, method)(*args)


class RankWorker:
    """One rank as a vLLM worker with the extension mixed in: ``bulletin_*`` calls run
    on the rank's ``state.worker``; a failure raises as the worker raised it (its
    message carries Bulletin's JSON error)."""

    def __init__(self, cluster: Cluster, rank: int) -> None:
        self.cluster = cluster
        self.rank = rank

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if not name.startswith("bulletin_"):
            raise AttributeError(name)

        def call(*args: Any) -> Any:
            try:
                return self.cluster.run(_worker_call, name, args, ranks=[self.rank])[0]
            except RankError as exc:
                first = str(exc).split("\n", 1)[0]
                raise RuntimeError(first) from None

        return call
