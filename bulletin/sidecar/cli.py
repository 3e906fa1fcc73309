"""``bulletin serve``: run the sidecar in front of an engine.

Engines (``--engine``):

- ``local``: keep the run's current version in ``--local-dir`` (plain safetensors) and
  gate requests to ``--upstream``, an engine that reads that folder on its own;
- ``sglang``: as ``local``, and make the SGLang server at ``--upstream`` reload the
  folder (``/update_weights_from_disk``) at each new version;
- ``vllm``: as ``local``, and patch the vLLM server at ``--upstream`` in place through
  its worker extension (``/collective_rpc``);
- ``torch``: build the model of ``--model-config`` (an HF config) in this process,
  serve it with the built-in OpenAI-compatible server, and patch it in place.

See docs/ENGINES.md for how to start each engine and docs/SIDECAR.md for the HTTP
contract.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import click
from aiohttp import web

from bulletin.errors import ConfigError
from bulletin.sidecar.app import Sidecar, SidecarConfig
from bulletin.sidecar.metrics import SidecarMetrics
from bulletin.sidecar.worker import GatedTarget

__all__ = ["serve"]

log = logging.getLogger("bulletin.sidecar")

ENGINES = ("local", "torch", "sglang", "vllm")


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message (and the traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _configure_logging(json_logs: bool, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _JsonFormatter() if json_logs else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _loopback_socket(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    return sock


def _build_torch_engine(
    model_config: Path, dtype: str, device: str, model_name: str, threads: int | None
) -> tuple[Any, web.Application]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bulletin.engines.hf_server import CompletionServer
    from bulletin.engines.torch_module import TorchTarget, torch_dtype

    if threads is not None:
        torch.set_num_threads(threads)
    config = AutoConfig.from_pretrained(str(model_config))
    # Random weights until the first keyframe lands; requests wait for a verified version.
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model = model.to(device=device, dtype=torch_dtype(dtype)).eval()
    return TorchTarget.from_module(model), CompletionServer(model, model_name=model_name).create_app()


def _wait_for_engine(url: str, timeout: float) -> None:
    """Engines load for a while after their process starts; the adapters need them up."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=5.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise ConfigError(f"the engine at {url} did not answer /health within {timeout:.0f} s")
        time.sleep(1.0)


@click.command("serve")
@click.option("--store", envvar="BULLETIN_STORE", required=True, help="Store URL (default: $BULLETIN_STORE).")
@click.option("--run", "run", envvar="BULLETIN_RUN", required=True, help="Run to follow.")
@click.option("--engine", type=click.Choice(ENGINES), default="local", show_default=True, help="Engine adapter.")
@click.option("--upstream", envvar="BULLETIN_UPSTREAM", help="Engine base URL (not with --engine torch).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the sidecar listens on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option(
    "--local-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder keeping the current version (local, sglang, vllm).",
)
@click.option("--poll-interval", type=click.FloatRange(min=0.001), default=1.0, show_default=True)
@click.option(
    "--default-wait",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    help="Seconds a request may wait for its version when it names no budget.",
)
@click.option(
    "--max-wait",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="Cap, in seconds, on any request's wait for its version.",
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="Seconds an activation waits for requests in flight before it goes ahead.",
)
@click.option("--engine-timeout", type=click.FloatRange(min=1), default=600.0, show_default=True)
@click.option("--wait-for-engine", type=click.FloatRange(min=0), default=300.0, show_default=True)
@click.option("--model-config", type=click.Path(exists=True, path_type=Path), help="HF config (--engine torch).")
@click.option("--model-name", default="bulletin-model", show_default=True, help="Model id served (--engine torch).")
@click.option("--dtype", default="BF16", show_default=True, help="Served dtype of the run (--engine torch).")
@click.option("--device", default="cpu", show_default=True, help="Torch device (--engine torch).")
@click.option("--torch-threads", type=click.IntRange(min=1), help="torch.set_num_threads (--engine torch).")
@click.option("--engine-port", type=click.IntRange(0, 65535), default=0, help="Loopback port of the torch engine.")
@click.option("--json-logs", is_flag=True, help="Log one JSON object per line on stderr.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info")
def serve(
    store: str,
    run: str,
    engine: str,
    upstream: str | None,
    host: str,
    port: int,
    local_dir: Path | None,
    poll_interval: float,
    default_wait: float,
    max_wait: float,
    drain_timeout: float,
    engine_timeout: float,
    wait_for_engine: float,
    model_config: Path | None,
    model_name: str,
    dtype: str,
    device: str,
    torch_threads: int | None,
    engine_port: int,
    json_logs: bool,
    log_level: str,
) -> None:
    """Serve an engine behind the version-aware sidecar, following RUN in STORE."""
    from bulletin.subscriber import Subscriber
    from bulletin.target import LocalDirTarget

    _configure_logging(json_logs, log_level)
    config = SidecarConfig(
        default_wait=default_wait,
        max_wait=max_wait,
        poll_interval=poll_interval,
        drain_timeout=drain_timeout,
    )
    metrics = SidecarMetrics()
    engine_app: web.Application | None = None
    engine_sock: socket.socket | None = None
    if engine == "torch":
        if model_config is None or upstream is not None or local_dir is not None:
            raise ConfigError("--engine torch takes --model-config, and neither --upstream nor --local-dir")
        inner, engine_app = _build_torch_engine(model_config, dtype, device, model_name, torch_threads)
        engine_sock = _loopback_socket(engine_port)
        upstream = f"http://127.0.0.1:{engine_sock.getsockname()[1]}"
    else:
        if upstream is None or local_dir is None:
            raise ConfigError(f"--engine {engine} needs --upstream and --local-dir")
        local = LocalDirTarget(local_dir, run=run)
        if engine == "local":
            inner = local
        elif engine == "sglang":
            from bulletin.engines.sglang import SGLangTarget

            _wait_for_engine(upstream, wait_for_engine)
            inner = SGLangTarget(local, upstream, timeout=engine_timeout)
            inner.reconcile()
        else:
            from bulletin.engines.vllm import VLLMTarget

            _wait_for_engine(upstream, wait_for_engine)
            inner = VLLMTarget(local, upstream, timeout=engine_timeout)
    # A local folder changes nothing the engine serves until something reloads it.
    target = GatedTarget(inner, metrics, in_place=False if engine == "local" else None)
    subscriber = Subscriber(store, run, target=target, on_bytes=metrics.bytes_downloaded.inc)
    sidecar = Sidecar(subscriber, upstream, config=config, target=target, metrics=metrics, engine=engine, run=run)
    asyncio.run(_serve(sidecar, host, port, engine_app, engine_sock))


async def _serve(
    sidecar: Sidecar,
    host: str,
    port: int,
    engine_app: web.Application | None,
    engine_sock: socket.socket | None,
) -> None:
    runners: list[web.AppRunner] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        if engine_app is not None and engine_sock is not None:
            engine_runner = web.AppRunner(engine_app, access_log=None)
            await engine_runner.setup()
            runners.append(engine_runner)
            await web.SockSite(engine_runner, engine_sock).start()
        runner = web.AppRunner(sidecar.create_app(), access_log=None)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0] if runner.addresses else (host, port)
        log.info(
            "sidecar listening on http://%s:%s in front of %s (engine %s, run %s)",
            bound[0],
            bound[1],
            sidecar.upstream,
            sidecar.engine,
            sidecar.run,
        )
        await stop.wait()
        log.info("stopping")
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
