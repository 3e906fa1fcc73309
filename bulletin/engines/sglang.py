"""SGLang: keep a verified copy on local disk and have the server reload it.

SGLang (checked against sgl-project/sglang 0.5.3, ``python/sglang/srt/entrypoints/
http_server.py``) reloads weights in place, without a restart, through::

    POST /update_weights_from_disk
    {"model_path": "<folder of safetensors>", "weight_version": "<label>",
     "abort_all_requests": false, "load_format": null}
    -> 200 {"success": true,  "message": "...", "num_paused_requests": 0}
    -> 400 {"success": false, "message": "..."}

and reports the label with ``GET /get_weight_version`` -> ``{"weight_version": ...}``.
The model's architecture and config stay those the server was started with; the folder
only has to hold the weights (Bulletin keyframes are plain safetensors plus an HF index).

:class:`SGLangTarget` wraps the :class:`~bulletin.target.LocalDirTarget` the server was
started from: patches are applied to the folder (journaled, verified), then
``activate`` asks SGLang to reload the folder *before* the folder's state file commits
the new version, so a refused reload leaves both the folder's committed state and the
engine on the previous version. The version number is passed as ``weight_version`` so
that SGLang itself reports which Bulletin version it serves.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from bulletin.engines.http import engine_url, request_json
from bulletin.errors import EngineError
from bulletin.target import Held, LocalDirTarget, WeightTarget
from patcher.patch import Patch, TensorSpec

__all__ = ["SGLangTarget"]

Bits = NDArray[np.unsignedinteger]


class SGLangTarget(WeightTarget):
    """A :class:`~bulletin.target.WeightTarget` for an SGLang server at ``url``.

    ``local`` is the folder SGLang was launched from (``--model-path <dir>/current``) or
    will reload from. ``timeout`` bounds one reload (large models take minutes);
    ``abort_all_requests`` is passed through (SGLang otherwise lets running requests
    finish before it swaps the weights).
    """

    #: The engine's weights change only at ``activate`` (the reload).
    in_place = False

    def __init__(
        self,
        local: LocalDirTarget,
        url: str,
        *,
        timeout: float = 600.0,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> None:
        self.local = local
        self.url = engine_url(url)
        self.timeout = timeout
        self.abort_all_requests = abort_all_requests
        self.load_format = load_format

    # -- delegated to the folder -----------------------------------------------------------

    def layout(self) -> Mapping[str, TensorSpec] | None:
        return self.local.layout()

    def restored(self) -> Held | None:
        return self.local.restored()

    def load_full(self, tensors: Mapping[str, Bits], specs: Mapping[str, TensorSpec]) -> None:
        self.local.load_full(tensors, specs)

    def apply(self, patch: Patch, fingerprints: Mapping[str, int]) -> dict[str, int]:
        return self.local.apply(patch, fingerprints)

    def full_fingerprints(self) -> dict[str, int]:
        return self.local.full_fingerprints()

    def abort(self) -> None:
        self.local.abort()

    def close(self) -> None:
        self.local.close()

    # -- the engine ------------------------------------------------------------------------

    def activate(self, version: int, *, manifest_digest: str | None = None) -> None:
        """Reload SGLang from the folder now holding ``version``, then commit the folder.

        If SGLang refuses, the folder is put back to the version it had committed, which
        is the one SGLang still serves.
        """
        try:
            self.reload(_staged_folder(self.local), version)
        except BaseException:
            self.local.abort()
            raise
        self.local.activate(version, manifest_digest=manifest_digest)

    def reload(self, folder: Path, version: int) -> None:
        """``POST /update_weights_from_disk`` with ``folder``; ``EngineError`` unless it succeeded."""
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

    def engine_version(self) -> str | None:
        """The ``weight_version`` SGLang reports (``GET /get_weight_version``)."""
        status, body = request_json("GET", f"{self.url}/get_weight_version", timeout=30.0)
        if status != 200 or not isinstance(body, dict):
            raise EngineError(f"GET {self.url}/get_weight_version answered HTTP {status}")
        value = body.get("weight_version")
        return None if value is None else str(value)

    def reconcile(self) -> None:
        """Make SGLang serve the folder's committed version if it reports another label.

        Run once at start-up: a server launched from an older copy, or restarted while
        the folder moved on, is brought to the version the folder holds verified.
        """
        restored = self.local.restored()
        model_path = self.local.model_path
        if restored is None or model_path is None:
            return
        if self.engine_version() != str(restored.version):
            self.reload(model_path.resolve(), restored.version)


def _staged_folder(local: LocalDirTarget) -> Path:
    """The folder holding what was loaded or applied but not yet activated."""
    return local.staged_path
