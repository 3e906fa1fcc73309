"""Loopback HTTP servers that implement engines' control contracts, for adapter tests.

They are real servers speaking real HTTP; what they do behind each endpoint is what
the engine's source does, reduced to the part the adapter depends on:

- :class:`VllmServer`: vLLM's ``POST /collective_rpc`` (dev mode) dispatching to
  worker objects that have ``BulletinWorkerExtension`` mixed in, as vLLM's
  ``WorkerWrapperBase`` does, and ``GET /health``;
- :class:`SglangServer`: SGLang's ``POST /update_weights_from_disk`` (loads the
  safetensors folder at ``model_path`` into a torch module by name, answers
  ``{"success", "message", "num_paused_requests"}`` with 200 or 400),
  ``GET /get_weight_version`` and ``GET /health``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from bulletin.engines.vllm import BulletinWorkerExtension


class _Server:
    def __init__(self, routes: dict[tuple[str, str], Callable[[Any], tuple[int, Any]]]) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                route = routes.get((method, self.path))
                if route is None:
                    status, body = 404, {"detail": "Not Found"}
                else:
                    status, body = route(json.loads(raw) if raw else None)
                outer.calls.append((method, self.path))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
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
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


class FakeVllmWorker:
    """Stands for vLLM's GPU worker class: it only has to offer ``get_model``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def get_model(self) -> torch.nn.Module:
        return self.model


def extended_worker(model: torch.nn.Module) -> Any:
    """A worker with the extension mixed in, as ``--worker-extension-cls`` does it."""
    cls = type("Worker", (FakeVllmWorker, BulletinWorkerExtension), {})
    return cls(model)


class VllmServer(_Server):
    def __init__(self, workers: list[Any], *, dev_mode: bool = True) -> None:
        self.workers = workers

        def rpc(body: Any) -> tuple[int, Any]:
            method = body.get("method")
            if method is None:
                return 400, {"detail": "Missing 'method' in request body"}
            args, kwargs = body.get("args", []), body.get("kwargs", {})
            results = [getattr(w, method)(*args, **kwargs) for w in self.workers]
            return 200, {"results": results}

        routes: dict[tuple[str, str], Callable[[Any], tuple[int, Any]]] = {("GET", "/health"): lambda _: (200, {})}
        if dev_mode:
            routes[("POST", "/collective_rpc")] = rpc
        super().__init__(routes)


class SglangServer(_Server):
    def __init__(self, model: torch.nn.Module, *, refuse: bool = False) -> None:
        self.model = model
        self.weight_version: str | None = None
        self.loaded_from: list[str] = []
        self.refuse = refuse

        def update(body: Any) -> tuple[int, Any]:
            if self.refuse:
                return 400, {"success": False, "message": "Failed to update weights: out of memory"}
            folder = Path(body["model_path"])
            tensors: dict[str, torch.Tensor] = {}
            for file in sorted(folder.glob("*.safetensors")):
                tensors.update(load_file(str(file)))
            params = self.model.state_dict()
            with torch.no_grad():
                for name, value in tensors.items():
                    params[name].copy_(value)
            self.loaded_from.append(str(folder))
            if body.get("weight_version") is not None:
                self.weight_version = body["weight_version"]
            return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

        super().__init__(
            {
                ("POST", "/update_weights_from_disk"): update,
                ("GET", "/get_weight_version"): lambda _: (200, {"weight_version": self.weight_version}),
                ("GET", "/health"): lambda _: (200, {}),
            }
        )
