"""``bulletin demo``: a realistic run on a local directory bucket, end to end.

A Llama-shaped model (FP32 master weights, BF16 served) takes AdamW steps on
synthetic gradients: each update is at most about the learning rate per element, which
is smaller than BF16's rounding step for most weights, so most served bits stay the
same. Every step is published in the background; a replica then syncs, once from
nothing (keyframe + patches) and once from an intermediate version (folded patches),
and its bits are compared with the trainer's.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from bulletin.errors import InternalError
from bulletin.publisher import Publisher, PublishResult
from bulletin.subscriber import Subscriber
from bulletin.target import ArrayTarget
from patcher.cast import cast_bits

__all__ = ["DemoReport", "SyntheticAdamW", "llama_layout", "run_demo"]


def llama_layout(params: int) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a Llama-style decoder with about ``params`` parameters."""
    layers = 8 if params >= 8_000_000 else 2
    vocab = 32_000 if params >= 20_000_000 else 4_096
    hidden = 64
    while True:
        ff = int(hidden * 8 / 3) // 64 * 64
        per_layer = 4 * hidden * hidden + 3 * hidden * ff + 2 * hidden
        if layers * per_layer + 2 * vocab * hidden >= params or hidden >= 8192:
            break
        hidden += 64
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (hidden, hidden),
            p + "self_attn.v_proj.weight": (hidden, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (ff, hidden),
            p + "mlp.up_proj.weight": (ff, hidden),
            p + "mlp.down_proj.weight": (hidden, ff),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return shapes


@dataclass(slots=True)
class DemoReport:
    run: str
    store: str
    params: int
    dense_bf16_bytes: int
    versions: list[PublishResult] = field(default_factory=list)
    publish_seconds: list[float] = field(default_factory=list)
    fresh_sync_seconds: float = 0.0
    fresh_sync_bytes: int = 0
    catch_up_seconds: float = 0.0
    catch_up_bytes: int = 0
    catch_up_from: int = 0


class SyntheticAdamW:
    """AdamW on FP32 masters with synthetic gradients: a fixed per-element signal plus
    fresh noise each step, so the moments behave as in real training (the first step
    moves every weight by about lr, later ones by a fraction of it)."""

    def __init__(self, masters: dict[str, NDArray[np.float32]], rng: np.random.Generator, lr: float) -> None:
        self.masters, self.rng, self.lr = masters, rng, lr
        self.signal = {n: (0.3 * rng.standard_normal(w.shape)).astype(np.float32) for n, w in masters.items()}
        self.m = {n: np.zeros_like(w) for n, w in masters.items()}
        self.v = {n: np.zeros_like(w) for n, w in masters.items()}
        self.t = 0

    def step(self, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        self.t += 1
        c1, c2 = 1 - beta1**self.t, 1 - beta2**self.t
        for name, w in self.masters.items():
            if name.endswith("norm.weight"):
                continue  # norms get tiny gradients: they almost never move in BF16
            g = self.signal[name] + self.rng.standard_normal(w.shape, dtype=np.float32)
            m, v = self.m[name], self.v[name]
            m *= beta1
            m += (1 - beta1) * g
            v *= beta2
            v += (1 - beta2) * g * g
            np.multiply(w, 1 - self.lr * weight_decay, out=w)
            np.subtract(w, (self.lr / c1) * m / (np.sqrt(v / c2) + eps), out=w)


def run_demo(
    directory: Path,
    *,
    params: int = 24_000_000,
    versions: int = 8,
    keyframe_every: int = 5,
    lr: float = 1e-6,
    seed: int = 0,
    say: Callable[[str], None] = print,
) -> DemoReport:
    """Publish ``versions`` versions, sync replicas, check them; returns the figures."""
    rng = np.random.default_rng(seed)
    store = directory / "bucket"
    # A new run each time (two demos in one second included): the bucket keeps the old ones.
    run = time.strftime("demo-%Y%m%d-%H%M%S", time.gmtime()) + f"-{secrets.token_hex(2)}"
    shapes = llama_layout(params)
    masters = {n: (rng.standard_normal(s, dtype=np.float32) * 0.02) for n, s in shapes.items()}
    for name, weights in masters.items():
        if name.endswith("norm.weight"):
            weights[...] = 1.0
    total = sum(int(np.prod(s)) for s in shapes.values())
    report = DemoReport(run=run, store=str(store), params=total, dense_bf16_bytes=2 * total)
    mib = report.dense_bf16_bytes / 2**20
    say(f"model: {len(shapes)} tensors, {total / 1e6:.1f}M parameters, {mib:.1f} MiB in BF16")
    say(f"bucket: {store} (local directory), run {run}, keyframe every {keyframe_every}, lr {lr:g}")
    say(f"{'version':>7}  {'kind':<9} {'changed %':>9} {'bytes':>12} {'vs full':>9} {'B/changed':>9} {'publish s':>9}")
    optimizer = SyntheticAdamW(masters, rng, lr)
    with Publisher(store, run, keyframe_every=keyframe_every) as pub:
        for i in range(versions):
            if i:
                optimizer.step()
            t0 = time.perf_counter()
            result = pub.publish_async(masters).result()
            report.publish_seconds.append(time.perf_counter() - t0)
            report.versions.append(result)
            moved = result.patch_bytes if not result.keyframe or result.version > 1 else result.keyframe_bytes
            kind = ("key+patch" if result.version > 1 else "keyframe") if result.keyframe else "patch"
            pct = 100 * result.changed_elements / result.total_elements
            per = (
                result.patch_bytes / result.changed_elements if result.patch_bytes and result.changed_elements else 0.0
            )
            say(
                f"{result.version:>7}  {kind:<9} {pct:>9.3f} {moved:>12,} "
                f"{report.dense_bf16_bytes / max(moved, 1):>8.1f}x {per:>9.2f} {report.publish_seconds[-1]:>9.2f}"
            )
    last_published = {n: cast_bits(m.view(np.uint32), "F32", "BF16") for n, m in masters.items()}

    # One replica per run: a replica folder belongs to one run, and each demo is a new run.
    replica = directory / "replicas" / run
    mid = max(1, versions // 2)
    with Subscriber(store, run, replica) as sub:
        t0 = time.perf_counter()
        sub.sync(mid)
        report.fresh_sync_seconds = time.perf_counter() - t0
        report.fresh_sync_bytes = sub.stats.bytes_downloaded
        say(
            f"fresh replica -> version {mid}: {report.fresh_sync_bytes:,} bytes in "
            f"{report.fresh_sync_seconds:.2f}s (keyframe + patches)"
        )
        t0 = time.perf_counter()
        sub.sync()
        report.catch_up_seconds = time.perf_counter() - t0
        report.catch_up_bytes = sub.stats.bytes_downloaded - report.fresh_sync_bytes
        report.catch_up_from = mid
        folded = sub.stats.last_report.transitions if sub.stats.last_report else 0
        say(
            f"catch-up {mid} -> {sub.current_version}: {report.catch_up_bytes:,} bytes in "
            f"{report.catch_up_seconds:.2f}s ({folded} transitions folded into one apply), "
            f"{report.dense_bf16_bytes * (versions - mid) / max(report.catch_up_bytes, 1):.0f}x fewer bytes "
            "than full checkpoints"
        )
    check = ArrayTarget()
    with Subscriber(store, run, target=check) as sub:
        sub.sync()
    for name, bits in last_published.items():
        if not np.array_equal(check.arrays[name], bits):
            raise InternalError(f"replica differs from the trainer in {name}")
    say(f"replica at version {versions} is bit-identical to the trainer's BF16 weights; files in {replica / 'current'}")
    return report
