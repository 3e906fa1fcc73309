"""vLLM: patch the workers' parameters in place through a worker extension.

Written against vLLM 0.33.0 (vllm-project/vllm, commit ``4ba787ec9``; docs/ENGINES.md
cites each file): ``--worker-extension-cls`` mixes a class into every worker, and with
``VLLM_SERVER_DEV_MODE=1`` the OpenAI server exposes ``POST /collective_rpc``
``{"method", "args", "kwargs", "timeout"}`` -> ``{"results": [one per worker of the
first engine]}`` (string arguments only), plus the control endpoints used here:
``/pause?mode=abort`` and ``/resume``, ``/reset_prefix_cache`` (``{"success": bool}``),
``/reset_encoder_cache``, ``/update_weight_version`` and ``/get_world_size``.

Start vLLM from the folder the sidecar keeps::

    VLLM_SERVER_DEV_MODE=1 vllm serve <local-dir>/current --dtype bfloat16 \\
        --worker-extension-cls bulletin.engines.vllm.BulletinWorkerExtension

:class:`VLLMTarget` (the sidecar side) does all it can while the engine still serves
(:meth:`VLLMTarget.prepare`, before the sidecar's gate is held): it applies the version
to that folder (journaled, verified, not activated: it is what a restarted engine
loads), writes the patch in Bulletin's own shard format to a spool folder on the same
machine and calls ``bulletin_prepare`` on every worker, which decodes its part and
checks and precomputes it with :class:`~bulletin.engines.torch_module.TorchTarget` on
zero-copy views of its own parameters (reads only;
:func:`~bulletin.engines.torch_module.packed_views` finds ``q_proj`` inside ``qkv_proj``
and so on). Then it pauses the engine (``mode=abort``: requests that outlived the
sidecar's drain end with finish reason ``abort``, and nothing runs while bits change)
and calls ``bulletin_apply``: the pause is the workers' writes. At activation the prefix
and encoder caches are reset (nothing computed with the old bits is reused), vLLM's
weight version is set to Bulletin's, and the engine resumes.

Tensor (and pipeline) parallelism: each worker maps the served tensors to the pieces of
its own parameters with :class:`~bulletin.engines.rank_layout.RankLayout` (vLLM's
sharding rules per layer class), so its fingerprints are partial ones in checkpoint
indices. The sidecar builds a :class:`~bulletin.engines.rank_layout.ReplicaPlan` over
the first engine's workers (refusing overlapping or uncovering layouts at bind),
computes every rank's partials of the folder's verified bits (O(model) once, then
O(changed) per patch), checks that they sum to the manifest's fingerprints, and sends
each rank its base and target partials (keyed by ``"<pp>.<tp>"``): every worker of every
engine refuses before writing unless its bits land on its own target, and the results
returned are summed per replica set and compared again before activation.

Every state-changing call carries the fingerprints the worker must end on, and every
worker checks its own result: vLLM's API server returns the results of the first
data-parallel engine only, but an exception raised by any engine's worker reaches the
caller (``call_utility_all_async`` gathers them). So a worker that fails, or lands on
other bits, raises ``RuntimeError("bulletin-error {json}")``, which the target turns
back into the Bulletin error it names.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import shutil
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np
from numpy.typing import NDArray

from bulletin.engines.http import engine_url, request_json
from bulletin.engines.rank_layout import RankLayout, ReplicaPlan, with_dropped
from bulletin.engines.vllm_sparse import bind_rank
from bulletin.engines.wire import (
    ERRORS,
    SPOOL_SHARD_BYTES,
    fps_from_json,
    fps_to_json,
    request_path,
    request_paths,
    specs_from_json,
    specs_to_json,
)
from bulletin.errors import (
    BulletinError,
    ConfigError,
    EngineError,
    FingerprintMismatch,
    InvalidInput,
    VerificationFailed,
)
from bulletin.target import Held, LocalDirTarget, WeightTarget
from patcher.fingerprint import fingerprint
from patcher.patch import Patch, TensorSpec

if TYPE_CHECKING:
    import torch

__all__ = ["ERROR_MARK", "PROTOCOL", "BulletinWorkerExtension", "VLLMTarget", "WorkerState"]

Bits = NDArray[np.unsignedinteger]
log = logging.getLogger("bulletin.engines.vllm")

#: What a worker's exception message starts its JSON error with (vLLM relays the text).
ERROR_MARK: Final = "bulletin-error "

_METHODS: Final = frozenset({"bind", "fingerprints", "load", "prepare", "apply", "abort", "activate"})
#: What the sidecar and the workers' extension agree on; 2: applies carry tokens, aborts
#: name the apply they undo and activations do not call the workers (see ``VLLMTarget.activate``).
PROTOCOL: Final = 2


def _differing(held: Mapping[str, int], expected: Mapping[str, int]) -> list[str]:
    return sorted(n for n in held.keys() | expected.keys() if held.get(n) != expected.get(n))


# -- worker side -------------------------------------------------------------------------


class WorkerState:
    """What one worker holds: its rank's layout and a TorchTarget over its pieces.

    ``model`` is the worker's ``nn.Module``. The extension below creates one per worker;
    tests drive it with any torch module laid out the way vLLM lays out its own.
    :class:`~bulletin.engines.rank_layout.RankLayout` maps each served tensor to the
    piece of a parameter this rank holds (vLLM's tensor-parallel rules, per layer
    class), so every fingerprint a worker reports is a *partial* one: over the elements
    it holds, in the checkpoint's (global) indices; with one rank it is the tensor's.
    ``pp_rank`` is the worker's pipeline stage (its tensor-parallel rank comes from its
    layers). Requests carry one value per rank, keyed by :attr:`RankLayout.key`.
    """

    def __init__(self, model: torch.nn.Module, *, pp_rank: int = 0) -> None:
        self.model = model
        self.pp_rank = pp_rank
        self.layout: RankLayout | None = None
        self.target: WeightTarget | None = None
        self.specs: dict[str, TensorSpec] | None = None
        #: A patch checked and precomputed by ``prepare`` (reads only), with this rank's
        #: base and expected partials and the sidecar's token for it, for ``apply`` to write.
        self._staged: tuple[Patch, dict[str, int], dict[str, int], str | None] | None = None
        #: The token of the patch written last, while this rank can still undo it: until
        #: the next request that names a base over the live bits (which commits it), a
        #: load, a bind, an ``activate``, or an ``abort`` that names it.
        self._applied: str | None = None
        #: The version this rank was last told it holds (a commit's label).
        self.version: int | None = None

    @property
    def dropped(self) -> list[str]:
        return sorted(self.layout.dropped) if self.layout is not None else []

    def bind(self, specs: Mapping[str, TensorSpec]) -> None:
        """Map every served tensor to this rank's piece of it (no copies)."""
        # vLLM's rules per layer class; what they refuse goes through vLLM's own sparse
        # checkpoint patches where its loaders are proven to only place elements.
        layout, self.target = bind_rank(self.model, specs, pp_rank=self.pp_rank)
        self.layout = layout
        self.specs = dict(specs)
        self._staged, self._applied = None, None

    def _bound(self, specs: Mapping[str, TensorSpec] | None) -> tuple[RankLayout, WeightTarget | None]:
        if specs is not None and (self.layout is None or self.specs != dict(specs)):
            self.bind(specs)
        if self.layout is None:
            raise InvalidInput("the worker has not been bound to a layout yet")
        return self.layout, self.target

    def handle(self, method: str, request: str) -> dict[str, Any]:
        """Run one request; errors come back as ``{"ok": false, ...}``, never raised."""
        try:
            body = json.loads(request) if request else {}
            if not isinstance(body, dict):
                raise InvalidInput("request must be a JSON object")
            result = self._dispatch(method, body)
        except BulletinError as exc:
            return {"ok": False, "code": exc.code, "message": str(exc), **getattr(exc, "details", {})}
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return {"ok": False, "code": InvalidInput.code, "message": f"request is not JSON: {exc}"}
        return {"ok": True, **result}

    def _mine(self, body: Mapping[str, Any], key: str, layout: RankLayout) -> dict[str, int] | None:
        """This rank's entry of a per-rank field (``{rank key: {name: fingerprint}}``)."""
        if key not in body:
            return None
        per_rank = body[key]
        if not isinstance(per_rank, dict) or layout.key not in per_rank:
            raise InvalidInput(f"{key} has no entry for rank {layout.key}")
        return fps_from_json(per_rank[layout.key])

    def _dispatch(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        if method not in _METHODS:
            raise InvalidInput(f"unknown method {method!r}")
        specs = specs_from_json(body["specs"]) if "specs" in body else None
        layout, target = self._bound(specs)
        if method == "bind":
            return {"layout": layout.to_json(), "dropped": self.dropped, "protocol": PROTOCOL}
        expect = self._mine(body, "expect", layout)
        if method == "activate":
            version = _version(body.get("version"))
            if version is None:
                raise InvalidInput("version must be a non-negative integer")
            self._commit(target, version)
            return {"version": version, "rank": layout.key}
        if target is None:  # a rank that holds none of the served tensors
            return {"fingerprints": {}, "rank": layout.key}
        if method == "fingerprints":
            held = self._check(target.full_fingerprints(), expect, FingerprintMismatch, layout)
            return {"fingerprints": fps_to_json(held), "rank": layout.key}
        if method == "load":
            from bulletin.checkpoint import Checkpoint

            with Checkpoint(request_path(body, "path")) as ckpt:
                pieces = layout.local_bits({name: ckpt.bits(name) for name in layout.pieces})
                self._staged, self._applied = None, None  # overwritten: nothing left to undo
                target.load_full(pieces, target.layout() or {})
            # Read back from the live parameters: what the engine computes with.
            held = self._check(target.full_fingerprints(), expect, VerificationFailed, layout)
            return {"fingerprints": fps_to_json(held), "rank": layout.key}
        if method in ("prepare", "apply"):
            token = body.get("token")
            if token is not None and not isinstance(token, str):
                raise InvalidInput("token must be a string")
            staged, self._staged = self._staged, None
            if method == "apply" and body.get("prepared") is True:
                if staged is None or staged[3] != token:
                    raise InvalidInput("apply of a prepared patch, but this rank prepared no such patch")
                local, base, expect, _ = staged
            else:
                # A request naming a base over the live bits: an apply still undoable
                # here was activated (the sidecar names bases only over bits it holds as
                # verified), so it is committed first, as an ``activate`` would.
                self._commit(target, _version(body.get("held")))
                local, base, expect = self._local_patch(body, layout, expect)
            if method == "prepare":
                # Reads only, while the engine still serves: decoded, checked against this
                # rank's base and targets, the new bits computed; nothing is written.
                target.prepare(local, {n: base[n] for n in local.tensors})
                self._staged = (local, base, expect, token)
                return {"rank": layout.key}
            # Refused before any write unless the bits read land on this rank's targets.
            fps = {**base, **target.apply(local, {n: base[n] for n in local.tensors})}
            self._applied = token
            return {
                "fingerprints": fps_to_json(self._check(fps, expect, VerificationFailed, layout)),
                "rank": layout.key,
            }
        self._staged = None
        if "token" in body and (body["token"] is None or body["token"] != self._applied):
            # Not the patch written last (a prepare that failed, or an abort that reached
            # this rank twice): what it holds was committed or is not this call's to undo.
            return {"rank": layout.key}
        self._applied = None
        target.abort()
        return {"rank": layout.key}

    def _commit(self, target: WeightTarget | None, version: int | None) -> None:
        """Forget the undo data of what was written last: it is the version held now."""
        self._applied = None
        if version is not None:
            self.version = version
        if target is not None:
            target.activate(self.version if self.version is not None else 0)

    def _local_patch(
        self, body: Mapping[str, Any], layout: RankLayout, expect: dict[str, int] | None
    ) -> tuple[Patch, dict[str, int], dict[str, int]]:
        """This rank's part of the spooled patch, with its base and expected partials."""
        from patcher.decode import decode

        base = self._mine(body, "fingerprints", layout)
        if base is None or expect is None:
            raise InvalidInput("apply needs each rank's fingerprints and expect")
        shards = [Path(p).read_bytes() for p in request_paths(body, "shards")]
        return layout.local_patch(decode(shards), base, expect), base, expect

    @staticmethod
    def _check(
        held: dict[str, int], expect: Mapping[str, int] | None, kind: type[BulletinError], layout: RankLayout
    ) -> dict[str, int]:
        if expect is None:
            return held
        bad = _differing(held, expect)
        if bad:
            exc = kind(f"rank {layout.key} holds other bits than expected for {len(bad)} tensor(s): {bad[:3]}")
            exc.details = {  # type: ignore[attr-defined]
                "fingerprints": fps_to_json({n: held[n] for n in bad if n in held}),
                "mismatched": bad,
                "rank": layout.key,
            }
            raise exc
        return held


class BulletinWorkerExtension:
    """Mixed into each vLLM worker by ``--worker-extension-cls``.

    vLLM refuses an extension whose attribute names clash with the worker's, so every
    name here starts with ``bulletin_``. Call through ``collective_rpc`` with one JSON
    string argument (see :class:`VLLMTarget`). A failure raises, so that it reaches the
    caller from any data-parallel engine, not only from the first.
    """

    def bulletin_state(self) -> WorkerState:
        state: WorkerState | None = getattr(self, "_bulletin_worker_state", None)
        if state is None:
            get_model = getattr(self, "get_model", None)
            model = get_model() if callable(get_model) else self.model_runner.model  # type: ignore[attr-defined]
            state = WorkerState(model, pp_rank=_pp_rank())
            self._bulletin_worker_state = state
        return state

    def bulletin_call(self, method: str, request: str) -> dict[str, Any]:
        result = self.bulletin_state().handle(method, request)
        if result.get("ok") is not True:
            raise RuntimeError(ERROR_MARK + json.dumps(result))
        return result

    def bulletin_bind(self, request: str) -> dict[str, Any]:
        return self.bulletin_call("bind", request)

    def bulletin_fingerprints(self, request: str) -> dict[str, Any]:
        return self.bulletin_call("fingerprints", request)

    def bulletin_load(self, request: str) -> dict[str, Any]:
        return self.bulletin_call("load", request)

    def bulletin_prepare(self, request: str) -> dict[str, Any]:
        return self.bulletin_call("prepare", request)

    def bulletin_apply(self, request: str) -> dict[str, Any]:
        return self.bulletin_call("apply", request)

    def bulletin_abort(self, request: str) -> dict[str, Any]:
        return self.bulletin_call("abort", request)

    def bulletin_activate(self, request: str) -> dict[str, Any]:
        return self.bulletin_call("activate", request)


def _version(value: Any) -> int | None:
    """A version number from a request, or None if it is not one."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return None
    return value


def _pp_rank() -> int:
    """The worker's pipeline stage (``vllm.distributed.get_pp_group().rank_in_group``),
    0 where vLLM is not importable or its groups are not set up (tests, one stage)."""
    try:
        from vllm.distributed import get_pp_group  # type: ignore[import-not-found, unused-ignore]

        return int(get_pp_group().rank_in_group)
    except Exception:  # not inside a vLLM worker: one stage
        return 0


def _worker_error(text: str) -> dict[str, Any] | None:
    """The JSON a worker put after :data:`ERROR_MARK` in an exception message, if any."""
    at = text.find(ERROR_MARK)
    if at < 0:
        return None
    with contextlib.suppress(json.JSONDecodeError):
        found, _ = json.JSONDecoder().raw_decode(text, at + len(ERROR_MARK))
        if isinstance(found, dict):
            return found
    return None


# -- sidecar side ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Staged:
    """A patch :meth:`VLLMTarget.prepare` applied to the folder and spooled to every worker."""

    patch: Patch
    base: dict[str, int]
    new: dict[str, int]  # the folder's fingerprints after it
    expected: dict[str, int]  # the engine's (served tensors only)
    after: list[dict[str, int]]  # each rank's partials after it
    token: str  # what the workers know it by (their apply, its abort)


class VLLMTarget(WeightTarget):
    """A :class:`~bulletin.target.WeightTarget` for a vLLM server at ``url``.

    ``local`` is the folder vLLM was started from; ``spool_dir`` (default
    ``<local>/spool``) must be readable by the vLLM workers (same machine).
    """

    #: Workers' parameters change during ``load_full`` and ``apply``.
    in_place = True
    #: A load overwrites the workers' parameters, which keep no copy of what they held.
    restores_loads = False

    def __init__(
        self,
        local: LocalDirTarget,
        url: str,
        *,
        spool_dir: str | Path | None = None,
        timeout: float = 600.0,
    ) -> None:
        self.local = local
        self.url = engine_url(url)
        self.timeout = timeout
        self.spool_dir = Path(spool_dir) if spool_dir is not None else local.dir / "spool"
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self._bound_specs: dict[str, TensorSpec] | None = None
        #: Served tensors the engine does not hold (see ``engine_drops``), per binding.
        self.dropped: frozenset[str] = frozenset()
        #: The ranks of one engine and whose partial fingerprints make up each tensor's.
        self.plan: ReplicaPlan | None = None
        #: Fingerprints of what every worker was last shown to hold (engine tensors only).
        self._engine_fps: dict[str, int] | None = None
        #: Each rank's partial fingerprints of those bits (``plan.layouts`` order).
        self._rank_fps: list[dict[str, int]] | None = None
        self._workers: int | None = None
        self._paused = False
        #: The patch :meth:`prepare` applied to the folder and had every worker prepare.
        self._staged: _Staged | None = None
        #: The token of a patch sent to the workers' ``apply`` and not activated: what an
        #: abort must have them undo (some may have written it even if the call failed).
        self._applied: str | None = None
        #: The version the workers hold as activated (None: not known to this process).
        self._version: int | None = None
        #: The weight version label last set on the engine by this process.
        self._label: str | None = None
        #: Threads for the control calls that may run at once (see :meth:`activate`).
        self._pool: ThreadPoolExecutor | None = None

    # -- HTTP ------------------------------------------------------------------------------

    def _post(self, path: str, payload: Any = None, *, what: str) -> Any:
        status, body = request_json("POST", f"{self.url}{path}", payload, timeout=self.timeout + 30.0)
        if status != 200:
            raise self._failure(status, body, what)
        return body

    def _failure(self, status: int, body: Any, what: str) -> BulletinError:
        message = _message(body)
        found = _worker_error(message)
        if found is not None:
            cls = ERRORS.get(str(found.get("code")), EngineError)
            exc = cls(f"vLLM worker: {found.get('message')}")
            exc.details = found  # type: ignore[attr-defined]
            return exc
        hint = (
            "; is the server started with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls "
            "bulletin.engines.vllm.BulletinWorkerExtension?"
            if status == 404
            else ""
        )
        return EngineError(f"vLLM {what} failed (HTTP {status}): {message}{hint}")

    def workers(self) -> int:
        """Workers of one engine (tensor x pipeline parallel): results every RPC must have."""
        if self._workers is None:
            status, body = request_json(
                "GET", f"{self.url}/get_world_size?include_dp=false", timeout=min(self.timeout, 60.0)
            )
            size = body.get("world_size") if isinstance(body, dict) else None
            if status != 200 or not isinstance(size, int) or size < 1:
                raise self._failure(status, body, "get_world_size")
            self._workers = size
        return self._workers

    def call(self, method: str, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        """``collective_rpc("bulletin_<method>", [json])``: one result per worker, all ok.

        Only the first data-parallel engine's results come back (vLLM's API server); the
        other engines' workers check the ``expect`` fingerprints of ``body`` themselves
        and raise, which does come back.
        """
        payload = {"method": f"bulletin_{method}", "args": [json.dumps(body)], "timeout": self.timeout}
        answer = self._post("/collective_rpc", payload, what=f"collective_rpc {method}")
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list) or not results:
            raise EngineError(f"vLLM collective_rpc {method}: no worker answered ({answer!r:.200})")
        for i, result in enumerate(results):
            if not isinstance(result, dict) or result.get("ok") is not True:
                raise EngineError(f"vLLM worker {i} answered {method} with {result!r:.200}")
        if len(results) != self.workers():
            raise EngineError(f"vLLM collective_rpc {method}: {len(results)} results for {self.workers()} workers")
        return results

    def pause(self) -> None:
        """Stop the engine stepping before its bits change (``mode=abort``: requests still
        running, which outlived the sidecar's drain, end with finish reason ``abort``).

        ``clear_cache=false``: the caches are reset after the writes (:meth:`reset_caches`),
        which is what guarantees nothing computed with the old bits is reused; vLLM
        0.33 deprecates resetting them in the pause."""
        if not self._paused:
            self._post("/pause?mode=abort&clear_cache=false", what="pause")
            self._paused = True

    def resume(self) -> None:
        if self._paused:
            self._post("/resume", what="resume")
            self._paused = False

    def reset_caches(self) -> None:
        """Drop every cached result computed with other bits: prefix (KV) and encoder caches."""
        self._concurrently(self._reset_prefix_cache, self._reset_encoder_cache)

    def _reset_prefix_cache(self) -> None:
        answer = self._post("/reset_prefix_cache", what="reset_prefix_cache")
        if not (isinstance(answer, dict) and answer.get("success") is True):
            # Blocks still held by running requests: preempt them and reset again.
            answer = self._post("/reset_prefix_cache?reset_running_requests=true", what="reset_prefix_cache")
            if not (isinstance(answer, dict) and answer.get("success") is True):
                raise EngineError(f"vLLM could not reset its prefix cache: {answer!r:.200}")

    def _reset_encoder_cache(self) -> None:
        self._post("/reset_encoder_cache", what="reset_encoder_cache")

    def _set_label(self, label: str) -> None:
        """vLLM's weight version (the label it attaches to its outputs)."""
        self._post("/update_weight_version", {"new_version": label}, what="update_weight_version")
        self._label = label

    def _concurrently(self, *calls: Callable[[], None]) -> None:
        """Run independent control calls at once and wait for all; the first failure is
        raised once every call has ended. vLLM's API server takes concurrent requests and
        its engine core runs utility calls one at a time, in arrival order
        (``EngineCoreProc._handle_client_request``), so only the round trips overlap."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="bulletin-vllm")
        futures = [self._pool.submit(call) for call in calls]
        errors = [exc for f in futures if (exc := f.exception()) is not None]
        if errors:
            raise errors[0]

    def engine_version(self) -> str | None:
        """The weight version vLLM reports (``GET /weight_info``)."""
        status, body = request_json("GET", f"{self.url}/weight_info", timeout=min(self.timeout, 60.0))
        if status != 200 or not isinstance(body, dict):
            raise self._failure(status, body, "weight_info")
        value = body.get("weight_version")
        return None if value is None else str(value)

    # -- layout ----------------------------------------------------------------------------

    def _specs_body(self, specs: Mapping[str, TensorSpec]) -> dict[str, Any]:
        # Workers rebind only when the layout changes; send it only then.
        if self._bound_specs == dict(specs):
            return {}
        return {"specs": specs_to_json(specs)}

    def _bind(self, specs: Mapping[str, TensorSpec]) -> ReplicaPlan:
        if self._bound_specs != dict(specs) or self.plan is None:
            # A bind may probe parameters through vLLM's own loader (the sparse fallback
            # swaps a parameter's storage for a moment): nothing may step meanwhile.
            was_paused = self._paused
            self.pause()
            try:
                results = self.call("bind", {"specs": specs_to_json(specs)})
            finally:
                if not was_paused:
                    self.resume()
            spoken = sorted({str(r.get("protocol")) for r in results} - {str(PROTOCOL)})
            if spoken:
                # An older extension would undo an activated apply on the next abort.
                raise ConfigError(
                    f"vLLM's workers run another Bulletin's worker extension (protocol {', '.join(spoken)}; "
                    f"this sidecar speaks {PROTOCOL}): install the same Bulletin in vLLM's environment"
                )
            layouts = [RankLayout.from_json(r.get("layout")) for r in results]
            # Refuses (IncompatibleLayout, permanent) pieces that overlap or leave a
            # tensor uncovered across the ranks (pipeline stages included).
            plan = ReplicaPlan(layouts, specs)
            self._bound_specs = dict(specs)
            self.plan = plan
            self.dropped = plan.dropped
            self._rank_fps = None
            if self.dropped:
                log.info(
                    "%d served tensors are not engine parameters (kept in the folder only): %s",
                    len(self.dropped),
                    sorted(self.dropped)[:5],
                )
        return self.plan

    def _served(self, fps: Mapping[str, int]) -> dict[str, int]:
        return {n: fp for n, fp in fps.items() if n not in self.dropped}

    def _per_rank(self, plan: ReplicaPlan, fps: Sequence[Mapping[str, int]]) -> dict[str, dict[str, str]]:
        """One value per rank, keyed as workers look themselves up (``RankLayout.key``)."""
        return {layout.key: fps_to_json(f) for layout, f in zip(plan.layouts, fps, strict=True)}

    def _expected(self, plan: ReplicaPlan, fps: Mapping[str, int]) -> list[dict[str, int]]:
        """Each rank's partials of the folder's bits, which must sum to ``fps`` (the
        verified fingerprints of those bits): O(model), once per binding or load."""
        bits = self.local.context_bits()
        if bits is None:
            raise InvalidInput("nothing is held yet: load a keyframe first")
        expected = plan.expected(bits)
        if plan.combine(expected) != self._served(fps):
            raise VerificationFailed("the ranks' pieces of the folder do not sum to its fingerprints")
        return expected

    def _gather(self, plan: ReplicaPlan, results: Sequence[Mapping[str, Any]]) -> dict[str, int]:
        """The tensors' fingerprints from the workers' partials (one owner per replica
        set summed; the other members must equal it)."""
        by_key = {layout.key: i for i, layout in enumerate(plan.layouts)}
        partials: list[dict[str, int]] = [{} for _ in plan.layouts]
        for result in results:
            key = result.get("rank")
            if key not in by_key:
                raise EngineError(f"vLLM worker answered for rank {key!r}, not one of {sorted(by_key)}")
            for i, layout in enumerate(plan.layouts):
                if layout.key == key:
                    partials[i] = fps_from_json(result.get("fingerprints"))
        return plan.combine(partials)

    def _fingerprints(self, specs: Mapping[str, TensorSpec], expect: Mapping[str, int] | None) -> dict[str, int]:
        """The workers' fingerprints; every worker of every engine compares its partials
        with what ``expect`` makes of its pieces and a differing one answers with its own
        values (its replica set counted through it)."""
        plan = self._bind(specs)
        ranks: list[dict[str, int]] | None = None
        body: dict[str, Any] = {}
        if expect is not None:
            served = self._served(expect)
            held = self._rank_fps if self._engine_fps == served else None
            ranks = held if held is not None else self._expected(plan, served)
            body["expect"] = self._per_rank(plan, ranks)
        try:
            results = self.call("fingerprints", body)
        except FingerprintMismatch as exc:
            details = getattr(exc, "details", {})
            found, key = details.get("fingerprints"), details.get("rank")
            if expect is None or ranks is None or not isinstance(found, dict) or not isinstance(key, str):
                raise
            return {**self._served(expect), **plan.with_rank(ranks, key, fps_from_json(found))}
        return self._gather(plan, results)

    # -- WeightTarget ----------------------------------------------------------------------

    def layout(self) -> Mapping[str, TensorSpec] | None:
        return self.local.layout()

    def context_bits(self) -> Mapping[str, Bits] | None:
        # The folder holds what the engine serves: context-coded patches decode against it.
        return self.local.context_bits()

    def restored(self) -> Held | None:
        """The folder's verified version, if the engine demonstrably holds the same bits."""
        restored = self.local.restored()
        specs = self.local.layout()
        if restored is None or specs is None:
            return None
        try:
            engine = self._fingerprints(specs, restored.fingerprints)
        except EngineError:
            raise  # unreachable or broken engine: say so instead of reloading blindly
        except BulletinError:
            return None  # its parameters do not hold this layout: start from a keyframe
        if engine != self._served(restored.fingerprints):
            log.warning(
                "vLLM does not hold version %d of %s (started from another checkpoint?); loading a keyframe into it",
                restored.version,
                self.local.dir,
            )
            return None
        # Partials already known for these bits stay: the folder may hold a prepared
        # patch's bits by now (staged, not activated), not the version's.
        known = self._rank_fps is not None and self._engine_fps == engine
        self._engine_fps = engine
        self._version = restored.version
        plan = self.plan
        if not known:
            self._rank_fps = self._expected(plan, restored.fingerprints) if plan is not None else None
        return restored

    def load_full(self, tensors: Mapping[str, Bits], specs: Mapping[str, TensorSpec]) -> None:
        self.local.load_full(tensors, specs)
        self._engine_fps = self._rank_fps = None  # from here on the workers' bits are the load's, or a mix
        self._applied = None  # and nothing they wrote before can be undone
        plan = self._bind(specs)
        expected = {n: fingerprint(tensors[n]) for n in specs if n not in self.dropped}
        ranks = self._expected(plan, expected)
        self.pause()
        # Every worker reads its pieces of the keyframe back from its live parameters and
        # must hold exactly its partials; their sum must be the keyframe's fingerprints.
        results = self.call("load", {"path": str(self.local.staged_path), "expect": self._per_rank(plan, ranks)})
        if self._gather(plan, results) != expected:
            raise VerificationFailed("vLLM's workers did not load the keyframe bit for bit")
        self._engine_fps, self._rank_fps = expected, ranks

    def prepare(self, patch: Patch, fingerprints: Mapping[str, int]) -> None:
        """Everything an apply does but the engine's writes, while the engine still serves:
        the folder patched (journaled, not activated), the ranks' partials before and after
        computed and checked, the patch spooled, and every worker's part decoded, checked
        and precomputed (reads only). The sidecar's gate is not held meanwhile."""
        self._staged = None
        self._staged = self._stage(patch, fingerprints)

    def _stage(self, patch: Patch, fingerprints: Mapping[str, int]) -> _Staged:
        from patcher.encode import encode

        new = self.local.apply(patch, fingerprints)  # checks the base and the layout first
        stem = self.spool_dir / f"apply-{secrets.token_hex(8)}"
        try:
            plan = self._bind(patch.specs)
            bits = self.local.context_bits()
            if bits is None:
                raise VerificationFailed("the folder holds nothing after the apply")
            before = self._rank_fps if self._engine_fps == self._served(fingerprints) else None
            if before is None:  # not known (after a failure): from the folder, O(model)
                before = plan.advance(plan.expected(bits), patch, bits, undo=True)
            # Each rank's partials after the patch, from the folder's new bits (O(changed)):
            # they must sum to the new fingerprints before any worker is asked to land on them.
            after = plan.advance(before, patch, bits)
            expected = self._served(new)
            if plan.combine(after) != expected:
                raise VerificationFailed("the ranks' partials after the patch do not sum to its fingerprints")
            served = Patch({n: td for n, td in patch.tensors.items() if n not in self.dropped})
            shards = encode(served, max_shard_bytes=SPOOL_SHARD_BYTES, codec="lz4")
            stem.mkdir()
            paths = []
            for i, shard in enumerate(shards):
                path = stem / f"{i:05d}.bpatch"
                path.write_bytes(shard)
                paths.append(str(path.resolve()))
            token = secrets.token_hex(8)
            body = {
                "shards": paths,
                "fingerprints": self._per_rank(plan, before),
                "expect": self._per_rank(plan, after),
                "token": token,
                # The workers commit what they still hold undoable from the last apply:
                # its bits are this patch's base (labelled with the version activated).
                "held": self._version,
            }
            # Every worker (of every engine) decodes its part and refuses unless its bits
            # would land on its own partials; nothing is written yet.
            self.call("prepare", body)
        except BaseException:
            self._abort_engine()
            self.local.abort()
            raise
        finally:
            shutil.rmtree(stem, ignore_errors=True)  # the workers hold their parts now
        return _Staged(patch, dict(fingerprints), new, expected, after, token)

    def apply(self, patch: Patch, fingerprints: Mapping[str, int]) -> dict[str, int]:
        staged, self._staged = self._staged, None
        if staged is not None and (staged.patch is not patch or staged.base != dict(fingerprints)):
            self._abort_engine()  # prepared for another patch: start again from the held version
            self.local.abort()
            staged = None
        if staged is None:
            staged = self._stage(patch, fingerprints)
        try:
            self.pause()
            # The pause is the writes: every worker writes what it prepared and reads its
            # partials back; the first engine's are summed again here.
            self._applied = staged.token
            results = self.call("apply", {"prepared": True, "token": staged.token})
            if self.plan is None or self._gather(self.plan, results) != staged.expected:
                raise VerificationFailed("vLLM's workers landed on other bits than the local copy")
            self._engine_fps, self._rank_fps = staged.expected, staged.after
        except BaseException:
            self._abort_engine()
            self.local.abort()
            raise
        return staged.new

    def _abort_engine(self, *, relabel: str | None = None, resume: bool = True) -> None:
        """Undo what the workers may hold of the patch sent last and resume; ``relabel``:
        vLLM's weight version to put back first (one moved on for bits now undone);
        ``resume=False`` leaves the engine paused (a label that cannot be put back)."""
        # A worker that failed its apply has already restored its own bits; the others
        # undo the patch sent last, by its token (never one activated before it). What the
        # engine holds afterwards is checked by the caller (the sidecar verifies it).
        self._staged = None
        token, self._applied = self._applied, None
        with contextlib.suppress(BulletinError):
            self.call("abort", {"token": token})
        self._engine_fps = self._rank_fps = None
        if relabel is not None:
            try:
                self._set_label(relabel)
            except BulletinError as exc:
                # Paused, the engine serves nothing; resumed, it would label old bits new.
                log.error("vLLM stays paused: its weight version could not be put back to %s (%s)", relabel, exc)
                return
        if not resume:
            log.error("vLLM stays paused: its weight version label is not that of the bits it holds")
            return
        with contextlib.suppress(BulletinError):
            self.resume()

    def abort(self) -> None:
        self._abort_engine()
        self.local.abort()

    def full_fingerprints(self) -> dict[str, int]:
        # The workers' layout is the one loaded last, which the folder reports only once
        # it is activated. Tensors the engine drops are the folder's.
        specs = self._bound_specs if self._bound_specs is not None else self.local.layout()
        if specs is None:
            return {}
        held = self.local.restored()
        expect = self._engine_fps if self._engine_fps is not None else (held.fingerprints if held else None)
        return with_dropped(self._fingerprints(specs, expect), self.dropped, self.local.full_fingerprints)

    def activate(self, version: int, *, manifest_digest: str | None = None) -> None:
        """Still paused: reset the prefix and encoder caches (nothing computed with the old
        bits is reused) and set vLLM's weight version, the three calls at once, then resume.

        The workers are not called: each checked its own bits before answering its apply,
        and keeps that apply's undo data until the next request naming a base commits it
        (or an abort naming it undoes it), so the pause needs no commit round trip."""
        previous = self._label
        try:
            self._concurrently(
                self._reset_prefix_cache, self._reset_encoder_cache, lambda: self._set_label(str(version))
            )
            self.resume()
        except BaseException:
            # Workers and folder back on the version held before; the label too if it moved.
            moved = self._label != previous
            held = previous if previous is not None else None if self._version is None else str(self._version)
            self._abort_engine(relabel=held if moved else None, resume=not moved or held is not None)
            self.local.abort()
            raise
        self._applied, self._version = None, version
        self.local.activate(version, manifest_digest=manifest_digest)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.local.close()


def _message(body: Any) -> str:
    """The error text of a vLLM error body (``{"error": {"message"}}`` or ``{"detail"}``)."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if "detail" in body:
            return str(body["detail"])
    return repr(body)[:500]
