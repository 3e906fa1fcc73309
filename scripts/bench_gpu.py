#!/usr/bin/env python3
"""One GPU benchmark run of Bulletin's kernels; results as JSON.

Sections (each written to the JSON as soon as it is done, so a cut-short run keeps
what it measured; a section that fails records its error and the next one runs):

- ``tests``: ``pytest -m gpu tests/kernels`` first, pass/fail and the summary line.
- ``diff``: 3e9 BF16 elements (2 x 6 GB) with ~1 % changed: fused ``diff_cast`` vs the
  naive CuPy ``flatnonzero(a != b)`` + gather vs a device-to-device copy, in TB/s of
  effective read (bytes of current + kept over time); then the same from FP32 masters.
- ``publish``: trainer side for a Llama-3-8B layout (FP32 masters, BF16 served, 1 %
  changed, ~80 M elements): ``diff_cast`` over every tensor + device-to-host copy +
  ``patcher.encode``, per stage.
- ``apply``: rollout side for the same patch, from its encoded shards in pinned host
  memory: entropy decode on the CPU (``patcher.decode``), staging into pinned buffers,
  host-to-device copy, scatter fused with the fingerprint update, per stage; and the
  GPU gap decoding alternative (gaps host-to-device + ``decode_gaps``); and the same
  patch in the context codec: CPU encode against the base, CPU entropy stage, classes,
  ranks and deltas host-to-device, select + scatter + fingerprint (``apply_ranks``).
- ``select``: the context codec's pass over the base (``select_ranks``, kernels/bulletin_kernels/select.cu)
  on 1e9 BF16 elements with 0.35 % of them queried, and the same fused with the
  scatter-add and fingerprint change (``apply_ranks``), in GB/s of base, against a
  device copy of the base in the same run.

``--dry-run`` runs everything at toy sizes on the NumPy twin (no GPU, no CuPy), so CI
can check the script does not rot. Usage::

    python scripts/bench_gpu.py [--out DIR] [--dry-run] [--no-tests] [--reps N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

ROOT: Final = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bulletin_kernels import numpy_twin  # noqa: E402
from bulletin_kernels.dispatch import Backend  # noqa: E402
from bulletin_kernels.types import BitsArray, IndexArray  # noqa: E402
from patcher.context_decode import decode_changes  # noqa: E402
from patcher.decode import decode, read_shard_header  # noqa: E402
from patcher.encode import encode  # noqa: E402
from patcher.patch import Change, Patch, TensorDelta, TensorSpec  # noqa: E402

MASK64: Final = (1 << 64) - 1
TB: Final = 1e12

#: Llama-3-8B: hidden 4096, MLP 14336, 32 layers, 32 query / 8 KV heads of 128, vocab 128256.
LLAMA3_8B: Final = {"hidden": 4096, "mlp": 14336, "layers": 32, "kv": 1024, "vocab": 128256}
#: A toy model of the same shape family for --dry-run.
TOY: Final = {"hidden": 64, "mlp": 224, "layers": 2, "kv": 16, "vocab": 1000}


def llama_layout(dims: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a Llama-style model (untied embedding and head)."""
    h, f, kv = dims["hidden"], dims["mlp"], dims["kv"]
    layout: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (dims["vocab"], h)}
    for i in range(dims["layers"]):
        p = f"model.layers.{i}"
        layout |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (h, h),
            f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h),
            f"{p}.self_attn.o_proj.weight": (h, h),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.mlp.gate_proj.weight": (f, h),
            f"{p}.mlp.up_proj.weight": (f, h),
            f"{p}.mlp.down_proj.weight": (h, f),
        }
    layout |= {"model.norm.weight": (h,), "lm_head.weight": (dims["vocab"], h)}
    return layout


# -- one device API for both modes ---------------------------------------------------------


