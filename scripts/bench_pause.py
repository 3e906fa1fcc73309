#!/usr/bin/env python
"""Activation pause per version, next to a full reload measured in the same run.

    .venv/bin/python scripts/bench_pause.py                    # tiny + small presets, CPU (+ GPU if present)
    .venv/bin/python scripts/bench_pause.py --preset small     # one preset
    .venv/bin/python scripts/bench_pause.py --json out.json    # also write the results as JSON
    .venv/bin/python scripts/bench_pause.py --tp 1,2,4         # only the TP engines (vLLM's layers, CPU ranks)

A Llama-style causal LM (``transformers``, random init, seed 0; nothing downloaded) is
trained with AdamW on FP32 masters; each step is published as BF16 with
:class:`~bulletin.publisher.Publisher` to a local store. A rollout model in BF16 follows
it through the sidecar's own machinery: a :class:`~bulletin.subscriber.Subscriber`
applying versions to a :class:`~bulletin.engines.torch_module.TorchTarget` wrapped in the
:class:`~bulletin.sidecar.GatedTarget`, whose activation gate lives on an event loop
exactly as in ``bulletin serve``. The *pause* of a version is the time that gate was
held exclusively, i.e. the time new requests were held back: in-place apply,
fingerprint verification and activation. It is read from the sidecar's own metric
(``bulletin_activation_pause_seconds``).

The baseline is a *full reload*: ``model.load_state_dict`` of the whole BF16 state dict
of the same version, already in host memory (no disk, no network: the cheapest full
reload there is), timed on the same model in the same run, best of three. On a GPU the
state dict is copied from host memory, as an engine loading a checkpoint does.

Each version's pause, changed elements and nanoseconds per changed element are
printed, then the median pause, the median full reload and their ratio per device. The
GPU path runs only where torch sees a CUDA device and CuPy is installed; elsewhere it
is skipped with a line saying so (the GPU half of the checks is ``scripts/gpu_checks.sh``).

Tensor parallelism (``--tp 1,2,4``; by default whenever the vLLM source kit of
``scripts/vllm_source.py`` is present, with a line saying so when it is not): for each
TP size, one engine of that many CPU rank processes (gloo) built from vLLM 0.33.0's own
parallel layers (``scripts/_vllm_tp.py``), seen through a loopback vLLM server
(``VllmServer`` of ``tests/sidecar/engine_servers.py``: ``/collective_rpc``, ``/pause``,
``/resume``) as vLLM workers with ``BulletinWorkerExtension`` mixed in. The real
:class:`~bulletin.engines.vllm.VLLMTarget` behind the same
:class:`~bulletin.sidecar.GatedTarget` follows the run: every rank patches its own
shards in place. Two pauses are measured per version:

- *gate*: the sidecar's ``bulletin_activation_pause_seconds``, as above (requests held
  at the sidecar: the node folder's apply, the workers' apply, the verification of the
  ranks' partial fingerprints and the activation);
- *engine*: the time the loopback server spent paused, from vLLM's ``/pause`` answered
  to ``/resume`` called (the workers' apply, cache resets, weight version).

The baseline is a *full reload* of the same version on the same ranks through vLLM's
own loaders: ``load_weights`` (``AutoWeightsLoader``, every checkpoint tensor through
its parameter's ``weight_loader`` with its shard id) from the whole checkpoint already
in each rank's memory, the ranks started together by a barrier; an engine's reload is
its slowest rank's; best of three. After the reloads the workers' fingerprints are
checked against the version's, so the baseline loaded the same bits.

Next to them, the *write floor*: as many elements as the version changed (each rank its
share of them) written at uniformly random places of each rank's own parameters by a
bare NumPy scatter, no Bulletin code, the ranks started together, best of three. A
version's changes are spread so (AdamW moves the elements whose BF16 step is smallest,
wherever they are), each on a cache line of its own, while a reload streams every
line: ``reload / floor`` is the most any in-place pause of that many changes can reach
on the machine, whatever its control calls cost.

Two TP models by default (``--tp-preset``, repeatable): ``cpu`` (~126M parameters) and
``large`` (~0.40B: its trainer takes ~6.4 GB); the pause grows with the changed elements
and the reload with the model, so the larger one shows what the fixed costs weigh.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bulletin.checkpoint import write_checkpoint  # noqa: E402
from bulletin.engines.torch_module import TorchTarget  # noqa: E402
from bulletin.publisher import Publisher  # noqa: E402
from bulletin.sidecar.gate import ActivationGate  # noqa: E402
from bulletin.sidecar.metrics import SidecarMetrics  # noqa: E402
from bulletin.sidecar.worker import GateBridge, GatedTarget  # noqa: E402
from bulletin.snapshot import snapshot  # noqa: E402
from bulletin.subscriber import Subscriber  # noqa: E402
from scripts._common import llama, llama_config  # noqa: E402
from scripts._vllm_tp import VLLM_PATH_ENV, RankState, build_llama, set_tp, vllm_path  # noqa: E402

#: Sizes of :func:`scripts._common.llama_config`, on top of its defaults.
PRESETS: dict[str, dict[str, int]] = {
    # The end-to-end test's model (the defaults).
    "tiny": {},
    # ~27M parameters (54 MB in BF16): big enough that a full reload is not free on a CPU.
    "small": {"vocab": 8192, "hidden": 512, "intermediate": 1376, "layers": 8, "heads": 8, "kv_heads": 4},
    # ~0.4B parameters: for GPU machines.
    "medium": {"vocab": 32000, "hidden": 1024, "intermediate": 2816, "layers": 24, "heads": 16, "kv_heads": 8},
}


@dataclass(frozen=True)
class TpPreset:
    """A TP model (untied LM head, as vLLM's ``ParallelLMHead`` shards it) and the AdamW
    learning rate at which about 0.4% of its BF16 elements change per step."""

    sizes: dict[str, int]
    lr: float


TP_PRESETS: dict[str, TpPreset] = {
    # The TP tests' model: GQA, a vocabulary (101) no TP size divides, so vLLM pads it.
    "tiny": TpPreset({"vocab": 101, "hidden": 64, "intermediate": 96, "layers": 2, "heads": 4, "kv_heads": 2}, 3e-6),
    # ~126M parameters (0.25 GB in BF16), 12 heads and 4 KV heads (TP 4: one KV head per rank).
    "cpu": TpPreset(
        {"vocab": 32000, "hidden": 768, "intermediate": 2048, "layers": 12, "heads": 12, "kv_heads": 4}, 1.2e-7
    ),
    # ~0.40B parameters (0.8 GB in BF16; the trainer's FP32 weights, gradients and AdamW
    # moments take ~6.4 GB): the fixed costs of a pause weigh less next to a reload.
    "large": TpPreset(
        {"vocab": 32000, "hidden": 1536, "intermediate": 4096, "layers": 12, "heads": 12, "kv_heads": 4}, 1.2e-7
    ),
}

#: TP sizes of a bare run (when the kit is present).
DEFAULT_TP = (1, 2, 4)
#: TP models of a run that names none.
DEFAULT_TP_PRESETS = ("cpu", "large")

#: Full reloads timed per version; the fastest counts.
RELOAD_REPEATS = 3


@dataclass
class DeviceResult:
    device: str
    pauses_s: list[float] = field(default_factory=list)
    changed: list[int] = field(default_factory=list)
    reloads_s: list[float] = field(default_factory=list)

    @property
    def median_pause(self) -> float:
        return statistics.median(self.pauses_s)

    @property
    def median_reload(self) -> float:
        return statistics.median(self.reloads_s)


@dataclass
class PresetResult:
    preset: str
    parameters: int
    served_bytes: int
    lr: float
    devices: list[DeviceResult] = field(default_factory=list)


@dataclass
class TpResult:
    """One TP size: per version, both pauses, the changed elements and the best full reload."""

    tp: int
    gate_pauses_s: list[float] = field(default_factory=list)
    engine_pauses_s: list[float] = field(default_factory=list)
    changed: list[int] = field(default_factory=list)
    reloads_s: list[float] = field(default_factory=list)
    #: The same reload reading the checkpoint file as vLLM's loader does.
    file_reloads_s: list[float] = field(default_factory=list)
    #: The write floor: as many elements as the version changed, written at random places
    #: of the ranks' own parameters by a bare NumPy scatter (no Bulletin code).
    floors_s: list[float] = field(default_factory=list)

    @property
    def medians(self) -> dict[str, float]:
        gate, engine = statistics.median(self.gate_pauses_s), statistics.median(self.engine_pauses_s)
        reload, changed = statistics.median(self.reloads_s), statistics.median(self.changed)
        floor = statistics.median(self.floors_s)
        return {
            "median_gate_pause_s": gate,
            "median_engine_pause_s": engine,
            "median_reload_s": reload,
            "median_file_reload_s": statistics.median(self.file_reloads_s),
            "median_floor_s": floor,
            "reload_over_gate_pause": reload / gate,
            "reload_over_engine_pause": reload / engine,
            "reload_over_floor": reload / floor,
            "gate_ns_per_changed": gate / changed * 1e9,
            "engine_ns_per_changed": engine / changed * 1e9,
            "floor_ns_per_changed": floor / changed * 1e9,
        }


@dataclass
class TpPresetResult:
    preset: str
    parameters: int
    served_bytes: int
    lr: float
    sizes: list[TpResult] = field(default_factory=list)


@contextmanager
def _loop_thread() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop on its own thread, as the sidecar's: the gate lives there."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


async def _make_gate() -> ActivationGate:
    return ActivationGate()


def _follow(
    subscriber: Subscriber, gated: GatedTarget, metrics: SidecarMetrics, versions: list[int]
) -> Iterator[tuple[int, float, int]]:
    """Sync each version through the gated target, as ``bulletin serve`` does; yield
    ``(version, pause, changed elements)`` for each after the keyframe. The gate's loop
    runs until the generator is closed."""
    stop = threading.Event()
    with _loop_thread() as loop:
        gate = asyncio.run_coroutine_threadsafe(_make_gate(), loop).result()
        gated.bridge = GateBridge(gate, loop, metrics, drain_timeout=None, stop=stop)
        try:
            for version in versions:
                before_sum, before_count = metrics.pause_seconds.sum(), metrics.pause_seconds.count()
                subscriber.sync(version)
                gated.finish()
                report = subscriber.stats.last_report
                assert report is not None and subscriber.current_version == version
                if version == versions[0]:
                    continue  # the keyframe: a full load by construction
                assert metrics.pause_seconds.count() == before_count + 1
                yield version, metrics.pause_seconds.sum() - before_sum, report.changed_elements
        finally:
            stop.set()


def _train(
    config: LlamaConfig, *, steps: int, lr: float, store: str, run: str, keep: Callable[[int, LlamaForCausalLM], None]
) -> int:
    """Train a Llama with AdamW on FP32 masters, publishing every step as BF16 (the
    first publish is the keyframe); ``keep(version, trainer)`` after each. Returns the
    parameter count."""
    trainer = llama(config, 0)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=lr)
    data = torch.Generator().manual_seed(0)
    with Publisher(store, run, keyframe_every=10_000) as publisher:
        for step in range(steps + 1):
            if step:
                batch = torch.randint(0, config.vocab_size, (2, 32), generator=data)
                trainer(input_ids=batch, labels=batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            keep(publisher.publish(trainer.state_dict()), trainer)
    return sum(p.numel() for p in trainer.parameters())


# -- in-process torch engine ------------------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _measure_device(
    device: str, config: LlamaConfig, store: str, run: str, versions: list[int], states: list[dict[str, torch.Tensor]]
) -> DeviceResult:
    result = DeviceResult(device)
    model = llama(config, 1, dtype=torch.bfloat16, device=device)  # weights from the keyframe on
    metrics = SidecarMetrics()
    gated = GatedTarget(TorchTarget.from_module(model), metrics)
    subscriber = Subscriber(store, run, target=gated)
    try:
        for version, pause, changed in _follow(subscriber, gated, metrics, versions):
            result.pauses_s.append(pause)
            result.changed.append(changed)
            host = {k: v.to(torch.bfloat16) for k, v in states[versions.index(version)].items()}
            best = float("inf")
            for _ in range(RELOAD_REPEATS):  # the baseline's best case: this machine is shared
                _sync(device)
                started = time.perf_counter()
                model.load_state_dict(host)  # the full reload (same bits), into the live model
                _sync(device)
                best = min(best, time.perf_counter() - started)
            result.reloads_s.append(best)
    finally:
        subscriber.close()
    return result


def bench_preset(name: str, *, steps: int, lr: float, devices: list[str]) -> PresetResult:
    config = llama_config(**PRESETS[name], max_positions=128, tied=False)
    with tempfile.TemporaryDirectory() as tmp:
        store, run = str(Path(tmp) / "store"), "bench"
        versions: list[int] = []
        states: list[dict[str, torch.Tensor]] = []

        def keep(version: int, trainer: LlamaForCausalLM) -> None:
            versions.append(version)
            states.append({k: v.detach().clone() for k, v in trainer.state_dict().items()})

        params = _train(config, steps=steps, lr=lr, store=store, run=run, keep=keep)
        result = PresetResult(name, params, params * 2, lr)
        for device in devices:
            result.devices.append(_measure_device(device, config, store, run, versions, states))
    return result


# -- tensor-parallel vLLM engines, CPU ranks ---------------------------------------------------


def _rank_engine(state: RankState, config: LlamaConfig, tp: int) -> int:
    """In a rank: vLLM's groups at TP size ``tp``, this rank's model (zeros) and a vLLM
    worker with Bulletin's extension over it."""
    from tests.sidecar.engine_servers import extended_worker

    set_tp(state, tp)
    model = build_llama(config)
    state.models["engine"] = model
    state.worker = extended_worker(model)
    return state.tp_rank


def _rank_reload(state: RankState, path: str, repeats: int) -> dict[str, list[float]]:
    """In a rank: ``repeats`` timed full reloads through vLLM's ``load_weights`` of the
    checkpoint at ``path``, each started with the other ranks of the engine (a barrier):
    ``memory``, from every tensor already in this rank's memory (read untimed: the
    cheapest reload there is); ``files``, from the checkpoint file as vLLM's
    ``DefaultModelLoader`` reads it (``safetensors_weights_iterator``; page cache warm)."""
    from vllm.distributed import get_tp_group
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(f) for f in Path(path).glob("*.safetensors"))
    weights = dict(safetensors_weights_iterator(files, False))
    model = state.models["engine"]
    group = get_tp_group().cpu_group
    sources: dict[str, Callable[[], Iterator[tuple[str, torch.Tensor]]]] = {
        "memory": lambda: iter(weights.items()),
        "files": lambda: safetensors_weights_iterator(files, False),
    }
    times: dict[str, list[float]] = {}
    expected = len(dict(model.named_parameters()))
    for source, weights_of in sources.items():
        for _ in range(repeats):
            torch.distributed.barrier(group=group)
            started = time.perf_counter()
            loaded = model.load_weights(weights_of())
            times.setdefault(source, []).append(time.perf_counter() - started)
            if len(loaded) != expected:
                raise RuntimeError(f"load_weights loaded {len(loaded)} of {expected} parameters from {source}")
    return times


