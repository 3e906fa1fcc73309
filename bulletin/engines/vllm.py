"""vLLM: patch the workers' parameters in place through a worker extension.

Written against vLLM's V1 engine (vllm-project/vllm ``vllm/v1/worker/worker_base.py``:
``--worker-extension-cls`` mixes a class into every worker, and ``collective_rpc``
calls a method by name on all of them; ``vllm/entrypoints/serve/rpc/api_router.py``:
with ``VLLM_SERVER_DEV_MODE=1`` the OpenAI server exposes ``POST /collective_rpc``
``{"method", "args", "kwargs", "timeout"}`` -> ``{"results": [one per worker]}``, with
string arguments only).

Start vLLM from the folder the sidecar keeps::

    VLLM_SERVER_DEV_MODE=1 vllm serve <local-dir>/current --dtype bfloat16 \\
        --worker-extension-cls bulletin.engines.vllm.BulletinWorkerExtension

:class:`VLLMTarget` (the sidecar side) applies each version to that folder first
(journaled, verified: it is what a restarted engine loads), then writes the patch in
Bulletin's own shard format to a spool folder on the same machine and calls
``bulletin_apply`` on every worker. Each worker decodes the shards and applies them
with :class:`~bulletin.engines.torch_module.TorchTarget` to zero-copy views of its own
parameters (:func:`~bulletin.engines.torch_module.packed_views` finds ``q_proj`` inside
``qkv_proj`` and so on): CUDA scatter kernels, O(changed elements), no reload, and the
CUDA graphs keep pointing at the same memory. Base fingerprints are checked on the
worker before anything is written, so a view in the wrong place is refused, never
applied. Tensor parallelism (sharded parameters) is refused at bind time.

Every worker method takes one JSON string and returns a JSON-able dict,
``{"ok": true, ...}`` or ``{"ok": false, "code": <bulletin error code>, "message": ...}``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np
from numpy.typing import NDArray

from bulletin import errors
from bulletin.engines.http import engine_url, request_json
from bulletin.engines.torch_module import TorchTarget, packed_views
from bulletin.errors import BulletinError, EngineError, FormatError, InvalidInput
from bulletin.target import Held, LocalDirTarget, WeightTarget
from patcher.fingerprint import format_fingerprint, parse_fingerprint
from patcher.patch import Patch, TensorSpec

if TYPE_CHECKING:
    import torch

__all__ = ["BulletinWorkerExtension", "VLLMTarget", "WorkerState"]

Bits = NDArray[np.unsignedinteger]
log = logging.getLogger("bulletin.engines.vllm")

#: Largest spool shard; the decoder's own limits apply on the worker.
SPOOL_SHARD_BYTES: Final = 64 << 20

_ERRORS: Final[dict[str, type[BulletinError]]] = {
    cls.code: cls for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, BulletinError)
}


def _specs_to_json(specs: Mapping[str, TensorSpec]) -> list[dict[str, Any]]:
    return [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in specs.values()]


def _specs_from_json(value: object) -> dict[str, TensorSpec]:
    if not isinstance(value, list):
        raise InvalidInput("specs must be a list")
    specs: dict[str, TensorSpec] = {}
    for item in value:
        if not isinstance(item, dict) or set(item) != {"name", "dtype", "shape"}:
            raise InvalidInput("each spec is {name, dtype, shape}")
        shape = item["shape"]
        if not isinstance(shape, list) or not all(type(d) is int for d in shape):
            raise InvalidInput(f"{item.get('name')!r}: shape must be a list of ints")
        spec = TensorSpec(item["name"], item["dtype"], tuple(shape))
        if spec.name in specs:
            raise InvalidInput(f"{spec.name!r} listed twice")
        specs[spec.name] = spec
    return specs


def _fps_to_json(fps: Mapping[str, int]) -> dict[str, str]:
    return {name: format_fingerprint(fp) for name, fp in fps.items()}


def _fps_from_json(value: object) -> dict[str, int]:
    if not isinstance(value, dict):
        raise InvalidInput("fingerprints must be an object")
    try:
        return {str(k): parse_fingerprint(v) for k, v in value.items()}
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"bad fingerprint: {exc}") from None


# -- worker side -------------------------------------------------------------------------


class WorkerState:
    """What one worker holds: its model's views as a TorchTarget. Engine-independent.

    ``model`` is the worker's ``nn.Module``. The extension below creates one per worker;
    tests drive it with any torch module laid out the way vLLM lays out its own.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.target: TorchTarget | None = None

    def bind(self, specs: Mapping[str, TensorSpec]) -> None:
        """Find every served tensor in the model's parameters and buffers (no copies)."""
        params: dict[str, torch.Tensor] = dict(self.model.named_parameters(remove_duplicate=False))
        params.update(dict(self.model.named_buffers(remove_duplicate=False)))
        packed = getattr(self.model, "packed_modules_mapping", None) or {}
        self.target = TorchTarget(packed_views(params, specs, packed))

    def _bound(self, specs: Mapping[str, TensorSpec] | None) -> TorchTarget:
        if specs is not None and (self.target is None or dict(self.target.layout()) != dict(specs)):
            self.bind(specs)
        if self.target is None:
            raise InvalidInput("the worker has not been bound to a layout yet")
        return self.target

    def handle(self, method: str, request: str) -> dict[str, Any]:
        """Run one request; errors come back as ``{"ok": false, ...}``, never raised."""
        try:
            body = json.loads(request) if request else {}
            if not isinstance(body, dict):
                raise InvalidInput("request must be a JSON object")
            result = self._dispatch(method, body)
        except BulletinError as exc:
            return {"ok": False, "code": exc.code, "message": str(exc)}
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return {"ok": False, "code": InvalidInput.code, "message": f"request is not JSON: {exc}"}
        return {"ok": True, **result}

    def _dispatch(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        specs = _specs_from_json(body["specs"]) if "specs" in body else None
        if method == "bind":
            self._bound(specs)
            return {}
        target = self._bound(specs)
        if method == "fingerprints":
            return {"fingerprints": _fps_to_json(target.full_fingerprints())}
        if method == "load":
            from bulletin.checkpoint import Checkpoint

            with Checkpoint(_path(body, "path")) as ckpt:
                tensors = {name: ckpt.bits(name) for name in ckpt.specs}
                target.load_full(tensors, ckpt.specs)
            return {}
        if method == "apply":
            from patcher.decode import decode

            shards = [Path(p).read_bytes() for p in _paths(body, "shards")]
            fps = target.apply(decode(shards), _fps_from_json(body.get("fingerprints")))
            return {"fingerprints": _fps_to_json(fps)}
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


def _path(body: Mapping[str, Any], key: str) -> Path:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"{key} must be a path")
    return Path(value)


