#!/usr/bin/env python
"""Activation pause per version, next to a full reload measured in the same run.

    .venv/bin/python scripts/bench_pause.py                    # tiny + small presets, CPU (+ GPU if present)
    .venv/bin/python scripts/bench_pause.py --preset small     # one preset
    .venv/bin/python scripts/bench_pause.py --json out.json    # also write the results as JSON

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
is skipped with a line saying so.
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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bulletin.engines.torch_module import TorchTarget  # noqa: E402
from bulletin.publisher import Publisher  # noqa: E402
from bulletin.sidecar.gate import ActivationGate  # noqa: E402
from bulletin.sidecar.metrics import SidecarMetrics  # noqa: E402
from bulletin.sidecar.worker import GateBridge, GatedTarget  # noqa: E402
from bulletin.subscriber import Subscriber  # noqa: E402
from scripts._common import llama, llama_config  # noqa: E402

#: Sizes of :func:`scripts._common.llama_config`, on top of its defaults.
PRESETS: dict[str, dict[str, int]] = {
    # The end-to-end test's model (the defaults).
    "tiny": {},
    # ~27M parameters (54 MB in BF16): big enough that a full reload is not free on a CPU.
    "small": {"vocab": 8192, "hidden": 512, "intermediate": 1376, "layers": 8, "heads": 8, "kv_heads": 4},
    # ~0.4B parameters: for GPU machines.
    "medium": {"vocab": 32000, "hidden": 1024, "intermediate": 2816, "layers": 24, "heads": 16, "kv_heads": 8},
}


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
    stop = threading.Event()
    with _loop_thread() as loop:
        gate = asyncio.run_coroutine_threadsafe(_make_gate(), loop).result()
        gated.bridge = GateBridge(gate, loop, metrics, drain_timeout=None, stop=stop)
        for version, state in zip(versions, states, strict=True):
            before_sum, before_count = metrics.pause_seconds.sum(), metrics.pause_seconds.count()
            subscriber.sync(version)
            gated.finish()
            report = subscriber.stats.last_report
            assert report is not None and subscriber.current_version == version
            if version == versions[0]:
                continue  # the keyframe: a full load by construction
            assert metrics.pause_seconds.count() == before_count + 1
            result.pauses_s.append(metrics.pause_seconds.sum() - before_sum)
            result.changed.append(report.changed_elements)
            host = {k: v.to(torch.bfloat16) for k, v in state.items()}
            best = float("inf")
            for _ in range(RELOAD_REPEATS):  # the baseline's best case: this machine is shared
                _sync(device)
                started = time.perf_counter()
                model.load_state_dict(host)  # the full reload (same bits), into the live model
                _sync(device)
                best = min(best, time.perf_counter() - started)
            result.reloads_s.append(best)
        stop.set()
    subscriber.close()
    return result


async def _make_gate() -> ActivationGate:
    return ActivationGate()


def bench_preset(name: str, *, steps: int, lr: float, devices: list[str]) -> PresetResult:
    config = llama_config(**PRESETS[name], max_positions=128, tied=False)
    trainer = llama(config, 0)
    params = sum(p.numel() for p in trainer.parameters())
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=lr)
    data = torch.Generator().manual_seed(0)
    result = PresetResult(name, params, params * 2, lr)
    with tempfile.TemporaryDirectory() as tmp:
        store, run = str(Path(tmp) / "store"), "bench"
        versions: list[int] = []
        states: list[dict[str, torch.Tensor]] = []
        with Publisher(store, run, keyframe_every=10_000) as publisher:
            for step in range(steps + 1):
                if step:
                    batch = torch.randint(0, config.vocab_size, (2, 32), generator=data)
                    trainer(input_ids=batch, labels=batch).loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                versions.append(publisher.publish(trainer.state_dict()))
                states.append({k: v.detach().clone() for k, v in trainer.state_dict().items()})
        for device in devices:
            result.devices.append(_measure_device(device, config, store, run, versions, states))
    return result


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), action="append", help="default: tiny and small")
    parser.add_argument("--steps", type=int, default=4, help="versions after the keyframe (default 4)")
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (default 1e-5)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--cpu-only", action="store_true", help="skip the GPU path even if one is present")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = ["cpu"]
    gpu, why = _gpu_available()
    if args.cpu_only:
        print("GPU path: skipped (--cpu-only)")
    elif gpu:
        devices.append("cuda")
    else:
        print(f"GPU path: skipped ({why})")
    results = []
    for name in args.preset or ["tiny", "small"]:
        result = bench_preset(name, steps=args.steps, lr=args.lr, devices=devices)
        _print(result)
        results.append(result)
    if args.json:
        payload: list[dict[str, Any]] = []
        for r in results:
            entry = asdict(r)
            for dev, raw in zip(r.devices, entry["devices"], strict=True):
                raw["median_pause_s"] = dev.median_pause
                raw["median_reload_s"] = dev.median_reload
            payload.append(entry)
        args.json.write_text(json.dumps({"torch": torch.__version__, "results": payload}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