def _rank_floor(state: RankState, share: float, repeats: int, seed: int) -> list[float]:
    """In a rank: ``repeats`` timed bare writes of ``share`` of this rank's parameter
    elements, at uniformly random places of each parameter (a version's changes are
    spread about so: AdamW moves the elements whose BF16 step is smallest), each started
    with the other ranks of the engine (a barrier). The bits written are the ones held,
    so nothing changes. A NumPy fancy-index store, as ``TorchTarget`` writes on the CPU,
    with no Bulletin code: the floor of any in-place pause of that many changes here."""
    import numpy as np
    from vllm.distributed import get_tp_group

    rng = np.random.default_rng(seed + state.rank)
    writes = []
    for param in state.models["engine"].parameters():
        flat = param.detach().reshape(-1).view(torch.int16).numpy()  # zero-copy bits
        count = round(share * flat.size)
        if count:
            where = np.unique(rng.integers(0, flat.size, count, dtype=np.int64))
            writes.append((flat, where, flat[where]))
    group = get_tp_group().cpu_group
    times = []
    for _ in range(repeats):
        torch.distributed.barrier(group=group)
        started = time.perf_counter()
        for flat, where, values in writes:
            flat[where] = values
        times.append(time.perf_counter() - started)
    return times


def _timed_server(engines: list[list[Any]]) -> Any:
    """A loopback vLLM server that records how long each ``/pause`` lasted: from the
    pause answered (the engine stopped) to ``/resume`` called."""
    from tests.sidecar.engine_servers import Call, VllmServer

    class TimedVllmServer(VllmServer):
        def __init__(self) -> None:
            self.pauses_s: list[float] = []
            self._paused_at: float | None = None
            super().__init__(engines=engines)

        def _pause(self, call: Call) -> tuple[int, Any]:
            answer = super()._pause(call)
            if answer[0] == 200 and self._paused_at is None:
                self._paused_at = time.perf_counter()
            return answer

        def _resume(self, call: Call) -> tuple[int, Any]:
            if self._paused_at is not None:
                self.pauses_s.append(time.perf_counter() - self._paused_at)
                self._paused_at = None
            return super()._resume(call)

    return TimedVllmServer()