class Device:
    """Arrays, synthetic data, timing and transfers on the GPU (CuPy) or, for --dry-run,
    on the CPU (NumPy): the benchmark body is the same code for both."""

    def __init__(self, dry_run: bool) -> None:
        self.dry_run = dry_run
        if dry_run:
            self.xp: Any = np
            self.backend: Backend = numpy_twin
            self.name = f"CPU ({platform.processor() or platform.machine()}), NumPy twin"
            return
        import cupy

        from bulletin_kernels import cuda

        self.xp = cupy
        self.backend = cuda
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        self.name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        # Synthetic data without host round trips or full-size temporaries.
        self._fill = cupy.ElementwiseKernel(
            "uint64 seed, uint64 mask, uint64 set",
            "T out",
            """
            unsigned long long x = ((unsigned long long)i + seed) * 0x9E3779B97F4A7C15ull;
            x ^= x >> 30; x *= 0xBF58476D1CE4E5B9ull; x ^= x >> 27; x *= 0x94D049BB133111EBull; x ^= x >> 31;
            out = (T)((x & mask) | set);
            """,
            "bulletin_bench_fill",
        )
        self._flip = cupy.ElementwiseKernel(
            "uint64 seed, uint64 per_million",
            "T out",
            """
            unsigned long long x = ((unsigned long long)i ^ seed) * 0xD6E8FEB86659FD93ull;
            x ^= x >> 32; x *= 0xD6E8FEB86659FD93ull; x ^= x >> 32;
            if (x % 1000000ull < per_million) out = (T)(out ^ (T)1);
            """,
            "bulletin_bench_flip",
        )

    def sync(self) -> None:
        if not self.dry_run:
            self.xp.cuda.get_current_stream().synchronize()

    def free(self) -> None:
        if not self.dry_run:
            self.xp.get_default_memory_pool().free_all_blocks()

    def random_bits(self, n: int, dtype: Any, seed: int, *, finite_f32: bool = False) -> Any:
        """``n`` pseudo-random elements; ``finite_f32`` gives plausible FP32 weights
        (|w| in [2**-7, 2), both signs) instead of arbitrary bit patterns."""
        mask, set_bits = (0x83FFFFFF, 0x3C000000) if finite_f32 else ((1 << 64) - 1, 0)
        if self.dry_run:
            rng = np.random.default_rng(seed)
            raw = rng.integers(0, 1 << 63, n, dtype=np.uint64)
            return ((raw & np.uint64(mask)) | np.uint64(set_bits)).astype(dtype)
        out = self.xp.empty(n, dtype=dtype)
        self._fill(np.uint64(seed), np.uint64(mask), np.uint64(set_bits), out)
        return out

    def flip(self, bits: Any, fraction: float, seed: int) -> None:
        """Flip the lowest bit of about ``fraction`` of the elements, in place."""
        per_million = round(fraction * 1_000_000)
        if self.dry_run:
            hit = np.random.default_rng(seed).random(bits.size) < fraction
            bits[hit] ^= bits.dtype.type(1)
            return
        self._flip(np.uint64(seed), np.uint64(per_million), bits)

    def to_host(self, array: Any) -> NDArray[Any]:
        out: NDArray[Any] = array if self.dry_run else self.xp.asnumpy(array)
        return out

    def pinned(self, nbytes: int) -> NDArray[np.uint8]:
        """A host buffer the device copies from at full speed (page-locked)."""
        if self.dry_run:
            return np.empty(nbytes, dtype=np.uint8)
        memory = self.xp.cuda.alloc_pinned_memory(nbytes)
        out: NDArray[np.uint8] = np.frombuffer(memory, dtype=np.uint8, count=nbytes)
        return out

    def pinned_copy(self, data: bytes) -> NDArray[np.uint8]:
        """``data`` in a page-locked host buffer (a downloaded shard, say)."""
        buf = self.pinned(len(data))
        buf[:] = np.frombuffer(data, dtype=np.uint8)
        return buf

    def upload(self, host: NDArray[Any]) -> Any:
        """A device copy of a (pinned) host array, copied straight from it: ``cupy.asarray``
        would first copy it into a staging buffer of its own."""
        if self.dry_run:
            return host.copy()
        out = self.xp.empty(host.shape, dtype=host.dtype)
        out.set(host)
        return out

    def timed(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """``fn()`` and its wall time in seconds, with the device idle before and after."""
        self.sync()
        start = time.perf_counter()
        result = fn()
        self.sync()
        return result, time.perf_counter() - start


def median_time(device: Device, fn: Callable[[], Any], reps: int, reset: Callable[[Any], None] | None = None) -> float:
    """Median of ``reps`` timed calls after one warm-up (compiles kernels, fills pools);
    ``reset(result)`` runs untimed after each call."""
    times = []
    for rep in range(reps + 1):
        result, seconds = device.timed(fn)
        if reset is not None:
            reset(result)
        if rep:
            times.append(seconds)
    return statistics.median(times)


# -- sections ------------------------------------------------------------------------------


def run_tests() -> dict[str, Any]:
    # Only the file that holds the gpu tests: the others need hypothesis, which a bare GPU
    # image may lack, and a collection error there would hide the GPU results.
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests/kernels/test_cuda.py"]
    started = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False, timeout=900)
    lines = (result.stdout + result.stderr).strip().splitlines()
    return {
        "command": " ".join(cmd[1:]),
        "returncode": result.returncode,
        "passed": result.returncode == 0,
        "summary": lines[-1] if lines else "",
        "tail": lines[-40:] if result.returncode else [],
        "seconds": round(time.perf_counter() - started, 1),
    }


