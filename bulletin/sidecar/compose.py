"""Building a sidecar from settings: engine adapter, gated target, subscriber, sidecar.

What ``bulletin serve`` does, as one library call:

>>> stack = build_sidecar(SidecarSettings(
...     store="s3://bucket/runs", run="grpo", engine="sglang",
...     upstream="http://127.0.0.1:30000", local_dir=Path("/var/lib/bulletin/grpo"),
... ))
>>> stack.run()  # serves until SIGINT or SIGTERM

:data:`ENGINES` maps each ``--engine`` name to a factory that builds its adapter;
each factory imports its engine's packages (torch, transformers, the adapters) only
when called, and this module imports nothing of aiohttp until :func:`build_sidecar`
runs, so the CLI can list the engines without loading the server stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

from bulletin.errors import BulletinError, ConfigError

if TYPE_CHECKING:
    from aiohttp import web

    from bulletin.replica_log import Layout
    from bulletin.sidecar.app import Sidecar, SidecarConfig
    from bulletin.target import LocalDirTarget, WeightTarget

__all__ = [
    "ENGINES",
    "LAYOUTS",
    "BuiltEngine",
    "EngineFactory",
    "SidecarSettings",
    "SidecarStack",
    "TorchEngineSettings",
    "build_sidecar",
]

log = logging.getLogger("bulletin.sidecar")

#: ``--layout`` choices: how the node's folder keeps versions (docs/FORMAT.md 9 and 9.1).
LAYOUTS: Final = ("dense", "log")
#: Why ``--layout log`` cannot serve an engine that reads the folder (FORMAT.md 9.1).
_LOG_LAYOUT_READERS = (
    "a log folder is a base plus a log of patches, and has a loadable DIR/current only after a "
    "compaction, so it cannot serve an engine that loads versions from the folder"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class TorchEngineSettings:
    """The in-process engine (``--engine torch``): an HF model served by the built-in server."""

    model_config: Path
    """Folder or file of the HF config the model is built from (random weights until the first version)."""
    model_name: str = "bulletin-model"
    """Model id the built-in server answers with."""
    dtype: str = "BF16"
    """Served dtype of the run (a safetensors dtype name)."""
    device: str = "cpu"
    """Torch device the model lives on."""
    threads: int | None = None
    """``torch.set_num_threads``; None leaves torch's default."""
    port: int = 0
    """Loopback port of the built-in server (0: any free port)."""
    tokenizer: Path | None = None
    """Folder of an HF tokenizer (``AutoTokenizer``): text prompts, ``stop`` strings and
    ``/v1/chat/completions`` with its chat template; None serves token ids only."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SidecarSettings:
    """Everything ``bulletin serve`` is told, typed; see docs/SIDECAR.md and docs/ENGINES.md."""

    store: str | tuple[str, ...]
    """Store URL (``s3://bucket/prefix``, a local directory, ``memory://name``), or several:
    copies of the run read in that order, a mirror first and the origin last
    (:mod:`bulletin.sources`)."""
    run: str
    """Run to follow."""
    engine: str = "local"
    """A key of :data:`ENGINES`."""
    upstream: str | None = None
    """Engine base URL (every engine but ``torch``, whose server this process runs)."""
    local_dir: Path | None = None
    """Folder keeping the current version (``local``, ``sglang``, ``vllm``; ``torch``
    optionally, as the durable copy a restart restores the model from)."""
    layout: Layout = "dense"
    """How ``local_dir`` keeps versions: ``dense`` (a loadable checkpoint rewritten per
    version) or ``log`` (a base plus a log of patches, about a patch written per version,
    compacted in the background). ``log`` needs an engine that holds the live bits and
    reads the folder only at a keyframe: ``torch``, ``vllm``, ``sglang`` in place."""
    torch: TorchEngineSettings | None = None
    """The in-process model (``torch`` only)."""
    host: str = "127.0.0.1"
    """Address the sidecar listens on."""
    port: int = 8000
    """Port the sidecar listens on (0: any free port)."""
    config: SidecarConfig | None = None
    """The sidecar's tunables (waits, polling, drain); None: :class:`SidecarConfig`'s defaults."""
    sglang_mode: str = "auto"
    """How versions reach SGLang (``bulletin.engines.sglang.MODES``): ``inplace``,
    ``disk``, or ``auto`` (in place where the server runs Bulletin's loader)."""
    engine_timeout: float = 600.0
    """Longest one engine call may take (SGLang's reload, a vLLM RPC), in seconds."""
    wait_for_engine: float = 300.0
    """How long to wait at start for the engine's ``/health`` (``sglang``, ``vllm``), in seconds."""
    allow_reset: bool = False
    """Follow the run if it is rolled back or rewritten (the engine may move to an older
    version or another chain); without it the sidecar keeps serving what it holds and
    reports ``run_rewound`` / ``chain_mismatch`` as its last error."""
    trusted_keys: tuple[Path, ...] = ()
    """Public key files whose signatures are accepted; with any, only signed heads and
    versions are taken (``bulletin.signing.load_trust``; docs/SECURITY.md)."""
    max_head_age: float | None = None
    """Seconds after which a signed head is refused as stale (needs ``trusted_keys``)."""
    lag_grace: float = 30.0
    """With several stores: seconds the first may lack a version a later one shows before
    the later one is read instead (:mod:`bulletin.sources`)."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"unknown engine {self.engine!r} (known: {', '.join(ENGINES)})")
        if self.engine == "torch":
            if self.torch is None or self.upstream is not None:
                raise ConfigError(
                    "--engine torch takes --model-config (and optionally --local-dir, its durable copy), "
                    "and neither --upstream nor BULLETIN_UPSTREAM: this process runs its engine"
                )
        elif self.upstream is None or self.local_dir is None:
            raise ConfigError(f"--engine {self.engine} needs --upstream and --local-dir")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"unknown layout {self.layout!r} (known: {', '.join(LAYOUTS)})")
        if self.layout == "log":
            if self.local_dir is None:
                raise ConfigError("--layout log is the layout of --local-dir: give one")
            if self.engine == "local":
                raise ConfigError(
                    f"--layout log cannot serve --engine local, which reads DIR/current: {_LOG_LAYOUT_READERS}"
                )
            if self.engine == "sglang" and self.sglang_mode == "disk":
                raise ConfigError(
                    f"--layout log cannot serve --sglang-mode disk, which reloads the folder: {_LOG_LAYOUT_READERS}"
                )
        if not self.store:
            raise ConfigError("the sidecar needs at least one store")
        if self.sglang_mode not in ("auto", "inplace", "disk"):
            raise ConfigError(f"unknown SGLang mode {self.sglang_mode!r} (known: auto, inplace, disk)")
        for name in ("engine_timeout", "wait_for_engine", "lag_grace"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be 0..65535, got {self.port}")


@dataclass(frozen=True, slots=True)
class BuiltEngine:
    """What an engine factory returns: the adapter and where the engine answers."""

    target: WeightTarget
    """The adapter the subscriber applies versions to (wrapped in a ``GatedTarget``)."""
    upstream: str
    """The engine's base URL, where requests are relayed."""
    in_place: bool | None = None
    """Overrides whether activating changes live weights (None: the target says)."""
    app: web.Application | None = None
    """An engine this process serves itself (``torch``), on ``listener``."""
    listener: socket.socket | None = None
    """The bound loopback socket ``app`` is served on."""
    on_preempt: Callable[[], None] | None = None
    """Ends generations still running when an activation stops waiting for them (``torch``)."""
    folder: LocalDirTarget | None = None
    """The node's folder (``--local-dir``) the adapter keeps versions in, if any."""


#: Builds one engine's adapter from the settings; may wait for the engine and call it.
EngineFactory = Callable[[SidecarSettings], BuiltEngine]


def _folder(settings: SidecarSettings) -> LocalDirTarget:
    """The node's folder, in the settings' layout."""
    from bulletin.replica_log import open_replica

    if settings.local_dir is None:  # pragma: no cover - SidecarSettings checks it
        raise ConfigError(f"--engine {settings.engine} needs --local-dir")
    return open_replica(settings.local_dir, run=settings.run, layout=settings.layout)


def _upstream(settings: SidecarSettings) -> str:
    if settings.upstream is None:  # pragma: no cover - SidecarSettings checks it
        raise ConfigError(f"--engine {settings.engine} needs --upstream")
    return settings.upstream


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


def _loopback_socket(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on 127.0.0.1:{port} for the torch engine: {exc}") from exc
    return sock


def _local_engine(settings: SidecarSettings) -> BuiltEngine:
    # A local folder changes nothing the engine serves until something reloads it.
    folder = _folder(settings)
    return BuiltEngine(folder, _upstream(settings), in_place=False, folder=folder)


def _sglang_engine(settings: SidecarSettings) -> BuiltEngine:
    from bulletin.engines.sglang import SGLangTarget, open_sglang

    local = _folder(settings)
    try:
        upstream = _upstream(settings)
        _wait_for_engine(upstream, settings.wait_for_engine)
        target = open_sglang(local, upstream, mode=settings.sglang_mode, timeout=settings.engine_timeout)
        if isinstance(target, SGLangTarget):
            if settings.layout == "log":
                raise ConfigError(
                    f"--layout log cannot serve this SGLang server from disk (--sglang-mode auto found no "
                    f"Bulletin loader on it: see docs/ENGINES.md): {_LOG_LAYOUT_READERS}"
                )
            target.reconcile()  # in place, the subscriber's restored() asks the ranks instead
    except BaseException:
        local.close()
        raise
    return BuiltEngine(target, upstream, folder=local)


def _vllm_engine(settings: SidecarSettings) -> BuiltEngine:
    from bulletin.engines.vllm import VLLMTarget

    local = _folder(settings)
    try:
        upstream = _upstream(settings)
        _wait_for_engine(upstream, settings.wait_for_engine)
        target = VLLMTarget(local, upstream, timeout=settings.engine_timeout)
    except BaseException:
        local.close()
        raise
    return BuiltEngine(target, upstream, folder=local)


def _torch_engine(settings: SidecarSettings) -> BuiltEngine:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bulletin.engines.hf_server import CompletionServer
    from bulletin.engines.torch_module import TorchTarget, torch_dtype

    spec = settings.torch
    if spec is None:  # pragma: no cover - SidecarSettings checks it
        raise ConfigError("--engine torch takes --model-config")
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    config = AutoConfig.from_pretrained(str(spec.model_config))
    # Random weights until the first keyframe lands; requests wait for a verified version.
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model = model.to(device=spec.device, dtype=torch_dtype(spec.dtype)).eval()
    tokenizer = None
    if spec.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(spec.tokenizer))
    server = CompletionServer(model, tokenizer=tokenizer, model_name=spec.model_name)
    live = TorchTarget.from_module(model)
    folder: LocalDirTarget | None = None
    target: WeightTarget = live
    if settings.local_dir is not None:  # the durable copy a restart restores the model from
        from bulletin.sidecar.folder_backed import FolderBackedTarget

        folder = _folder(settings)
        target = FolderBackedTarget(live, folder)
    try:
        sock = _loopback_socket(spec.port)
    except BaseException:
        if folder is not None:
            folder.close()
        raise
    upstream = f"http://127.0.0.1:{sock.getsockname()[1]}"
    return BuiltEngine(
        target, upstream, app=server.create_app(), listener=sock, on_preempt=server.preempt, folder=folder
    )


#: ``--engine`` name -> factory; read-only, in the order ``--help`` lists them.
ENGINES: Final[Mapping[str, EngineFactory]] = MappingProxyType(
    {"local": _local_engine, "torch": _torch_engine, "sglang": _sglang_engine, "vllm": _vllm_engine}
)


@dataclass(frozen=True, slots=True)
class SidecarStack:
    """A built sidecar and the engine it fronts, ready to serve."""

    sidecar: Sidecar
    engine: BuiltEngine
    host: str
    port: int

    def run(self) -> None:
        """Serve until SIGINT or SIGTERM (from the main thread)."""
        asyncio.run(self.serve())

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        """Serve until ``stop`` is set; without one, until SIGINT or SIGTERM."""
        from aiohttp import web

        if stop is None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
        runners: list[web.AppRunner] = []
        try:
            if self.engine.app is not None and self.engine.listener is not None:
                engine_runner = web.AppRunner(self.engine.app, access_log=None)
                await engine_runner.setup()
                runners.append(engine_runner)
                await web.SockSite(engine_runner, self.engine.listener).start()
            runner = web.AppRunner(self.sidecar.create_app(), access_log=None)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, self.host, self.port).start()
            bound = runner.addresses[0] if runner.addresses else (self.host, self.port)
            log.info(
                "sidecar listening on http://%s:%s in front of %s (engine %s, run %s)",
                bound[0],
                bound[1],
                self.sidecar.upstream,
                self.sidecar.engine,
                self.sidecar.run,
            )
            await stop.wait()
            log.info("stopping")
        finally:
            for each in reversed(runners):
                await each.cleanup()


def build_sidecar(settings: SidecarSettings) -> SidecarStack:
    """Build the engine adapter, the gated target, the subscriber and the sidecar.

    Engines that run elsewhere (``sglang``, ``vllm``) are waited for and contacted
    here; nothing listens until :meth:`SidecarStack.serve`.
    """
    from bulletin.replica_log import LogDirTarget
    from bulletin.sidecar.app import Sidecar
    from bulletin.sidecar.metrics import SidecarMetrics
    from bulletin.sidecar.worker import GatedTarget
    from bulletin.signing import load_trust
    from bulletin.subscriber import Subscriber

    trust = load_trust(settings.trusted_keys, settings.max_head_age)  # a bad key fails before the engine starts
    metrics = SidecarMetrics()
    engine = ENGINES[settings.engine](settings)
    try:
        if isinstance(engine.folder, LogDirTarget):
            engine.folder.on_written = metrics.count_replica_write
            _restore_from_folder(engine)
        target = GatedTarget(engine.target, metrics, in_place=engine.in_place, on_preempt=engine.on_preempt)
        subscriber = Subscriber(
            settings.store,
            settings.run,
            target=target,
            on_bytes=metrics.bytes_downloaded.inc,
            allow_reset=settings.allow_reset,
            trust=trust,
            lag_grace=settings.lag_grace,
        )
        try:
            sidecar = Sidecar(
                subscriber,
                engine.upstream,
                config=settings.config,
                target=target,
                metrics=metrics,
                engine=settings.engine,
                run=settings.run,
            )
        except BaseException:
            subscriber.close()
            raise
    except BaseException:
        if engine.listener is not None:
            engine.listener.close()
        with contextlib.suppress(Exception):
            engine.target.close()  # the folder's lock too (idempotent, if the subscriber closed it)
        raise
    return SidecarStack(sidecar, engine, settings.host, settings.port)


def _restore_from_folder(engine: BuiltEngine) -> None:
    """Load a log folder's verified version into an engine that does not hold it (one
    restarted: a log folder has no DIR/current to start it from), from the folder, before
    the subscriber asks the engine what it holds: a new base is written (O(model)), nothing
    is downloaded. An engine that cannot take it is left to a keyframe route."""
    folder = engine.folder
    held = folder.restored() if folder is not None else None
    if folder is None or held is None or engine.target.restored() is not None:
        return
    specs, bits = folder.layout(), folder.context_bits()
    if specs is None or bits is None:  # pragma: no cover - a verified folder holds both
        return
    log.info("the engine does not hold version %d of %s: loading it from the folder", held.version, folder.dir)
    try:
        engine.target.load_full(bits, specs)
        engine.target.activate(held.version, manifest_digest=held.manifest_digest)
    except BulletinError as exc:
        with contextlib.suppress(BulletinError):
            engine.target.abort()
        log.warning(
            "version %d could not be loaded from %s (%s); a keyframe route loads it", held.version, folder.dir, exc
        )