def _measure_tp(
    tp: int,
    kit: str,
    config: LlamaConfig,
    *,
    store: str,
    run: str,
    versions: list[int],
    checkpoints: dict[int, Path],
    work: Path,
    threads: int,
    parameters: int,
) -> TpResult:
    from bulletin.engines.vllm import VLLMTarget
    from bulletin.target import LocalDirTarget
    from scripts._vllm_tp import Cluster, RankWorker

    result = TpResult(tp)
    with Cluster(tp, kit, threads=threads) as cluster:
        cluster.run(_rank_engine, config, tp)
        server = _timed_server([[RankWorker(cluster, rank) for rank in range(tp)]])
        metrics = SidecarMetrics()
        target = VLLMTarget(LocalDirTarget(work / f"node-tp{tp}", run=run), server.url)
        gated = GatedTarget(target, metrics)
        subscriber = Subscriber(store, run, target=gated)
        try:
            for version, pause, changed in _follow(subscriber, gated, metrics, versions):
                result.gate_pauses_s.append(pause)
                result.changed.append(changed)
                result.engine_pauses_s.append(server.pauses_s[-1])
                server.pauses_s.clear()
                per_rank = cluster.run(_rank_reload, str(checkpoints[version]), RELOAD_REPEATS)
                # An engine's reload is its slowest rank's; of the repeats, the fastest.
                for source, into in (("memory", result.reloads_s), ("files", result.file_reloads_s)):
                    into.append(min(max(t) for t in zip(*(r[source] for r in per_rank), strict=True)))
                floors = cluster.run(_rank_floor, changed / parameters, RELOAD_REPEATS, version)
                result.floors_s.append(min(max(t) for t in zip(*floors, strict=True)))
                # Every worker must still hold the version's bits (the reload loaded the
                # same ones): its fingerprints are checked against what it should hold.
                target.full_fingerprints()
            assert target.plan is not None and len(target.plan.layouts) == tp
        finally:
            subscriber.close()
            server.close()
    return result


