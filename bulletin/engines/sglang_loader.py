"""Bulletin's custom weight loader for SGLang: every TP rank patches its own parameters.

Start SGLang with it (SGLang 0.5.23, ``python/sglang/srt/``; docs/ENGINES.md cites each
file)::

    python -m sglang.launch_server --model-path <local-dir>/current \\
        --custom-weight-loader bulletin.engines.sglang_loader.apply --host 127.0.0.1

and ``POST /update_weights_from_tensor`` with ``load_format`` set to that path makes
every TP rank's scheduler call ``apply(model, named_tensors)`` with that rank's own
model (``model_executor/model_runner_components/weight_updater.py``:
``update_weights_from_tensor`` imports the function with ``dynamic_import`` when
``load_format`` is listed in ``--custom-weight-loader``). How SGLang calls it decides the
protocol here:

- ``serialized_named_tensors`` holds one payload per TP rank and rank ``r`` unpickles
  entry ``r`` only (``managers/tp_worker.py``: ``deserialize_own_rank``), with a
  restricted unpickler that admits torch tensors and builtin containers only
  (``utils/common.py``: ``SafeUnpickler``). So the sidecar sends, per rank, one small
  uint8 tensor named :data:`REQUEST_NAME` holding a JSON request (method, body, the
  rank it is for, a reply folder); the patch itself is in Bulletin's shard files in a
  spool folder on the same machine (:func:`encode_requests`).
- The function's return value is ignored and SGLang answers ``success: true`` whatever
  it did; an exception is not caught anywhere on the way (the scheduler's dispatcher,
  the event loop) and kills the scheduler process, which takes the server down
  (``managers/scheduler.py``: ``run_scheduler_process`` logs "Scheduler hit an
  exception" and signals the parent). So :func:`apply` **never raises**: each rank
  writes its result, success or typed error, as ``rank-<r>.json`` into the reply folder,
  and the sidecar reads one per rank after the call returns.
- With pipeline parallelism every stage runs a scheduler per TP rank, and every one of
  them runs the call: stage 0's ranks take it from the tokenizer, each later stage from
  the stage before, after that stage ran it (``managers/scheduler_pp_mixin.py``:
  ``event_loop_pp`` passes on what ``ingest_requests`` ran;
  ``managers/scheduler_components/request_receiver.py``: ``_pull_raw_reqs``); entry
  ``r`` goes to TP rank ``r`` of every stage, and only stage 0's first rank answers the
  HTTP call (``managers/scheduler.py``: ``init_ipc_channels``, ``is_rank_zero``). So a
  request for several stages (format 2) carries each stage's part of the body
  (``per_stage``), a rank takes its stage from its own model (``pp_group``, as
  SGLang's Llama-family models keep it: ``models/llama.py``), its reply is
  ``rank-<stage>-<r>.json`` (:func:`reply_path`), and the sidecar waits for the later
  stages' replies, which may come after the HTTP answer.

Each rank keeps a :class:`SGLangRankState` per model (weakly keyed): its
:class:`~bulletin.engines.rank_layout.RankLayout`, read from the model's own layers
(SGLang's ``ColumnParallelLinear``, ``QKVParallelLinear``, ``VocabParallelEmbedding``,
... and their ``tp_group``; what cannot be mapped is refused at ``bind`` with
``IncompatibleLayout``), and a :class:`~bulletin.engines.torch_module.TorchTarget` over
zero-copy views of its pieces in checkpoint (global) coordinates, so that every
fingerprint a rank reports is its *partial* fingerprint. An ``apply`` carries the whole
patch (checkpoint indices) and this rank's partials before and after it; the rank keeps
the changes that land on its pieces (:meth:`RankLayout.local_patch`) and refuses before
writing anything unless its bits land on those partials; the previous bits are kept
until ``activate`` so that ``abort`` can put them back. SGLang's Llama-family models
list their fused parameters in ``stacked_params_mapping`` (``models/llama.py``) rather
than vLLM's ``packed_modules_mapping``; both are read.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from bulletin.engines.rank_layout import RankLayout
from bulletin.engines.torch_module import TorchTarget
from bulletin.engines.wire import fps_from_json, fps_to_json, request_path, request_paths, specs_from_json
from bulletin.errors import BulletinError, EngineError, InvalidInput, VerificationFailed
from patcher.patch import TensorSpec

if TYPE_CHECKING:
    import torch

__all__ = [
    "LOADER",
    "REQUEST_NAME",
    "STAGED_REQUEST_FORMAT",
    "SGLangRankState",
    "apply",
    "encode_requests",
    "packed_modules",
    "reply_path",
]

log = logging.getLogger("bulletin.engines.sglang_loader")

#: The import path to pass as ``--custom-weight-loader`` and ``load_format``.
LOADER: Final = "bulletin.engines.sglang_loader.apply"
#: The name of the one "tensor" of a request: the JSON request's bytes.
REQUEST_NAME: Final = "bulletin.request"
#: Version of the request format (``{"bulletin": 1, ...}``): 1 for an engine of one
#: pipeline stage; 2 adds ``stages`` and ``per_stage`` (a loader that reads only 1 then
#: answers nothing rather than every stage writing stage 0's reply).
REQUEST_FORMAT: Final = 1
STAGED_REQUEST_FORMAT: Final = 2


def reply_path(folder: str | Path, rank: int, stage: int = 0) -> Path:
    """Where TP rank ``rank`` of pipeline stage ``stage`` writes its result for a request
    replying to ``folder`` (stage 0's name is format 1's)."""
    return Path(folder) / (f"rank-{rank:04d}.json" if stage == 0 else f"rank-{stage}-{rank:04d}.json")


def encode_requests(requests: Sequence[Mapping[str, Any]]) -> list[str]:
    """``serialized_named_tensors`` for ``/update_weights_from_tensor``: entry ``r`` is
    rank ``r``'s request, a one-tensor list ``[(REQUEST_NAME, uint8 JSON bytes)]``
    pickled as SGLang's restricted unpickler accepts it (a CPU tensor through
    ``torch._utils._rebuild_tensor_v2``), base64 as its HTTP schema wants."""
    import numpy as np
    import torch

    out = []
    for request in requests:
        data = json.dumps(request, separators=(",", ":")).encode()
        tensor = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
        out.append(base64.b64encode(pickle.dumps([(REQUEST_NAME, tensor)], protocol=4)).decode("ascii"))
    return out


def packed_modules(model: torch.nn.Module) -> dict[str, list[str]]:
    """Fused parameter -> its checkpoint members, in order: vLLM's
    ``packed_modules_mapping`` if the model has one, else SGLang's
    ``stacked_params_mapping`` (``(".qkv_proj", ".q_proj", "q")``, ...; shard ids ``q``,
    ``k``, ``v`` or 0, 1, ... give the order)."""
    packed = getattr(model, "packed_modules_mapping", None)
    if isinstance(packed, Mapping) and packed:
        return {str(p): [str(m) for m in members] for p, members in packed.items()}
    stacked = getattr(model, "stacked_params_mapping", None)
    if not isinstance(stacked, Sequence):
        return {}
    order = {"q": 0, "k": 1, "v": 2}
    groups: dict[str, list[tuple[int, str]]] = {}
    for item in stacked:
        if not (isinstance(item, Sequence) and len(item) == 3):
            continue
        param, member, shard = item
        rank = order.get(shard, shard) if isinstance(shard, str) else shard
        if not (isinstance(param, str) and isinstance(member, str) and isinstance(rank, int)):
            continue
        groups.setdefault(param.strip("."), []).append((rank, member.strip(".")))
    return {p: [m for _, m in sorted(members)] for p, members in groups.items()}


class SGLangRankState:
    """What one SGLang TP rank holds: its layout and a TorchTarget over its pieces.

    ``rank`` / ``ranks`` are the TP rank and size the requests name; the model's layers
    must agree (``RankLayout.of_module``).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.layout: RankLayout | None = None
        self.target: TorchTarget | None = None
        self.specs: dict[str, TensorSpec] | None = None

    def bind(self, specs: Mapping[str, TensorSpec], rank: int, ranks: int, stage: int = 0) -> RankLayout:
        """Map every served tensor to this rank's pieces of its parameters (no copies);
        what another pipeline stage holds is not this rank's."""
        layout = RankLayout.of_module(
            self.model,
            specs,
            tp_rank=rank,
            tp_size=ranks,
            pp_rank=stage,
            packed_modules_mapping=packed_modules(self.model),
        )
        self.target = layout.target(self.model)
        self.layout, self.specs = layout, dict(specs)
        return layout

    def handle(self, method: str, body: Mapping[str, Any], rank: int, ranks: int, stage: int = 0) -> dict[str, Any]:
        """Run one request; errors come back as ``{"ok": false, ...}``, never raised."""
        try:
            result = self._dispatch(method, body, rank, ranks, stage)
        except BulletinError as exc:
            return {"ok": False, "code": exc.code, "message": str(exc)}
        return {"ok": True, **result}

    def _bound(self, body: Mapping[str, Any], rank: int, ranks: int, stage: int) -> tuple[RankLayout, TorchTarget]:
        if "specs" in body:
            specs = specs_from_json(body["specs"])
            held = None if self.layout is None else (self.layout.tp_rank, self.layout.tp_size, self.layout.pp_rank)
            if self.specs != specs or held != (rank, ranks, stage):
                self.bind(specs, rank, ranks, stage)
        if self.layout is None or self.target is None:
            raise InvalidInput("the rank has not been bound to a layout yet")
        return self.layout, self.target

    def _dispatch(self, method: str, body: Mapping[str, Any], rank: int, ranks: int, stage: int) -> dict[str, Any]:
        if method == "bind":
            if "specs" not in body:
                raise InvalidInput("bind needs specs")
            self.layout = None  # a reload may have replaced parameters: map afresh
        layout, target = self._bound(body, rank, ranks, stage)
        if method == "bind":
            return {"layout": layout.to_json(), "dropped": sorted(layout.dropped)}
        if method == "fingerprints":
            return {"fingerprints": fps_to_json(target.full_fingerprints())}
        if method == "load":
            from bulletin.checkpoint import Checkpoint

            assert self.specs is not None
            with Checkpoint(request_path(body, "path")) as ckpt:
                full = {name: ckpt.bits(name) for name in layout.pieces}
                target.load_full(layout.local_bits(full), layout.local_specs(self.specs))
            # Read back from the live parameters: what the engine computes with.
            return {"fingerprints": fps_to_json(target.full_fingerprints())}
        if method == "apply":
            from patcher.decode import decode

            patch = decode([Path(p).read_bytes() for p in request_paths(body, "shards")])
            base, expect = fps_from_json(body.get("base")), fps_from_json(body.get("expect"))
            # Only the changes that land on this rank's pieces, each piece checked against
            # this rank's partials before anything is written.
            local = layout.local_patch(patch, base=base, target=expect)
            new = {**base, **target.apply(local, base)}
            bad = sorted(n for n in layout.pieces if new.get(n) != expect.get(n))
            if bad:
                target.abort()
                where = f"TP rank {rank}" + (f" of pipeline stage {stage}" if stage else "")
                raise VerificationFailed(f"{where} would land on other bits for {len(bad)} tensor(s): {bad[:3]}")
            return {"fingerprints": fps_to_json(new)}
        if method == "abort":
            target.abort()
            return {}
        if method == "activate":
            version = body.get("version")
            if not isinstance(version, int) or isinstance(version, bool) or version < 0:
                raise InvalidInput("version must be a non-negative integer")
            target.activate(version)
            return {"version": version}
        raise InvalidInput(f"unknown method {method!r}")