def _undo(backend: Backend, kept: Any) -> Callable[[Any], None]:
    """After a timed diff_cast: subtract its deltas from ``kept`` to put the old bits back."""

    def undo(result: Any) -> None:
        if result.indices.size:
            backend.apply_delta(kept, result.indices, -result.delta)

    return undo


def _bench_bf16(device: Device, n: int, reps: int) -> dict[str, Any]:
    xp, backend = device.xp, device.backend
    current = device.random_bits(n, np.uint16, seed=1)
    kept = current.copy()
    device.flip(kept, 0.01, seed=2)
    read = 2 * 2 * n
    changed = int((current != kept).sum())
    out: dict[str, Any] = {"changed": changed, "bytes_read": read}

    scratch = xp.empty_like(current)
    seconds = median_time(device, lambda: xp.copyto(scratch, current), reps)
    out["copy"] = {"seconds": seconds, "read_TBps": 2 * n / seconds / TB, "read_write_TBps": 4 * n / seconds / TB}
    scratch = None
    device.free()

    def fused() -> Change[IndexArray, BitsArray]:
        return backend.diff_cast(current, kept, current_dtype="BF16", served_dtype="BF16")

    seconds = median_time(device, fused, reps, _undo(backend, kept))
    out["fused"] = {"seconds": seconds, "effective_read_TBps": read / seconds / TB}
    check = fused()
    found = int(check.indices.size)
    _undo(backend, kept)(check)
    del check
    if found != changed:
        raise RuntimeError(f"fused diff found {found} changes, the data has {changed}")
    device.free()

    def naive() -> tuple[Any, Any]:
        idx = xp.flatnonzero(current != kept)
        return idx, current[idx] - kept[idx]

    seconds = median_time(device, naive, reps)
    out["naive"] = {"seconds": seconds, "effective_read_TBps": read / seconds / TB}
    out["fused_over_naive"] = out["naive"]["seconds"] / out["fused"]["seconds"]
    out["fused_over_copy_read"] = out["fused"]["effective_read_TBps"] / out["copy"]["read_TBps"]
    return out


def _bench_f32(device: Device, n: int, reps: int) -> dict[str, Any]:
    backend = device.backend
    current = device.random_bits(n, np.uint32, seed=3, finite_f32=True)
    kept = backend.cast(current, "F32", "BF16")
    device.flip(kept, 0.01, seed=4)
    read = (4 + 2) * n

    def fused() -> Change[IndexArray, BitsArray]:
        return backend.diff_cast(current, kept, current_dtype="F32", served_dtype="BF16")

    seconds = median_time(device, fused, reps, _undo(backend, kept))
    return {"bytes_read": read, "fused": {"seconds": seconds, "effective_read_TBps": read / seconds / TB}}


def bench_diff(device: Device, n: int, reps: int) -> dict[str, Any]:
    """Section ``diff``: BF16 current vs kept, then FP32 masters vs BF16 kept."""
    out: dict[str, Any] = {"elements": n, "changed_fraction_target": 0.01}
    out["bf16"] = _bench_bf16(device, n, reps)
    device.free()
    out["f32_to_bf16"] = _bench_f32(device, n, reps)
    device.free()
    return out


@contextmanager
def stage(stages: dict[str, float], name: str, device: Device) -> Iterator[None]:
    device.sync()
    start = time.perf_counter()
    yield
    device.sync()
    stages[name] = stages.get(name, 0.0) + time.perf_counter() - start