def bench_tp(name: str, *, tp_sizes: list[int], steps: int, lr: float | None, kit: str, threads: int) -> TpPresetResult:
    preset = TP_PRESETS[name]
    lr = preset.lr if lr is None else lr
    config = llama_config(**preset.sizes, max_positions=128, tied=False)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        store, run = str(work / "store"), "bench"
        versions: list[int] = []
        checkpoints: dict[int, Path] = {}

        def keep(version: int, trainer: LlamaForCausalLM) -> None:
            if versions:  # the baseline's checkpoint: the version's served bits, as published
                snap = snapshot(trainer.state_dict(), dtype="BF16")
                checkpoints[version] = work / f"ckpt-{version}"
                write_checkpoint(checkpoints[version], snap.specs, snap.bits)
            versions.append(version)

        params = _train(config, steps=steps, lr=lr, store=store, run=run, keep=keep)
        result = TpPresetResult(name, params, params * 2, lr)
        for tp in tp_sizes:
            result.sizes.append(
                _measure_tp(
                    tp,
                    kit,
                    config,
                    store=store,
                    run=run,
                    versions=versions,
                    checkpoints=checkpoints,
                    work=work,
                    threads=threads,
                    parameters=params,
                )
            )
    return result


def find_kit() -> tuple[str | None, str]:
    """vLLM's source kit: ``$BULLETIN_TEST_VLLM_PATH``, else the one
    ``scripts/vllm_source.py`` cached (never built here: that downloads). Returns the
    search path, or None and why."""
    given = vllm_path()
    if given is not None:
        return given, ""
    from scripts import vllm_source

    kit = vllm_source.kit_dir()
    if (kit / vllm_source.STAMP).is_file():
        return vllm_source.search_path(kit), ""
    return None, (
        f"{VLLM_PATH_ENV} is not set and no kit is cached at {kit} "
        f"(build it with: .venv/bin/python scripts/vllm_source.py)"
    )