_STATES: weakref.WeakKeyDictionary[Any, SGLangRankState] = weakref.WeakKeyDictionary()


def _state(model: torch.nn.Module) -> SGLangRankState:
    state = _STATES.get(model)
    if state is None:
        state = _STATES[model] = SGLangRankState(model)
    return state


def _engine_rank() -> tuple[int, int] | None:
    """(TP rank, TP size) as SGLang's parallel state says, where it is initialised."""
    try:
        from sglang.srt.distributed import (  # type: ignore[import-not-found, unused-ignore]
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
    except Exception:  # not inside SGLang (tests), or its groups are not set up
        return None


def _stage(model: torch.nn.Module) -> tuple[int, int]:
    """(pipeline stage, stages) of a rank's model: its ``pp_group`` (SGLang's
    ``GroupCoordinator``, which Llama-family models keep, ``models/llama.py``), else
    SGLang's own (``distributed/parallel_state.py``: ``get_pp_group``) where it is set up,
    else one stage."""
    group = getattr(model, "pp_group", None)
    if group is None:
        try:
            from sglang.srt.distributed import get_pp_group  # type: ignore[import-not-found, unused-ignore]

            group = get_pp_group()
        except Exception:  # not inside SGLang (tests), or its groups are not set up
            return 0, 1
    stage, stages = getattr(group, "rank_in_group", None), getattr(group, "world_size", None)
    if not (isinstance(stage, int) and isinstance(stages, int) and 0 <= stage < stages):
        raise InvalidInput(f"the model's pp_group says stage {stage!r} of {stages!r}")
    return stage, stages


def _request(named_tensors: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    if len(named_tensors) != 1 or named_tensors[0][0] != REQUEST_NAME:
        names = [str(n) for n, _ in named_tensors[:3]]
        raise InvalidInput(f"not a Bulletin request: {len(named_tensors)} tensors {names}")
    tensor = named_tensors[0][1]
    data = bytes(tensor.detach().to("cpu").contiguous().numpy().tobytes())
    request = json.loads(data)
    if not isinstance(request, dict) or request.get("bulletin") not in (REQUEST_FORMAT, STAGED_REQUEST_FORMAT):
        raise InvalidInput(f"not a Bulletin request of format {REQUEST_FORMAT} or {STAGED_REQUEST_FORMAT}")
    return request


def _stage_body(request: Mapping[str, Any], stage: int, stages: int) -> dict[str, Any]:
    """The body of the request for pipeline stage ``stage`` of the engine's ``stages``."""
    body = request.get("body")
    if not isinstance(body, dict):
        raise InvalidInput("request needs a body object")
    if request.get("bulletin") == REQUEST_FORMAT:
        if stages != 1:
            raise InvalidInput(f"a request for one pipeline stage reached stage {stage} of {stages}")
        return body
    parts = request.get("per_stage")
    if request.get("stages") != stages or not isinstance(parts, list) or len(parts) != stages:
        raise InvalidInput(f"request for {request.get('stages')!r} pipeline stages reached stage {stage} of {stages}")
    part = parts[stage]
    if not isinstance(part, dict):
        raise InvalidInput(f"request's part for pipeline stage {stage} is not an object")
    return {**body, **part}


def _write_reply(folder: str, rank: int, stage: int, result: Mapping[str, Any]) -> None:
    path = reply_path(folder, rank, stage)
    part = path.with_name(f".{path.name}.part")
    part.write_text(json.dumps(result))
    os.replace(part, path)  # the sidecar never reads half a reply


def apply(model: torch.nn.Module, named_tensors: Sequence[tuple[str, Any]]) -> None:
    """The custom weight loader SGLang calls on every TP rank (see the module notes).

    Runs the request on this rank's model and writes the result to the reply folder;
    never raises, since an exception here would kill SGLang's scheduler.
    """
    try:
        request = _request(named_tensors)
        folder = request.get("reply")
        if not isinstance(folder, str) or not folder:
            raise InvalidInput("request has no reply folder")
    except Exception as exc:
        log.error("bulletin loader: ignored a call that is not a Bulletin request: %s", exc)
        return
    rank, ranks = request.get("rank"), request.get("ranks")
    stage = 0
    try:
        stage, stages = _stage(model)
        if not (isinstance(rank, int) and isinstance(ranks, int) and 0 <= rank < ranks):
            raise InvalidInput(f"request names rank {rank!r} of {ranks!r}")
        engine = _engine_rank()
        if engine is not None and engine != (rank, ranks):
            raise InvalidInput(f"request for TP rank {rank} of {ranks} reached rank {engine[0]} of {engine[1]}")
        method = request.get("method")
        if not isinstance(method, str):
            raise InvalidInput("request needs a method")
        result = _state(model).handle(method, _stage_body(request, stage, stages), rank, ranks, stage)
    except Exception as exc:  # anything at all: reported, never raised into SGLang
        log.exception("bulletin loader: rank %s (pipeline stage %s) failed", rank, stage)
        result = {"ok": False, "code": EngineError.code, "message": f"{type(exc).__name__}: {exc}"}
    result = {**result, "rank": rank, "stage": stage}
    try:
        _write_reply(folder, rank if isinstance(rank, int) else -1, stage, result)
    except Exception as exc:
        log.error("bulletin loader: rank %s could not write its reply to %s: %s", rank, folder, exc)
