"""Loopback HTTP servers that behave as vLLM's and SGLang's servers do, for adapter tests.

They are real servers speaking real HTTP. Behind each endpoint they do what the
engine's source does (vLLM 0.33.0, commit ``4ba787ec9``; SGLang 0.5.23; files cited per
class and in docs/ENGINES.md), reduced to what the adapters and the sidecar depend on,
and they hold real version-dependent state: every completion is computed from the live
weights through a prefix cache (vLLM's prefix cache, SGLang's radix cache), so a cache
that is not reset after a weight change serves the old version's numbers.

A completion's "logprobs" are one number per prompt position, computed from the
prefix up to that position and the weights (:func:`prefix_values`), standing for the
KV a real engine caches per block of tokens. ``prompt`` is a list of token ids;
``"hold": true`` keeps the request running until :meth:`_Server.release` is called,
as a long generation does.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import io
import json
import pickle
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import torch
from safetensors.torch import load_file

from bulletin.engines.vllm import BulletinWorkerExtension, WorkerState

#: Tokens per cached block (vLLM's ``block_size`` / SGLang's page), small for tests.
BLOCK = 4

Route = Callable[["Call"], tuple[int, Any]]


@dataclass
class Call:
    """One request as a route sees it."""

    path: str
    query: dict[str, str]
    raw: bytes

    def json(self) -> Any:
        return json.loads(self.raw) if self.raw else None


class BadRequest(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(body)
        self.status, self.body = status, body


def prefix_values(model: torch.nn.Module, tokens: list[int]) -> list[float]:
    """One number per position: a function of the weights and the prompt up to there."""
    flat = [p.detach().reshape(-1) for p in model.state_dict().values() if p.numel()]
    out = []
    key = 0
    for t in tokens:
        key = (key * 1_000_003 + t + 1) % (1 << 61)
        out.append(float(sum(float(p[key % p.numel()].float()) for p in flat)))
    return out


@dataclass
class PrefixCache:
    """Values computed per full block of a prompt, keyed by the prompt up to that block."""

    blocks: dict[tuple[int, ...], list[float]] = field(default_factory=dict)
    hits: int = 0

    def compute(self, model: torch.nn.Module, tokens: list[int]) -> list[float]:
        reuse = 0
        for end in range(BLOCK, len(tokens) + 1, BLOCK):
            if tuple(tokens[:end]) not in self.blocks:
                break
            reuse = end
        fresh = prefix_values(model, tokens)
        values = (self.blocks[tuple(tokens[:reuse])] if reuse else []) + fresh[reuse:]
        if reuse:
            self.hits += 1
        for end in range(BLOCK, len(tokens) + 1, BLOCK):
            self.blocks.setdefault(tuple(tokens[:end]), values[:end])
        return values

    def clear(self) -> None:
        self.blocks.clear()


class _Server:
    """A threaded HTTP server dispatching ``(method, path)`` to routes; counts every call."""

    def __init__(self, routes: dict[tuple[str, str], Route]) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                parts = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
                route = routes.get((method, parts.path))
                outer.calls.append((method, parts.path))
                try:
                    if route is None:
                        raise BadRequest(404, {"detail": "Not Found"})
                    status, body = route(Call(parts.path, query, raw))
                except BadRequest as exc:
                    status, body = exc.status, exc.body
                except Exception as exc:  # an unhandled exception: FastAPI's plain 500
                    status, body = 500, {"detail": f"Internal Server Error: {exc!r}"}
                data = (body if isinstance(body, bytes) else json.dumps(body).encode()) if body is not None else b""
                self.send_response(status)
                self.send_header("Content-Type", "application/json" if not isinstance(body, bytes) else "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.calls: list[tuple[str, str]] = []
        self._release = threading.Event()
        self.running = 0
        self.aborted = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def count(self, path: str) -> int:
        return sum(1 for _, p in self.calls if p == path)

    def release(self) -> None:
        self._release.set()

    def close(self) -> None:
        self._release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()

    def _run_request(self, hold: bool, abort: threading.Event) -> bool:
        """A running request; False if an abort ended it (finish reason ``abort``)."""
        self.running += 1
        try:
            while hold and not self._release.is_set():
                if abort.wait(0.01):
                    self.aborted += 1
                    return False
            return True
        finally:
            self.running -= 1

    @staticmethod
    def _json_object(call: Call) -> dict[str, Any]:
        try:
            body = call.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(400, {"error": {"message": f"JSON decode error: {exc}", "code": 400}}) from None
        if not isinstance(body, dict):
            raise BadRequest(400, {"error": {"message": "Request body must be a JSON object", "code": 400}})
        return body


# -- vLLM ---------------------------------------------------------------------------------


class FakeVllmWorker:
    """Stands for vLLM's GPU worker class: it only has to offer ``get_model``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def get_model(self) -> torch.nn.Module:
        return self.model