def _gpu_available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False, "CuPy is not installed"
    return True, ""


def _print(result: PresetResult) -> None:
    print(
        f"\n== {result.preset}: {result.parameters / 1e6:.1f}M parameters, "
        f"{result.served_bytes / 2**20:.1f} MiB served (BF16), AdamW lr {result.lr:g}"
    )
    for dev in result.devices:
        print(f"-- {dev.device}")
        print(f"{'version':>8} {'changed':>12} {'share':>8} {'pause ms':>10} {'ns/changed':>11} {'reload ms':>10}")
        total = result.parameters
        for i, (pause, changed, reload) in enumerate(zip(dev.pauses_s, dev.changed, dev.reloads_s, strict=True)):
            per = pause / changed * 1e9 if changed else float("nan")
            print(
                f"{i + 2:>8} {changed:>12,} {changed / total:>8.2%} {pause * 1e3:>10.2f} {per:>11.1f} "
                f"{reload * 1e3:>10.2f}"
            )
        ratio = dev.median_pause / dev.median_reload
        print(
            f"median pause {dev.median_pause * 1e3:.2f} ms, median full reload {dev.median_reload * 1e3:.2f} ms: "
            f"pause = {ratio:.3f} x full reload ({1 / ratio:.1f}x shorter)"
        )


