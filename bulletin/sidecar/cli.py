"""``bulletin serve``: run the sidecar in front of an engine.

Engines (``--engine``):

- ``local``: keep the run's current version in ``--local-dir`` (plain safetensors) and
  gate requests to ``--upstream``, an engine that reads that folder on its own;
- ``sglang``: as ``local``, and patch the SGLang server at ``--upstream`` in place on
  every TP rank through Bulletin's weight loader (``/update_weights_from_tensor``), or
  have it reload the folder (``/update_weights_from_disk``); ``--sglang-mode``;
- ``vllm``: as ``local``, and patch the vLLM server at ``--upstream`` in place through
  its worker extension (``/collective_rpc``);
- ``torch``: build the model of ``--model-config`` (an HF config) in this process,
  serve it with the built-in OpenAI-compatible server, and patch it in place; with
  ``--local-dir``, keep every version there too, which a restart restores the model from.

``--layout log`` keeps ``--local-dir`` as a base plus a log of patches (about a patch
written per version, compacted in the background; docs/FORMAT.md 9.1) for the engines
that hold the live bits themselves (``torch``, ``vllm``, ``sglang`` in place); those that
load versions from the folder (``local``, ``--sglang-mode disk``) refuse it at start.

The command only turns its flags into :class:`~bulletin.sidecar.compose.SidecarSettings`;
:func:`~bulletin.sidecar.compose.build_sidecar` does the wiring. See docs/ENGINES.md
for how to start each engine and docs/SIDECAR.md for the HTTP contract.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, Literal

import click

from bulletin.cli.options import stores_options, trust_options
from bulletin.cli.output import json_option
from bulletin.sidecar.compose import ENGINES, LAYOUTS

__all__ = ["serve"]


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


@click.command("serve")
@stores_options
@click.option("--engine", type=click.Choice(list(ENGINES)), default="local", show_default=True, help="Engine adapter.")
@click.option("--upstream", envvar="BULLETIN_UPSTREAM", help="Engine base URL (not with --engine torch).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the sidecar listens on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option(
    "--local-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder keeping the current version (local, sglang, vllm; torch: optional, what a restart restores).",
)
@click.option(
    "--layout",
    type=click.Choice(LAYOUTS),
    default="dense",
    show_default=True,
    help="How --local-dir keeps versions: dense (a loadable checkpoint rewritten per version) or log (a base "
    "plus a log of patches: about a patch written per version, compacted in the background; for torch, vllm "
    "and sglang in place, which hold the live bits). docs/FORMAT.md 9.1.",
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
@click.option(
    "--forward",
    "forward",
    multiple=True,
    metavar="PATH",
    help="A path relayed to the engine (repeatable; PATH/* allows every path below PATH). Replaces the "
    "default list: /v1/completions, /v1/chat/completions, /v1/models, /v1/models/*, /health. Nothing "
    "else, the engine's control endpoints first of all, is ever relayed.",
)
@click.option(
    "--verify-interval",
    type=click.FloatRange(min=0),
    default=3600.0,
    show_default=True,
    help="Seconds between full re-hashes of the served bits (also once at start); damaged bits are "
    "rebuilt from a keyframe. 0: never.",
)
@click.option(
    "--allow-reset",
    is_flag=True,
    help="Follow the run if it is rolled back or rewritten; without it such a run is refused and "
    "the version held keeps serving.",
)
@click.option(
    "--sglang-mode",
    type=click.Choice(["auto", "inplace", "disk"]),
    default="auto",
    show_default=True,
    help="How versions reach SGLang: patched in place on every TP rank through Bulletin's weight loader "
    "(inplace), reloaded from --local-dir (disk), or in place where the server runs the loader (auto).",
)
@click.option("--engine-timeout", type=click.FloatRange(min=1), default=600.0, show_default=True)
@click.option("--wait-for-engine", type=click.FloatRange(min=0), default=300.0, show_default=True)
@click.option("--model-config", type=click.Path(exists=True, path_type=Path), help="HF config (--engine torch).")
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="HF tokenizer folder: text prompts, stop strings and /v1/chat/completions (--engine torch).",
)
@click.option("--model-name", default="bulletin-model", show_default=True, help="Model id served (--engine torch).")
@click.option("--dtype", default="BF16", show_default=True, help="Served dtype of the run (--engine torch).")
@click.option("--device", default="cpu", show_default=True, help="Torch device (--engine torch).")
@click.option("--torch-threads", type=click.IntRange(min=1), help="torch.set_num_threads (--engine torch).")
@click.option("--engine-port", type=click.IntRange(0, 65535), default=0, help="Loopback port of the torch engine.")
@click.option("--json-logs", is_flag=True, help="Log one JSON object per line on stderr.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info")
@trust_options
@json_option  # errors at start-up as JSON on stdout, like every command's
def serve(
    store: tuple[str, ...],
    run: str,
    lag_grace: float,
    engine: str,
    upstream: str | None,
    host: str,
    port: int,
    local_dir: Path | None,
    layout: Literal["dense", "log"],
    poll_interval: float,
    default_wait: float,
    max_wait: float,
    drain_timeout: float,
    forward: tuple[str, ...],
    verify_interval: float,
    allow_reset: bool,
    sglang_mode: str,
    engine_timeout: float,
    wait_for_engine: float,
    model_config: Path | None,
    tokenizer: Path | None,
    model_name: str,
    dtype: str,
    device: str,
    torch_threads: int | None,
    engine_port: int,
    json_logs: bool,
    log_level: str,
    trusted_keys: tuple[Path, ...],
    max_head_age: float | None,
) -> None:
    """Serve an engine behind the version-aware sidecar, following RUN in STORE."""
    # The server stack (aiohttp) loads only here, so that other commands start without it.
    from bulletin.sidecar.app import DEFAULT_FORWARD, SidecarConfig
    from bulletin.sidecar.compose import SidecarSettings, TorchEngineSettings, build_sidecar

    _configure_logging(json_logs, log_level)
    config = SidecarConfig(
        default_wait=default_wait,
        max_wait=max_wait,
        poll_interval=poll_interval,
        drain_timeout=drain_timeout,
        verify_interval=verify_interval,
        forward=forward or DEFAULT_FORWARD,
    )
    torch = None
    if engine == "torch" and model_config is not None:
        torch = TorchEngineSettings(
            model_config=model_config,
            model_name=model_name,
            dtype=dtype,
            device=device,
            threads=torch_threads,
            port=engine_port,
            tokenizer=tokenizer,
        )
    settings = SidecarSettings(
        store=store,
        run=run,
        engine=engine,
        upstream=upstream,
        local_dir=local_dir,
        layout=layout,
        torch=torch,
        host=host,
        port=port,
        config=config,
        sglang_mode=sglang_mode,
        engine_timeout=engine_timeout,
        wait_for_engine=wait_for_engine,
        allow_reset=allow_reset,
        trusted_keys=trusted_keys,
        max_head_age=max_head_age,
        lag_grace=lag_grace,
    )
    build_sidecar(settings).run()