def _paths(body: Mapping[str, Any], key: str) -> list[Path]:
    value = body.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise InvalidInput(f"{key} must be a non-empty list of paths")
    return [Path(v) for v in value]


class BulletinWorkerExtension:
    """Mixed into each vLLM worker by ``--worker-extension-cls``.

    vLLM refuses an extension whose attribute names clash with the worker's, so every
    name here starts with ``bulletin_``. Call through ``collective_rpc`` with one JSON
    string argument (see :class:`VLLMTarget`).
    """

    def bulletin_state(self) -> WorkerState:
        state: WorkerState | None = getattr(self, "_bulletin_worker_state", None)
        if state is None:
            get_model = getattr(self, "get_model", None)
            model = get_model() if callable(get_model) else self.model_runner.model  # type: ignore[attr-defined]
            state = WorkerState(model)
            self._bulletin_worker_state = state
        return state

    def bulletin_bind(self, request: str) -> dict[str, Any]:
        return self.bulletin_state().handle("bind", request)

    def bulletin_fingerprints(self, request: str) -> dict[str, Any]:
        return self.bulletin_state().handle("fingerprints", request)

    def bulletin_load(self, request: str) -> dict[str, Any]:
        return self.bulletin_state().handle("load", request)

    def bulletin_apply(self, request: str) -> dict[str, Any]:
        return self.bulletin_state().handle("apply", request)

    def bulletin_abort(self, request: str) -> dict[str, Any]:
        return self.bulletin_state().handle("abort", request)

    def bulletin_activate(self, request: str) -> dict[str, Any]:
        return self.bulletin_state().handle("activate", request)