#: The issue's target: the in-place pause at least this many times shorter than a full reload.
TARGET_RATIO = 20.0


def _print_tp(result: TpPresetResult) -> None:
    print(
        f"\n== TP {result.preset}: {result.parameters / 1e6:.1f}M parameters, "
        f"{result.served_bytes / 2**20:.1f} MiB served (BF16), AdamW lr {result.lr:g}; vLLM 0.33.0 layers, CPU ranks"
    )
    header = (
        f"{'version':>8} {'changed':>12} {'share':>8} {'gate ms':>9} {'engine ms':>10} "
        f"{'reload ms':>10} {'from file':>10} {'floor ms':>9}"
    )
    for size in result.sizes:
        print(f"-- TP {size.tp}")
        print(header)
        rows = zip(
            size.changed,
            size.gate_pauses_s,
            size.engine_pauses_s,
            size.reloads_s,
            size.file_reloads_s,
            size.floors_s,
            strict=True,
        )
        for i, (changed, gate, engine, reload, from_file, floor) in enumerate(rows):
            print(
                f"{i + 2:>8} {changed:>12,} {changed / result.parameters:>8.2%} {gate * 1e3:>9.2f} "
                f"{engine * 1e3:>10.2f} {reload * 1e3:>10.2f} {from_file * 1e3:>10.2f} {floor * 1e3:>9.2f}"
            )
        m = size.medians
        print(
            f"TP {size.tp}: median pause {m['median_gate_pause_s'] * 1e3:.2f} ms (gate) / "
            f"{m['median_engine_pause_s'] * 1e3:.2f} ms (engine); median full reload "
            f"{m['median_reload_s'] * 1e3:.2f} ms from memory "
            f"({m['median_file_reload_s'] * 1e3:.2f} ms from the file): "
            f"reload / pause {m['reload_over_gate_pause']:.2f}x (gate) / {m['reload_over_engine_pause']:.2f}x "
            f"(engine), target >= {TARGET_RATIO:g}x; {m['gate_ns_per_changed']:.1f} / "
            f"{m['engine_ns_per_changed']:.1f} ns per changed element"
        )
        print(
            f"TP {size.tp}: write floor {m['median_floor_s'] * 1e3:.2f} ms ({m['floor_ns_per_changed']:.1f} ns per "
            f"changed element: that many random elements of the ranks' parameters, a bare NumPy scatter): "
            f"reload / floor {m['reload_over_floor']:.2f}x, the most any in-place pause reaches here"
        )