def bench_publish_and_apply(device: Device, dims: dict[str, int], reps: int) -> tuple[dict[str, Any], dict[str, Any]]:
    backend = device.backend
    layout = llama_layout(dims)
    names = sorted(layout)
    total = sum(int(np.prod(s)) for s in layout.values())

    # Trainer state: FP32 masters, and the BF16 bits published last time, ~1 % stale.
    masters: dict[str, Any] = {}
    kept: dict[str, Any] = {}
    for k, name in enumerate(names):
        shape = layout[name]
        masters[name] = device.random_bits(int(np.prod(shape)), np.uint32, seed=100 + k, finite_f32=True)
        kept[name] = backend.cast(masters[name], "F32", "BF16")
        device.flip(kept[name], 0.01, seed=10_000 + k)
    base_fps = {name: backend.fingerprint(kept[name]) for name in names}
    base_bits = {name: kept[name].copy() for name in names}  # the rollout side's copy

    # -- publish: diff_cast every tensor, copy the changes to the host, encode.
    stages: dict[str, float] = {}
    results = {}
    with stage(stages, "diff_cast", device):
        for name in names:
            results[name] = backend.diff_cast(masters[name], kept[name], current_dtype="F32", served_dtype="BF16")
    with stage(stages, "device_to_host", device):
        host = {name: (device.to_host(r.indices), device.to_host(r.delta)) for name, r in results.items()}
    tensors = {}
    for name in names:
        idx, delta = host[name]
        spec = TensorSpec(name, "BF16", layout[name])
        target = (base_fps[name] + results[name].fingerprint_delta) & MASK64
        tensors[name] = TensorDelta(spec, idx.astype(np.int64, copy=False), delta, base_fps[name], target)
    patch = Patch(tensors)
    changed = patch.changed_elements
    with stage(stages, "encode", device):
        shards = encode(patch)
    encoded = sum(len(s) for s in shards)
    publish = {
        "layout": "Llama-3-8B" if dims == LLAMA3_8B else "toy",
        "tensors": len(names),
        "elements": total,
        "changed": changed,
        "changed_fraction": changed / total,
        "shards": len(shards),
        "encoded_bytes": encoded,
        "bytes_per_changed": encoded / max(changed, 1),
        "stages_seconds": stages,
        "total_seconds": sum(stages.values()),
    }
    masters.clear()
    results.clear()
    device.free()

    # -- apply: the rollout side holds base_bits and the encoded shards (downloaded into
    # pinned buffers); decode on the CPU, stage, upload, scatter + fingerprint, verify.
    pinned_shards = [device.pinned_copy(shard) for shard in shards]
    apply_runs = []
    for _ in range(max(1, reps)):
        stages = {}
        with stage(stages, "decode_cpu", device):
            decoded = decode([buf.data for buf in pinned_shards])
        n_idx = sum(td.indices.nbytes for td in decoded)
        n_delta = sum(td.delta.nbytes for td in decoded)
        staging = device.pinned(n_idx + n_delta + 128 * len(decoded))
        with stage(stages, "stage_pinned", device):
            views = {}
            offset = 0
            for td in decoded:
                parts = []
                for array in (td.indices, td.delta):
                    offset = -(-offset // 64) * 64  # keep every array cache-line aligned
                    view = staging[offset : offset + array.nbytes].view(array.dtype)
                    view[...] = array
                    parts.append(view)
                    offset += array.nbytes
                views[td.spec.name] = parts
        with stage(stages, "host_to_device", device):
            on_device = {name: (device.upload(i), device.upload(d)) for name, (i, d) in views.items()}
        new_fps = {}
        with stage(stages, "scatter_fingerprint", device):
            for td in decoded:
                idx, delta = on_device[td.spec.name]
                change = backend.apply_delta(base_bits[td.spec.name], idx, delta) if td.changed else 0
                new_fps[td.spec.name] = (td.base_fingerprint + change) & MASK64
        verified = all(new_fps[td.spec.name] == td.target_fingerprint for td in decoded)
        apply_runs.append((stages, verified, n_idx + n_delta))
        # Put the base back for the next run (untimed).
        for td in decoded:
            if td.changed:
                idx, delta = on_device[td.spec.name]
                backend.apply_delta(base_bits[td.spec.name], idx, -delta)
        on_device.clear()
        device.free()

    # Alternative: ship the gaps (narrow) to the device and prefix-sum them there.
    gap_stages: dict[str, float] = {}
    gaps = {}
    for td in decoded:
        if td.changed:
            g = np.diff(td.indices, prepend=-1)
            gaps[td.spec.name] = g.astype(np.uint32 if int(g.max()) < 1 << 32 else np.uint64)
    pinned_gaps = {}
    for name, g in gaps.items():
        buf = device.pinned(g.nbytes).view(g.dtype)
        buf[...] = g
        pinned_gaps[name] = buf
    with stage(gap_stages, "gaps_host_to_device", device):
        gaps_d = {name: device.upload(g) for name, g in pinned_gaps.items()}
    with stage(gap_stages, "decode_gaps", device):
        indices_d = {name: backend.decode_gaps(g, 0) for name, g in gaps_d.items()}
    gaps_ok = all(np.array_equal(device.to_host(indices_d[td.spec.name]), td.indices) for td in decoded if td.changed)

    stages, verified, uploaded = min(apply_runs, key=lambda run: sum(run[0].values()))
    full_fp_seconds = median_time(device, lambda: [backend.fingerprint(b) for b in base_bits.values()], 1)
    apply = {
        "changed": changed,
        "encoded_bytes": encoded,
        "uploaded_bytes": uploaded,
        "stages_seconds": stages,
        "total_seconds": sum(stages.values()),
        "verified": verified,
        "runs": len(apply_runs),
        "gpu_gap_decoding": {
            "stages_seconds": gap_stages,
            "uploaded_bytes": sum(g.nbytes for g in gaps.values()),
            "matches_cpu_decode": gaps_ok,
        },
        "full_fingerprint_seconds": full_fp_seconds,
        "full_fingerprint_TBps": 2 * total / full_fp_seconds / TB,
    }
    device.free()
    apply["context_codec"] = bench_context_apply(device, patch, base_bits)
    return publish, apply


def bench_context_apply(device: Device, patch: Patch, base_bits: dict[str, Any]) -> dict[str, Any]:
    """The same patch in the context codec (docs/FORMAT.md 3.15): encoded on the CPU
    against the base, then the rollout side: the entropy stage on the CPU
    (``decode_changes``, which needs no base), each entry's classes, ranks and deltas
    to the device, and select + scatter-add + fingerprint change in one kernel
    (``apply_ranks``) on the device-resident base. The base is put back afterwards."""
    backend = device.backend
    # The benchmark's device tensors are flat; encode checks them against the specs' shapes.
    host_base = {name: device.to_host(bits).reshape(patch.tensors[name].spec.shape) for name, bits in base_bits.items()}
    started = time.perf_counter()
    shards = encode(patch, codec="context", base=host_base)
    encode_seconds = time.perf_counter() - started
    host_base.clear()
    pinned_shards = [device.pinned_copy(shard) for shard in shards]
    stages: dict[str, float] = {}
    with stage(stages, "entropy_decode_cpu", device):
        changes = []
        for buf in pinned_shards:
            view = buf.data
            changes += [cc for cc in decode_changes(view, read_shard_header(view)) if cc.entry.count]
    with stage(stages, "host_to_device", device):
        uploaded = [(cc, device.upload(cc.classes), device.upload(cc.ranks), device.upload(cc.delta)) for cc in changes]
    change = dict.fromkeys(patch.tensors, 0)
    with stage(stages, "select_scatter_fingerprint", device):
        for cc, classes, ranks, delta in uploaded:
            e = cc.entry
            dtype = patch.tensors[e.tensor].spec.dtype
            change[e.tensor] += backend.apply_ranks(
                base_bits[e.tensor], dtype, cc.window, e.start, e.stop, classes, ranks, delta
            )
    verified = all(
        (td.base_fingerprint + change[name]) & MASK64 == td.target_fingerprint for name, td in patch.tensors.items()
    )
    for name, td in patch.tensors.items():
        if td.changed:
            backend.apply_delta(base_bits[name], device.upload(td.indices), device.upload(-td.delta))
    encoded = sum(map(len, shards))
    return {
        "encoded_bytes": encoded,
        "bytes_per_changed": encoded / max(patch.changed_elements, 1),
        "encode_cpu_seconds": encode_seconds,
        "uploaded_bytes": sum(cc.classes.nbytes + cc.ranks.nbytes + cc.delta.nbytes for cc in changes),
        "stages_seconds": stages,
        "total_seconds": sum(stages.values()),
        "verified": verified,
    }


def bench_select(device: Device, n: int, changed: float, reps: int) -> dict[str, Any]:
    """Section ``select``: the context codec's pass over the base on the rollout side
    (``select_ranks``: per-class counts of a BF16 base's exponent classes, then rank ->
    index for ``changed`` of its elements), against a device copy of the base."""
    xp, backend = device.xp, device.backend
    from patcher.context import ClassWindow

    # Plausible weights: |w| in [2**-7, 2), BF16 exponents 120..127, in a 12-class window.
    base = backend.cast(device.random_bits(n, np.uint32, seed=5, finite_f32=True), "F32", "BF16")
    window = ClassWindow(118, 12)
    picked = device.random_bits(n, np.uint16, seed=6) < round(changed * 65536)
    indices = xp.flatnonzero(picked)
    picked = None
    cls = xp.clip(((base >> 7) & 0xFF).astype(np.int16) - window.lo, 0, window.classes - 1).astype(np.uint8)
    query_classes = cls[indices]
    ranks = xp.empty(indices.size, dtype=np.int64)
    for c in range(window.classes):
        members = xp.cumsum(cls == c, dtype=np.int64) - 1  # rank of each member of class c
        mine = query_classes == c
        ranks[mine] = members[indices[mine]]
        members = None
    cls = None
    order = xp.argsort(query_classes.astype(np.int64) * (1 << 40) + ranks)  # class-major
    query_classes, ranks, expected = query_classes[order], ranks[order], indices[order]
    device.free()

    def select() -> Any:
        return backend.select_ranks(base, "BF16", window, 0, n, query_classes, ranks)

    seconds = median_time(device, select, reps)
    exact = bool(xp.all(select() == expected))

    # Fused with the scatter-add and the fingerprint change; undone by apply_delta
    # (sorted indices), since the classes of the patched bits differ.
    delta = xp.ones(expected.size, dtype=np.uint16)
    by_index = xp.argsort(expected)
    undo_indices, undo_delta = expected[by_index], -delta

    def fused() -> int:
        return backend.apply_ranks(base, "BF16", window, 0, n, query_classes, ranks, delta)

    def undo(_: int) -> None:
        backend.apply_delta(base, undo_indices, undo_delta)

    fused_seconds = median_time(device, fused, reps, undo)
    before = backend.fingerprint(base)
    change = fused()
    fused_exact = backend.fingerprint(base) == (before + change) & MASK64
    undo(change)
    scratch = xp.empty_like(base)
    copy_seconds = median_time(device, lambda: xp.copyto(scratch, base), reps)
    scratch = None
    device.free()
    return {
        "elements": n,
        "queries": int(indices.size),
        "classes": window.classes,
        "exact": exact,
        "seconds": seconds,
        "base_GBps": 2 * n / seconds / 1e9,
        "copy_seconds": copy_seconds,
        "copy_read_TBps": 2 * n / copy_seconds / TB,
        "select_over_copy": copy_seconds / seconds,
        "fused_apply_seconds": fused_seconds,
        "fused_apply_base_GBps": 2 * n / fused_seconds / 1e9,
        "fused_apply_fingerprint_exact": fused_exact,
    }


# -- driver --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")), help="folder for the JSON")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the NumPy twin (no GPU)")
    parser.add_argument("--no-tests", dest="tests", action="store_false", help="skip pytest -m gpu")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement")
    parser.add_argument("--diff-elements", type=int, default=None, help="elements of the diff benchmark")
    parser.add_argument("--select-elements", type=int, default=None, help="elements of the select benchmark")
    args = parser.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("bench_gpu_dry_run.json" if args.dry_run else "bench_gpu.json")
    report: dict[str, Any] = {"dry_run": args.dry_run, "python": platform.python_version(), "errors": {}}

    def save() -> None:
        path.write_text(json.dumps(report, indent=2, default=float) + "\n", encoding="utf-8")

    def section(name: str, fn: Callable[[], Any]) -> None:
        started = time.perf_counter()
        try:
            report[name] = fn()
        except Exception:
            report["errors"][name] = traceback.format_exc()
        print(f"{name}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
        save()

    if args.tests:
        section("tests", run_tests)
    try:
        device = Device(args.dry_run)
    except Exception:
        report["errors"]["device"] = traceback.format_exc()
        save()
        return 1
    report["device"] = device.name
    if not args.dry_run:
        import cupy

        report["cupy"] = cupy.__version__
    n = args.diff_elements or (1_000_003 if args.dry_run else 3_000_000_000)
    section("diff", lambda: bench_diff(device, n, args.reps))
    dims = TOY if args.dry_run else LLAMA3_8B
    both: dict[str, Any] = {}

    def publish() -> Any:
        both["publish"], both["apply"] = bench_publish_and_apply(device, dims, min(args.reps, 3))
        return both["publish"]

    section("publish", publish)
    if "apply" in both:
        report["apply"] = both["apply"]
    select_n = args.select_elements or (1_000_003 if args.dry_run else 1_000_000_000)
    section("select", lambda: bench_select(device, select_n, 0.0035, args.reps))
    save()
    print(json.dumps(report, indent=2, default=float))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