# -- sidecar side ------------------------------------------------------------------------


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

    # -- RPC -------------------------------------------------------------------------------

    def call(self, method: str, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        """``collective_rpc("bulletin_<method>", [json])``; one result per worker, all ok."""
        endpoint = f"{self.url}/collective_rpc"
        payload = {"method": f"bulletin_{method}", "args": [json.dumps(body)], "timeout": self.timeout}
        status, answer = request_json("POST", endpoint, payload, timeout=self.timeout + 30.0)
        if status != 200 or not isinstance(answer, dict) or not isinstance(answer.get("results"), list):
            detail = answer.get("detail") if isinstance(answer, dict) else answer
            raise EngineError(
                f"vLLM collective_rpc {method} failed (HTTP {status}): {detail}; is the server "
                "started with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls "
                "bulletin.engines.vllm.BulletinWorkerExtension?"
            )
        results: list[dict[str, Any]] = []
        for i, result in enumerate(answer["results"]):
            if not isinstance(result, dict):
                raise EngineError(f"vLLM worker {i} answered {method} with {result!r}")
            if result.get("ok") is not True:
                cls = _ERRORS.get(str(result.get("code")), EngineError)
                raise cls(f"vLLM worker {i}: {result.get('message')}")
            results.append(result)
        if not results:
            raise EngineError(f"vLLM collective_rpc {method}: no worker answered")
        return results

    def _specs_body(self, specs: Mapping[str, TensorSpec]) -> dict[str, Any]:
        # Workers rebind only when the layout changes; send it only then.
        if self._bound_specs == dict(specs):
            return {}
        return {"specs": _specs_to_json(specs)}

    def _fingerprints(self, specs: Mapping[str, TensorSpec]) -> dict[str, int]:
        results = self.call("fingerprints", self._specs_body(specs))
        self._bound_specs = dict(specs)
        fps = [_fps_from_json(r.get("fingerprints")) for r in results]
        if any(f != fps[0] for f in fps[1:]):
            raise EngineError("vLLM workers hold different weights")
        return fps[0]

    # -- WeightTarget ----------------------------------------------------------------------

    def layout(self) -> Mapping[str, TensorSpec] | None:
        return self.local.layout()

    def restored(self) -> Held | None:
        """The folder's verified version, if the engine demonstrably holds the same bits."""
        restored = self.local.restored()
        specs = self.local.layout()
        if restored is None or specs is None:
            return None
        try:
            engine = self._fingerprints(specs)
        except EngineError:
            raise  # unreachable or broken engine: say so instead of reloading blindly
        except BulletinError:
            return None  # its parameters do not hold this layout: start from a keyframe
        if engine != restored.fingerprints:
            log.warning(
                "vLLM does not hold version %d of %s (started from another checkpoint?); loading a keyframe into it",
                restored.version,
                self.local.dir,
            )
            return None
        return restored

    def load_full(self, tensors: Mapping[str, Bits], specs: Mapping[str, TensorSpec]) -> None:
        self.local.load_full(tensors, specs)
        self.call("load", {**self._specs_body(specs), "path": str(self.local.staged_path)})
        self._bound_specs = dict(specs)

    def apply(self, patch: Patch, fingerprints: Mapping[str, int]) -> dict[str, int]:
        from patcher.encode import encode

        new = self.local.apply(patch, fingerprints)
        shards = encode(patch, max_shard_bytes=SPOOL_SHARD_BYTES, codec="lz4")
        stem = self.spool_dir / f"apply-{secrets.token_hex(8)}"
        stem.mkdir()
        try:
            paths = []
            for i, shard in enumerate(shards):
                path = stem / f"{i:05d}.bpatch"
                path.write_bytes(shard)
                paths.append(str(path.resolve()))
            body = {**self._specs_body(patch.specs), "shards": paths, "fingerprints": _fps_to_json(fingerprints)}
            results = self.call("apply", body)
            self._bound_specs = dict(patch.specs)
            for i, result in enumerate(results):
                if _fps_from_json(result.get("fingerprints")) != new:
                    raise FormatError(f"vLLM worker {i} landed on other bits than the local copy")
        except BaseException:
            self._abort_engine()
            self.local.abort()
            raise
        finally:
            shutil.rmtree(stem, ignore_errors=True)
        return new

    def _abort_engine(self) -> None:
        # A worker that failed its apply has already restored its own bits.
        with contextlib.suppress(BulletinError):
            self.call("abort", {})

    def abort(self) -> None:
        self._abort_engine()
        self.local.abort()

    def full_fingerprints(self) -> dict[str, int]:
        # The workers' layout is the one loaded last, which the folder reports only once
        # it is activated.
        specs = self._bound_specs if self._bound_specs is not None else self.local.layout()
        if specs is None:
            return {}
        return self._fingerprints(specs)

    def activate(self, version: int, *, manifest_digest: str | None = None) -> None:
        try:
            self.call("activate", {"version": version})
        except BaseException:
            self.abort()  # workers and folder back on the version the engine reported
            raise
        self.local.activate(version, manifest_digest=manifest_digest)

    def close(self) -> None:
        self.local.close()