def _tp_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of TP sizes: {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"TP sizes must be positive: {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), action="append", help="in-process torch engine (default: tiny and small)"
    )
    parser.add_argument(
        "--tp",
        type=_tp_sizes,
        help="TP sizes, e.g. 1,2,4 (only the TP part unless --preset is given too; "
        "a bare run does 1,2,4 when the vLLM kit is present)",
    )
    parser.add_argument(
        "--tp-preset",
        choices=sorted(TP_PRESETS),
        action="append",
        help=f"TP model, repeatable (default: {' and '.join(DEFAULT_TP_PRESETS)})",
    )
    parser.add_argument("--steps", type=int, default=4, help="versions after the keyframe (default 4)")
    parser.add_argument(
        "--lr", type=float, default=None, help="AdamW learning rate (default 1e-5; TP: the preset's, ~0.4%% changed)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (TP: per rank, default 1)")
    parser.add_argument("--cpu-only", action="store_true", help="skip the GPU path even if one is present")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run_in_process = args.preset is not None or args.tp is None
    tp_sizes: list[int] = []
    kit, why = find_kit()
    if args.tp is not None:
        if kit is None:
            print(f"error: --tp needs vLLM's source kit: {why}", file=sys.stderr)
            return 2
        tp_sizes = args.tp
    elif args.preset is None and kit is not None:
        tp_sizes = list(DEFAULT_TP)
    elif args.preset is None:
        print(f"TP path: skipped ({why})")
    results = []
    if run_in_process:
        devices = ["cpu"]
        gpu, gpu_why = _gpu_available()
        if args.cpu_only:
            print("GPU path: skipped (--cpu-only)")
        elif gpu:
            devices.append("cuda")
        else:
            print(f"GPU path: skipped ({gpu_why})")
        for name in args.preset or ["tiny", "small"]:
            result = bench_preset(name, steps=args.steps, lr=1e-5 if args.lr is None else args.lr, devices=devices)
            _print(result)
            results.append(result)
    tp_results: list[TpPresetResult] = []
    if tp_sizes:
        assert kit is not None
        for name in args.tp_preset or DEFAULT_TP_PRESETS:
            tp_result = bench_tp(
                name, tp_sizes=tp_sizes, steps=args.steps, lr=args.lr, kit=kit, threads=args.threads or 1
            )
            _print_tp(tp_result)
            tp_results.append(tp_result)
    if args.json:
        payload: list[dict[str, Any]] = []
        for r in results:
            entry = asdict(r)
            for dev, raw in zip(r.devices, entry["devices"], strict=True):
                raw["median_pause_s"] = dev.median_pause
                raw["median_reload_s"] = dev.median_reload
            payload.append(entry)
        out: dict[str, Any] = {"torch": torch.__version__, "results": payload}
        tp_entries = []
        for tp_result in tp_results:
            tp_entry = asdict(tp_result)
            for size, raw in zip(tp_result.sizes, tp_entry["sizes"], strict=True):
                raw.update(size.medians)
            tp_entries.append(tp_entry)
        if tp_entries:
            out["tp"] = tp_entries[0]  # the first TP model (one unless several are named)
            out["tp_presets"] = tp_entries
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