def extended_worker(model: torch.nn.Module, *, pp_rank: int = 0) -> Any:
    """A worker with the extension mixed in, as ``--worker-extension-cls`` does it;
    ``pp_rank``: its pipeline stage (what ``get_pp_group()`` says inside vLLM)."""
    cls = type("Worker", (FakeVllmWorker, BulletinWorkerExtension), {})
    worker = cls(model)
    if pp_rank:
        worker._bulletin_worker_state = WorkerState(model, pp_rank=pp_rank)
    return worker


class VllmServer(_Server):
    """vLLM 0.33.0's OpenAI server in dev mode (``VLLM_SERVER_DEV_MODE=1``), over one or
    more data-parallel engines, each a list of workers with the extension mixed in.

    As in the source:

    - ``POST /collective_rpc`` (``entrypoints/serve/dev/rpc/api_router.py``): a body that
      is not JSON, not an object, or has no ``method`` is 400; every engine runs the
      method on each of its workers (``v1/engine/core_client.py``:
      ``DPLBAsyncMPClient.call_utility_async`` gathers every engine and returns the first
      engine's results only); a worker's exception fails the call from any engine, as a
      500 ``{"error": {"message": "Call to collective_rpc method failed: ..."}}``
      (``v1/engine/core.py`` ``_invoke_utility_method``, ``serve/exception_handling``);
      results that are not dicts, lists or None are turned into strings; a worker
      slower than the call's ``timeout`` fails it ("RPC call to ... timed out").
    - ``POST /pause?mode=abort|wait|keep&clear_cache=`` and ``/resume``
      (``entrypoints/rl/online/api_router.py``, ``v1/engine/core.py``
      ``pause_scheduler``): ``abort`` ends running requests (finish reason ``abort``);
      ``abort`` and ``wait`` answer new completions 503 until resumed; ``clear_cache``
      (default true) resets the prefix cache when the pause completes.
    - ``POST /reset_prefix_cache?reset_running_requests=`` answers ``{"success": false}``
      while requests hold blocks unless they are preempted (``v1/core/sched/scheduler.py``);
      with several engines it succeeds only if every engine's does.
    - ``POST /reset_encoder_cache``, ``POST /update_weight_version {"new_version"}`` (every
      engine), ``GET /weight_info`` (the engines' consensus), ``GET /get_world_size``.
    - ``POST /v1/completions``: computed from the first worker's live weights through
      the engine's prefix cache, engines taken in turn (vLLM's DP load balancing).

    Deviations, and why they do not matter to what is tested: no tokenizer, sampling or
    real attention (the numbers are a function of bits and prefix, which is what a
    stale cache shows); workers run in the server's threads rather than processes (the
    extension code is the same); error messages keep paths (vLLM strips them).
    """

    def __init__(
        self, workers: list[Any] | None = None, *, engines: list[list[Any]] | None = None, dev_mode: bool = True
    ) -> None:
        self.engines: list[list[Any]] = engines if engines is not None else [workers or []]
        self.caches = [PrefixCache() for _ in self.engines]
        self.paused: str | None = None
        self.weight_versions = ["default" for _ in self.engines]
        self.worker_delay = 0.0
        self.encoder_resets = 0
        #: The worker methods ``/collective_rpc`` ran, in order.
        self.rpc_methods: list[str] = []
        #: The pause mode each RPC ran under (None: the engine was stepping), in call order.
        self.rpc_paused: list[str | None] = []
        self._abort = threading.Event()
        self._turn = 0
        routes: dict[tuple[str, str], Route] = {
            ("GET", "/health"): lambda _: (200, None),
            ("POST", "/v1/completions"): self._completions,
        }
        if dev_mode:
            routes.update(
                {
                    ("POST", "/collective_rpc"): self._rpc,
                    ("POST", "/pause"): self._pause,
                    ("POST", "/resume"): self._resume,
                    ("GET", "/is_paused"): lambda _: (200, {"is_paused": self.paused is not None}),
                    ("POST", "/reset_prefix_cache"): self._reset_prefix_cache,
                    ("POST", "/reset_encoder_cache"): self._reset_encoder_cache,
                    ("POST", "/update_weight_version"): self._update_weight_version,
                    ("GET", "/weight_info"): self._weight_info,
                    ("GET", "/get_world_size"): self._world_size,
                }
            )
        super().__init__(routes)

    @property
    def workers(self) -> list[Any]:
        """The first engine's workers (the one engine of a server without data parallelism)."""
        return self.engines[0]

    @workers.setter
    def workers(self, value: list[Any]) -> None:
        self.engines = [value]
        self.caches = [PrefixCache()]
        self.weight_versions = ["default"]

    def _rpc(self, call: Call) -> tuple[int, Any]:
        body = self._json_object(call)
        method = body.get("method")
        if method is None:
            raise BadRequest(400, {"error": {"message": "Missing 'method' in request body", "code": 400}})
        args, kwargs, timeout = body.get("args", []), body.get("kwargs", {}), body.get("timeout")
        if self.worker_delay and timeout is not None and self.worker_delay > timeout:
            time.sleep(timeout)
            return self._failed(TimeoutError(f"RPC call to {method} timed out."))
        self.rpc_methods.append(str(method))
        self.rpc_paused.append(self.paused)
        # Every worker of every engine runs it at once (the executor broadcasts, the
        # client gathers the engines); then the answers are read engine by engine and,
        # within one, rank by rank: the first failure found fails the call.
        calls = [[(worker, method, args, kwargs) for worker in workers] for workers in self.engines]
        with ThreadPoolExecutor(max_workers=sum(len(c) for c in calls) or 1) as pool:
            futures = [[pool.submit(_call_worker, *c) for c in engine] for engine in calls]
            answers = [[f.result() for f in engine] for engine in futures]
        for engine in answers:
            failed = [exc for ok, exc in engine if not ok]
            if failed:
                exc = failed[0]
                if len(engine) > 1:  # a multiprocess executor's words (multiproc_executor.py)
                    exc = RuntimeError(
                        f"Worker failed with error '{exc}', please check the stack trace above for the root cause"
                    )
                return self._failed(exc)
        first = [r if r is None or isinstance(r, dict | list) else str(r) for _, r in answers[0]]
        return 200, {"results": first}

    @staticmethod
    def _failed(exc: BaseException) -> tuple[int, Any]:
        message = f"Call to collective_rpc method failed: {exc}"
        return 500, {"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}}

    def _pause(self, call: Call) -> tuple[int, Any]:
        mode = call.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return 400, {"error": f"Invalid pause mode: {mode}"}
        if mode == "abort":
            self._abort.set()
            while self.running:
                time.sleep(0.005)
            self._abort.clear()
        self.paused = mode
        if call.query.get("clear_cache", "true") == "true" and mode != "keep":
            for cache in self.caches:
                cache.clear()
        return 200, {"status": "paused"}

    def _resume(self, call: Call) -> tuple[int, Any]:
        self.paused = None
        return 200, {"status": "resumed"}

    def _reset_prefix_cache(self, call: Call) -> tuple[int, Any]:
        if self.running and call.query.get("reset_running_requests") != "true":
            return 200, {"success": False}
        for cache in self.caches:
            cache.clear()
        return 200, {"success": True}

    def _reset_encoder_cache(self, call: Call) -> tuple[int, Any]:
        self.encoder_resets += 1
        return 200, None

    def _update_weight_version(self, call: Call) -> tuple[int, Any]:
        body = self._json_object(call)
        if not isinstance(body.get("new_version"), str):
            raise BadRequest(422, {"error": {"message": "new_version: field required", "code": 422}})
        self.weight_versions = [body["new_version"] for _ in self.engines]
        return 200, {"success": True, "new_version": body["new_version"]}

    def _weight_info(self, call: Call) -> tuple[int, Any]:
        if len(set(self.weight_versions)) > 1:
            return 500, {
                "error": {
                    "message": f"Engines returned different get_weight_version results: {self.weight_versions}",
                    "code": 500,
                }
            }
        return 200, {"weight_version": self.weight_versions[0]}

    def _world_size(self, call: Call) -> tuple[int, Any]:
        per_engine = max(1, len(self.engines[0]))
        dp = len(self.engines) if call.query.get("include_dp", "true") == "true" else 1
        return 200, {"world_size": per_engine * dp}

    def _completions(self, call: Call) -> tuple[int, Any]:
        body = self._json_object(call)
        if self.paused in ("abort", "wait"):
            return 503, {"error": {"message": "The engine is paused", "type": "ServiceUnavailableError", "code": 503}}
        engine = self._turn % len(self.engines)
        self._turn += 1
        finished = self._run_request(bool(body.get("hold")), self._abort)
        model = self.engines[engine][0].get_model()
        values = self.caches[engine].compute(model, list(body["prompt"]))
        return 200, {
            "object": "text_completion",
            "choices": [
                {"index": 0, "text": "", "finish_reason": "length" if finished else "abort", "prompt_logprobs": values}
            ],
            "weight_version": self.weight_versions[engine],
        }


def _call_worker(worker: Any, method: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[bool, Any]:
    try:
        return True, getattr(worker, method)(*args, **kwargs)
    except Exception as exc:
        return False, exc


# -- SGLang -------------------------------------------------------------------------------


@dataclass
class LoadFault:
    """Makes the next reloads fail after ``after`` tensors (SGLang raising mid-load).

    ``rollback``: whether SGLang's own roll-back (loading the *new* folder again) then
    completes ("once": a transient fault) or fails too ("always": the scheduler dies on
    the roll-back's exception, the request answers 500). ``engines``: which data-parallel
    engines fault (all by default).
    """

    after: int = 1
    rollback: bool = True
    engines: set[int] | None = None
    times: int = 1
    #: Stop after ``after`` tensors without an error: the rest keep their old bits, as
    #: checkpoint names a model's ``load_weights`` does not map are skipped silently
    #: (``models/llama.py``: ``if name not in params_dict: continue``).
    silent: bool = False


class SglangServer(_Server):
    """SGLang 0.5.23's HTTP server over one or more data-parallel engines (torch modules),
    or one engine of several TP ranks (``ranks``), in ``pp_size`` pipeline stages (stage by
    stage: TP rank ``r`` of stage ``s`` is ``ranks[s * tp + r]``).

    As in the source (``python/sglang/srt/``):

    - ``POST /update_weights_from_disk`` (``entrypoints/http_server.py``,
      ``managers/tokenizer_manager.py``, ``managers/scheduler_components/
      weight_updater.py``, ``model_executor/model_runner_components/weight_updater.py``):
      ``abort_all_requests`` ends running requests first; each engine sets the folder as
      its model path *before* loading, then loads it tensor by tensor into the live
      parameters; on an exception it answers "Failed to update weights: ... Rolling back
      to original weights." after loading the model path (the new folder) again, which
      may complete (the engine then holds the new weights) or raise (500: mixed weights);
      after a load the radix cache is flushed, and a flush refused because requests are
      running fails the call with the new weights in place; the weight version is
      recorded only on success. With several engines the call succeeds only if all do,
      messages joined by `` | ``. 200 or 400 ``{"success", "message", "num_paused_requests"}``.
    - ``POST /update_weights_from_tensor`` (``entrypoints/http_server.py``,
      ``managers/tokenizer_control_mixin.py``, ``managers/scheduler_components/
      weight_updater.py``, ``managers/tp_worker.py``, ``model_executor/
      model_runner_components/weight_updater.py``, ``utils/common.py``): with
      data-parallel replicas an assertion fails (500); ``abort_all_requests`` ends running
      requests; unless generation is paused the call waits for running requests (the
      ``model_update_lock`` writer side); outside a ``/begin_weight_update`` ..
      ``/end_weight_update`` session it answers 400 ("must run between ..."); each TP
      rank unpickles only its own entry of ``serialized_named_tensors`` (base64) with
      SGLang's restricted unpickler (torch tensors and builtin containers only), moves
      each tensor to its device and calls ``dynamic_import(load_format)(model,
      named_tensors)`` when ``load_format`` is listed in ``--custom-weight-loader``
      (``custom_weight_loader``), ``model.load_weights`` when it is None; with pipeline
      stages, stage 0's ranks run it before the call is answered and each later stage's
      ranks after the stage before passed it on (``managers/scheduler_pp_mixin.py``:
      ``event_loop_pp``; only stage 0's first rank answers the tokenizer,
      ``managers/scheduler.py``: ``init_ipc_channels``), here ``stage_lag`` seconds
      after the answer, in order, on one thread; the loader's
      return value is ignored, and **an exception anywhere in a rank (unpickling, an
      unknown ``load_format``, the loader) kills the scheduler and so the server**:
      that call and every later one answer 500 here. After the ranks: the session's
      weights count as loaded, the scheduler records ``weight_version``, and with
      ``flush_cache`` (default true) the radix cache is flushed, a flush refused while
      requests run failing the call ("Weights were updated, but the cache was not
      flushed ..."); the reported ``weight_version`` changes only on success. 200 or 400
      ``{"success", "message"}``.
    - ``POST /begin_weight_update`` / ``/end_weight_update``: 400 when a session is
      already open / none is.
    - ``GET /server_info``: the launch settings (``tp_size``, ``dp_size``, ``pp_size``,
      ``custom_weight_loader``, ``version``).
    - ``GET|POST /flush_cache``: 200, or 400 while requests run.
    - ``GET /model_info`` (``weight_version``); ``legacy=True`` serves SGLang 0.5.3's
      ``GET /get_weight_version`` instead (and no ``/server_info``).
    - ``POST /weights_checker {"action": "checksum"}`` (``utils/weight_checker.py``): one
      ``ChecksumInfo`` per rank (sha256 of each tensor, ``per_gpu_checksum`` over them),
      ``per_engine_checksum`` over the ranks.
    - ``POST /pause_generation {"mode"}`` (``managers/tokenizer_manager.py``,
      ``io_struct.py`` ``PauseGenerationReqInput``): ``abort`` (the default) aborts every
      running request and returns once none runs; ``in_place`` and ``retract`` only stop
      them; until ``/continue_generation`` new requests wait (``is_pause_cond``).
      ``POST /update_weight_version``.
    - ``POST /v1/completions``: computed from the live weights (TP rank 0's) through the
      engine's radix cache (engines in turn); while paused, requests wait.

    Deviations: no tokenizer or sampling (as for vLLM above); the disk load is by
    state-dict name rather than through the model's ``load_weights``, except for TP ranks
    whose models have one (tests/sidecar/sglang_model.py: each rank loads the folder
    through SGLang's ``load_weights`` and weight loaders); one weight version for the scheduler and the tokenizer
    manager (SGLang keeps both; the one reported is the latter, set on success only);
    TP ranks run one after another in the server's thread (SGLang runs one scheduler
    process per rank; the loader code is the same); a later pipeline stage keeps no
    weight-update session, cache or weight version of its own (stage 0's stand for
    all); a dead scheduler answers 500 here instead of taking the process down.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        *,
        engines: list[torch.nn.Module] | None = None,
        ranks: list[torch.nn.Module] | None = None,
        custom_weight_loader: list[str] | None = None,
        refuse: bool = False,
        legacy: bool = False,
        pp_size: int = 1,
        stage_lag: float = 0.05,
    ) -> None:
        if ranks is not None:
            engines = [ranks[0]]
            if len(ranks) % pp_size:
                raise ValueError(f"{len(ranks)} ranks are not {pp_size} pipeline stages")
        self.pp_size, self.stage_lag = pp_size, stage_lag
        #: The later pipeline stages' share of loader calls, run in order on one thread.
        self._later: queue.Queue[tuple[list[torch.nn.Module], list[str], Any] | None] = queue.Queue()
        self._stages = threading.Thread(target=self._run_later_stages, daemon=True)
        self._stages.start()
        self.engines: list[torch.nn.Module] = engines if engines is not None else [model or torch.nn.Module()]
        #: TP ranks of the (one) engine; None: each engine is one rank.
        self.ranks = ranks
        self.custom_weight_loader = list(custom_weight_loader or [])
        #: An open weight-update session: ``{"loaded_weights": bool}``.
        self.session: dict[str, bool] | None = None
        #: Why the scheduler died (an exception in a rank); every call then fails.
        self.dead: str | None = None
        self.caches = [PrefixCache() for _ in self.engines]
        self.weight_version: str | None = "default"
        self.model_path: str | None = None
        self.loaded_from: list[str] = []
        self.refuse = refuse
        self.fault: LoadFault | None = None
        self.paused = False
        self._abort = threading.Event()
        self._turn = 0
        routes: dict[tuple[str, str], Route] = {
            ("POST", "/update_weights_from_disk"): self._update,
            ("GET", "/flush_cache"): self._flush,
            ("POST", "/flush_cache"): self._flush,
            ("POST", "/weights_checker"): self._checksum,
            ("POST", "/update_weight_version"): self._update_weight_version,
            ("POST", "/pause_generation"): self._pause,
            ("POST", "/continue_generation"): self._continue,
            ("POST", "/update_weights_from_tensor"): self._update_from_tensor,
            ("POST", "/begin_weight_update"): self._begin,
            ("POST", "/end_weight_update"): self._end,
            ("POST", "/v1/completions"): self._completions,
            ("GET", "/health"): lambda _: (200, None),
        }
        if not legacy:
            routes[("GET", "/server_info")] = self._server_info
        if legacy:
            routes[("GET", "/get_weight_version")] = lambda _: (200, {"weight_version": self.weight_version})
        else:
            routes[("GET", "/model_info")] = lambda _: (
                200,
                {"model_path": self.model_path, "weight_version": self.weight_version},
            )
        super().__init__({key: self._alive(route) for key, route in routes.items()})

    @property
    def model(self) -> torch.nn.Module:
        return self.engines[0]

    @model.setter
    def model(self, value: torch.nn.Module) -> None:
        self.engines = [value]
        self.ranks = None
        self.caches = [PrefixCache()]

    def _alive(self, route: Route) -> Route:
        def serve(call: Call) -> tuple[int, Any]:
            if self.dead is not None:
                return 500, {"detail": f"Internal Server Error: the scheduler died: {self.dead}"}
            return route(call)

        return serve

    def _tp_ranks(self) -> list[torch.nn.Module]:
        """Every rank of the engine, stage by stage."""
        return self.ranks if self.ranks is not None else [self.engines[0]]

    @property
    def tp_size(self) -> int:
        return len(self._tp_ranks()) // self.pp_size

    def close(self) -> None:
        self._later.put(None)
        self._stages.join(timeout=10.0)
        super().close()

    def _run_later_stages(self) -> None:
        while (work := self._later.get()) is not None:
            ranks, payloads, load_format = work
            time.sleep(self.stage_lag)
            for i, model in enumerate(ranks):
                if self.dead is not None:
                    break
                try:
                    self._run_loader(model, payloads[i % self.tp_size], load_format)
                except Exception as exc:  # the stage's scheduler dies, and the server with it
                    self.dead = f"pipeline stage {1 + i // self.tp_size} TP rank {i % self.tp_size}: {exc!r}"

    def _run_loader(self, model: torch.nn.Module, payload: str, load_format: Any) -> None:
        named = _SafeUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
        named = [(name, tensor.to("cpu")) for name, tensor in named]
        if load_format in self.custom_weight_loader:
            module, _, func = str(load_format).rpartition(".")
            getattr(importlib.import_module(module), func)(model, named)  # return value ignored
        elif load_format is None:
            model.load_weights(named)
        else:
            raise NotImplementedError(f"Unknown load_format={load_format}")

    def _server_info(self, call: Call) -> tuple[int, Any]:
        return 200, {
            "tp_size": self.tp_size,
            "dp_size": len(self.engines),
            "pp_size": self.pp_size,
            "custom_weight_loader": self.custom_weight_loader,
            "version": "0.5.23",
        }

    def _begin(self, call: Call) -> tuple[int, Any]:
        if self.session is not None:
            return 400, {
                "success": False,
                "message": "a weight-update session is already open; call end_weight_update() first",
            }
        self.session = {"loaded_weights": False}
        return 200, {"success": True, "message": "Success"}

    def _end(self, call: Call) -> tuple[int, Any]:
        if self.session is None:
            return 400, {
                "success": False,
                "message": "no weight-update session is open; call begin_weight_update() first",
            }
        self.session = None
        return 200, {"success": True, "message": "Success"}

    def _abort_running(self) -> None:
        self._abort.set()
        while self.running:
            time.sleep(0.005)
        self._abort.clear()

    def _update_from_tensor(self, call: Call) -> tuple[int, Any]:
        body = self._json_object(call)
        if len(self.engines) != 1:  # tokenizer_control_mixin.py asserts dp_size == 1
            return 500, {"detail": "Internal Server Error"}
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or not all(isinstance(p, str) for p in payloads):
            raise BadRequest(422, {"detail": "serialized_named_tensors: a list of base64 strings is required"})
        if body.get("abort_all_requests"):
            self._abort_running()
        while not self.paused and self.running:  # the model_update_lock's writer side
            time.sleep(0.005)
        if self.session is None:
            return 400, {
                "success": False,
                "message": "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
            }
        load_format = body.get("load_format")
        ranks, tp = self._tp_ranks(), self.tp_size
        for rank, model in enumerate(ranks[:tp]):
            try:
                self._run_loader(model, payloads[rank], load_format)
            except Exception as exc:  # uncaught in SGLang: the scheduler process dies
                self.dead = f"TP rank {rank}: {exc!r}"
                return 500, {"detail": "Internal Server Error"}
        if self.pp_size > 1:
            self._later.put((ranks[tp:], list(payloads), load_format))
        self.session["loaded_weights"] = True
        success, message = True, "Success"
        if body.get("flush_cache", True):
            if self.running:
                success = False
                message = (
                    "Weights were updated, but the cache was not flushed because requests are still running "
                    "or queued. Retract or finish them, then call /flush_cache."
                )
            else:
                for cache in self.caches:
                    cache.clear()
        if success and body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
            message += f" Weight version updated to {body['weight_version']}."
        return (200 if success else 400), {"success": success, "message": message}

    def _load(self, engine: int, folder: Path, fault: LoadFault | None) -> None:
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(folder.glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        if self.ranks is not None and all(hasattr(m, "load_weights") for m in self.ranks):
            # Every TP rank loads the folder through its model's own load_weights
            # (model_loader/loader.py: DefaultModelLoader.load_weights_and_postprocess).
            for model in self.ranks:
                model.load_weights(_faulty(sorted(tensors.items()), fault))
            return
        params = self.engines[engine].state_dict()
        with torch.no_grad():
            for k, (name, value) in enumerate(sorted(tensors.items())):
                if fault is not None and k >= fault.after:
                    if fault.silent:
                        continue
                    raise RuntimeError(f"CUDA out of memory while loading {name}")
                params[name].copy_(value)

    def _update(self, call: Call) -> tuple[int, Any]:
        body = self._json_object(call)
        if not isinstance(body.get("model_path"), str):
            raise BadRequest(400, {"object": "error", "message": "model_path: field required", "code": 400})
        if self.refuse:
            return 400, {
                "success": False,
                "message": "Failed to get weights iterator: no such file.",
                "num_paused_requests": 0,
            }
        if body.get("abort_all_requests"):
            self._abort_running()
        fault = self.fault
        if fault is not None:
            fault.times -= 1
            if fault.times <= 0:
                self.fault = None
        results = []
        for engine in range(len(self.engines)):
            self.model_path = body["model_path"]  # set before loading, as SGLang does
            folder = Path(self.model_path)
            faulty = fault if fault is not None and (fault.engines is None or engine in fault.engines) else None
            try:
                self._load(engine, folder, faulty)
            except RuntimeError as exc:
                try:  # SGLang's roll-back loads the model path again: the new folder
                    self._load(engine, folder, None if faulty is not None and faulty.rollback else faulty)
                except RuntimeError:
                    return 500, {"object": "error", "message": "Internal Server Error", "code": 500}
                results.append((False, f"Failed to update weights: {exc}.\nRolling back to original weights."))
                continue
            if self.running:
                results.append(
                    (
                        False,
                        "Weights were updated, but the cache was not flushed because requests "
                        "are still running or queued. Retract or finish them, then call /flush_cache.",
                    )
                )
            else:
                self.caches[engine].clear()
                results.append((True, "Succeeded to update model weights."))
        self.loaded_from.append(body["model_path"])
        success = all(ok for ok, _ in results)
        message = " | ".join(m for _, m in results)
        if success and body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
            message += f" Weight version updated to {body['weight_version']}."
        return (200 if success else 400), {"success": success, "message": message, "num_paused_requests": 0}

    def _flush(self, call: Call) -> tuple[int, Any]:
        if self.running:
            return 400, b"Flush cache failed.\n"
        for cache in self.caches:
            cache.clear()
        return 200, b"Cache flushed.\n"

    def _checksum(self, call: Call) -> tuple[int, Any]:
        body = self._json_object(call) if call.raw else {"action": "checksum"}
        if body.get("action", "checksum") != "checksum":
            return 400, {"success": False, "message": f"Unsupported action={body.get('action')}"}
        ranks = []
        placed = (
            [(i, 0, m) for i, m in enumerate(self.engines)]
            if self.ranks is None
            else list((0, r, m) for r, m in enumerate(self.ranks))
        )
        tp = 1 if self.ranks is None else self.tp_size
        for i, r, model in placed:
            sums = {
                n: hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                for n, t in model.state_dict().items()
                if t.numel()
            }
            overall = hashlib.sha256()
            for name in sorted(sums):
                overall.update(name.encode())
                overall.update(sums[name].encode())
            info = {
                "role": "target",
                "tp_rank": r % tp,
                "tp_size": tp,
                "dp_rank": i,
                "dp_size": len(self.engines),
                "pp_rank": r // tp,
                "pp_size": self.pp_size,
                "rank": i * tp * self.pp_size + r,
                "size": len(self.engines) * tp * self.pp_size,
            }
            ranks.append({"checksums": sums, "per_gpu_checksum": overall.hexdigest(), "parallelism_info": info})
        engine = hashlib.sha256()
        for rank in ranks:
            engine.update(str(rank["per_gpu_checksum"]).encode())
        return 200, {"success": True, "message": "", "ranks": ranks, "per_engine_checksum": engine.hexdigest()}

    def _update_weight_version(self, call: Call) -> tuple[int, Any]:
        body = self._json_object(call)
        self.weight_version = str(body["new_version"])
        return 200, {
            "success": True,
            "message": f"Weight version updated to {body['new_version']}",
            "new_version": body["new_version"],
        }

    def _pause(self, call: Call) -> tuple[int, Any]:
        body = self._json_object(call) if call.raw else {}
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(422, {"detail": f"mode: unexpected value {mode!r}"})
        self.paused = True
        if mode == "abort":
            self._abort_running()
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _continue(self, call: Call) -> tuple[int, Any]:
        self.paused = False
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _completions(self, call: Call) -> tuple[int, Any]:
        body = self._json_object(call)
        deadline = time.monotonic() + 10.0
        while self.paused and time.monotonic() < deadline:  # SGLang waits on is_pause_cond
            time.sleep(0.005)
        engine = self._turn % len(self.engines)
        self._turn += 1
        finished = self._run_request(bool(body.get("hold")), self._abort)
        values = self.caches[engine].compute(self.engines[engine], list(body["prompt"]))
        return 200, {
            "object": "text_completion",
            "choices": [
                {"index": 0, "text": "", "finish_reason": "length" if finished else "abort", "prompt_logprobs": values}
            ],
            "weight_version": self.weight_version,
        }


def _faulty(items: list[tuple[str, torch.Tensor]], fault: LoadFault | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``items`` as a load sees them under ``fault``: cut off (silently or raising)."""
    for k, (name, value) in enumerate(items):
        if fault is not None and k >= fault.after:
            if fault.silent:
                return
            raise RuntimeError(f"CUDA out of memory while loading {name}")
        yield name, value


class _SafeUnpickler(pickle.Unpickler):
    """SGLang's restricted unpickler for ``serialized_named_tensors`` (``utils/common.py``:
    ``SafeUnpickler``), reduced to the globals a CPU tensor pickled by value needs; any
    other global is refused as there ("Blocked unsafe global"), and torch's storage
    helper is replaced by a ``weights_only`` load."""

    ALLOWED = frozenset(
        {
            ("builtins", "list"),
            ("builtins", "tuple"),
            ("builtins", "dict"),
            ("collections", "OrderedDict"),
            ("torch._utils", "_rebuild_tensor"),
            ("torch._utils", "_rebuild_tensor_v2"),
            ("torch._tensor", "_rebuild_from_type_v2"),
            ("torch", "Tensor"),
            ("torch", "Size"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return lambda data: torch.load(io.BytesIO(data), weights_only=True)
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
