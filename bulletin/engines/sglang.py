"""SGLang: keep a verified copy on local disk and have the server reload it.

Written against SGLang 0.5.23 (sgl-project/sglang, ``python/sglang/srt/``; docs/ENGINES.md
cites each file). The server reloads weights in place, without a restart, through::

    POST /update_weights_from_disk
    {"model_path": "<folder of safetensors>", "weight_version": "<label>",
     "abort_all_requests": true, "load_format": null}
    -> 200 {"success": true,  "message": "...", "num_paused_requests": 0}
    -> 400 {"success": false, "message": "..."}

and reports the label in ``GET /model_info`` (``weight_version``; older servers:
``GET /get_weight_version``). The model's architecture and config stay those the server
was started with; the folder only has to hold the weights (Bulletin keyframes are plain
safetensors plus an HF index).

A refused reload does not mean the server still holds the old weights: SGLang sets the
new folder as its model path *before* loading, loads tensor by tensor into the live
parameters, and on an exception "rolls back" by loading that same new folder again
(``model_runner_components/weight_updater.py``); with several data-parallel engines some
may have loaded and others not; and a reload whose cache flush is refused answers
``success: false`` with the new weights in place (``scheduler_components/
weight_updater.py``). So after any failed reload :class:`SGLangTarget` puts the folder
back, reloads the committed version into the server and checks it (success, its radix
cache flushed, and SGLang's own per-rank weight checksums, ``/weights_checker``, equal to
those recorded when that version was last loaded and equal across data-parallel ranks).
If that fails too, the engine's bits are unknown: :meth:`SGLangTarget.full_fingerprints`
answers with no fingerprints until a version is loaded again, so the sidecar's
verification withdraws the version and rebuilds it from a keyframe.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from bulletin.engines.http import engine_url, request_json
from bulletin.errors import BulletinError, EngineError
from bulletin.target import Held, LocalDirTarget, WeightTarget
from patcher.patch import Patch, TensorSpec

__all__ = ["SGLangTarget"]

Bits = NDArray[np.unsignedinteger]
log = logging.getLogger("bulletin.engines.sglang")


class SGLangTarget(WeightTarget):
    """A :class:`~bulletin.target.WeightTarget` for an SGLang server at ``url``.

    ``local`` is the folder SGLang was launched from (``--model-path <dir>/current``) or
    will reload from. ``timeout`` bounds one reload (large models take minutes).
    ``abort_all_requests`` (default True) is passed to every reload: the sidecar has
    already drained its requests for up to its drain timeout, so this only ends those
    that outlived it, with SGLang's ``abort`` finish reason, instead of letting them
    run on across the weight change.
    """

    #: The engine's weights change only at ``activate`` (the reload).
    in_place = False

    def __init__(
        self,
        local: LocalDirTarget,
        url: str,
        *,
        timeout: float = 600.0,
        abort_all_requests: bool = True,
        load_format: str | None = None,
    ) -> None:
        self.local = local
        self.url = engine_url(url)
        self.timeout = timeout
        self.abort_all_requests = abort_all_requests
        self.load_format = load_format
        #: SGLang's checksum of the weights it loaded for the committed version (None:
        #: not recorded yet, or the server has no ``/weights_checker``).
        self.engine_checksum: str | None = None
        #: Why the engine's bits are unknown (a failed reload that could not be undone).
        self.lost: str | None = None

    # -- delegated to the folder -----------------------------------------------------------

    def layout(self) -> Mapping[str, TensorSpec] | None:
        return self.local.layout()

    def restored(self) -> Held | None:
        return self.local.restored()

    def load_full(self, tensors: Mapping[str, Bits], specs: Mapping[str, TensorSpec]) -> None:
        self.local.load_full(tensors, specs)

    def apply(self, patch: Patch, fingerprints: Mapping[str, int]) -> dict[str, int]:
        return self.local.apply(patch, fingerprints)

    def context_bits(self) -> Mapping[str, Bits] | None:
        # The folder holds what the engine serves: context-coded patches decode against it.
        return self.local.context_bits()

    def full_fingerprints(self) -> dict[str, int]:
        """The folder's bits, which the engine loaded, unless a failed reload left the
        engine's bits unknown: then none, so that a verification finds every tensor
        damaged and rebuilds the version from a keyframe."""
        if self.lost is not None:
            log.warning("SGLang's weights are unknown (%s); reporting no fingerprints", self.lost)
            return {}
        return self.local.full_fingerprints()

    def abort(self) -> None:
        self.local.abort()

    def close(self) -> None:
        self.local.close()

    # -- the engine ------------------------------------------------------------------------

    def activate(self, version: int, *, manifest_digest: str | None = None) -> None:
        """Reload SGLang from the folder now holding ``version``, then commit the folder.

        If the reload fails, the folder is put back to its committed version and that
        version is reloaded into SGLang and checked (see the module docstring).
        """
        try:
            self.reload(self.local.staged_path, version)
            checksum = self.checksum()
        except BaseException as exc:
            self.local.abort()
            self._restore(exc)
            raise
        self.local.activate(version, manifest_digest=manifest_digest)
        self.engine_checksum = checksum
        self.lost = None

    def _restore(self, cause: BaseException) -> None:
        """After a failed reload: the committed version back into SGLang, checked."""
        held = self.local.restored()
        model_path = self.local.model_path
        if held is None or model_path is None:
            self.lost = f"a reload failed and no version is committed to restore ({cause})"
            return
        try:
            self.reload(model_path.resolve(), held.version)
            checksum = self.checksum()
            if None not in (checksum, self.engine_checksum) and checksum != self.engine_checksum:
                raise EngineError(
                    f"SGLang reloaded version {held.version} with weight checksum {checksum}, "
                    f"not {self.engine_checksum} as before"
                )
        except BulletinError as exc:
            self.lost = f"a reload failed ({cause}) and reloading version {held.version} failed too ({exc})"
            log.error("%s", self.lost)
            return
        log.warning("SGLang is back on version %d after a failed reload: %s", held.version, cause)

    def reload(self, folder: Path, version: int) -> None:
        """``POST /update_weights_from_disk`` with ``folder``, then ``/flush_cache``;
        ``EngineError`` unless both succeeded."""
        payload: dict[str, Any] = {
            "model_path": str(folder),
            "weight_version": str(version),
            "abort_all_requests": self.abort_all_requests,
        }
        if self.load_format is not None:
            payload["load_format"] = self.load_format
        endpoint = f"{self.url}/update_weights_from_disk"
        status, body = request_json("POST", endpoint, payload, timeout=self.timeout)
        success = isinstance(body, dict) and body.get("success") is True
        if status != 200 or not success:
            message = body.get("message") if isinstance(body, dict) else body
            raise EngineError(f"SGLang refused to load version {version} from {folder} (HTTP {status}): {message}")
        # SGLang >= 0.5.5 flushes the radix cache inside the reload (and fails the reload
        # when it cannot); older servers do not: flush explicitly either way, so that no
        # KV computed with the old weights is reused.
        status, body = request_json("POST", f"{self.url}/flush_cache", timeout=min(self.timeout, 60.0), text=True)
        if status != 200:
            raise EngineError(f"SGLang loaded version {version} but did not flush its radix cache: {body!r:.200}")

    def checksum(self) -> str | None:
        """SGLang's own checksum of the weights it holds (``/weights_checker``), after
        checking that every data-parallel copy of each rank holds the same; None where the
        server has no such endpoint."""
        status, body = request_json(
            "POST", f"{self.url}/weights_checker", {"action": "checksum"}, timeout=min(self.timeout, 300.0)
        )
        if status == 404:
            return None
        if status != 200 or not isinstance(body, dict) or body.get("success") is not True:
            raise EngineError(f"SGLang /weights_checker failed (HTTP {status}): {body!r:.200}")
        per_rank: dict[tuple[Any, ...], set[str]] = {}
        for rank in body.get("ranks") or []:
            info = rank.get("parallelism_info", {}) if isinstance(rank, dict) else {}
            key = (info.get("role"), info.get("tp_rank"), info.get("pp_rank"))
            per_rank.setdefault(key, set()).add(str(rank.get("per_gpu_checksum")))
        split = [key for key, sums in per_rank.items() if len(sums) > 1]
        if split:
            raise EngineError(f"SGLang's data-parallel engines hold different weights (ranks {split[:3]})")
        value = body.get("per_engine_checksum")
        return None if value is None else str(value)

    def engine_version(self) -> str | None:
        """The ``weight_version`` SGLang reports (``GET /model_info``; ``GET
        /get_weight_version`` on servers before it)."""
        status, body = request_json("GET", f"{self.url}/model_info", timeout=30.0)
        if status == 404:
            status, body = request_json("GET", f"{self.url}/get_weight_version", timeout=30.0)
        if status != 200 or not isinstance(body, dict):
            raise EngineError(f"SGLang did not report its weight version (HTTP {status})")
        value = body.get("weight_version")
        return None if value is None else str(value)

    def reconcile(self) -> None:
        """Make SGLang serve the folder's committed version if it reports another label.

        Run once at start-up: a server launched from an older copy, or restarted while
        the folder moved on, is brought to the version the folder holds verified; the
        server's weight checksum is recorded either way.
        """
        restored = self.local.restored()
        model_path = self.local.model_path
        if restored is None or model_path is None:
            return
        if self.engine_version() != str(restored.version):
            self.reload(model_path.resolve(), restored.version)
        self.engine_checksum = self.checksum()
