#!/usr/bin/env python
"""Publisher memory and time on Llama-shaped BF16 checkpoints, next to ``save_file``.

    .venv/bin/python scripts/bench_publish.py                  # 0.5 and 2 GB
    .venv/bin/python scripts/bench_publish.py --sizes 0.5 --json out.json

For each size, two versions of an HF folder (safetensors shards of 512 MiB, a tied
embedding of 32000 x hidden, GQA attention, SwiGLU MLP) are built once under
``--cache`` (the second changes 0.4% of the elements by one BF16 step, as an Adam step
at a small learning rate does), then each publish runs in a fresh process on a local
directory store:

- ``python``: the caller loads version 1 into torch BF16 tensors, ``Publisher.publish``
  it (a keyframe), copies version 2 into the same tensors in place, publishes again (a
  patch); ``publish_async`` of version 2 in a third run (memory to its flush; the time
  it took to return, when the caller may touch its tensors again, is printed apart);
- ``cli``: ``bulletin publish DIR`` of version 1, then of version 2 in a new process
  (what a trainer that writes checkpoints and calls the CLI pays per version).

Memory is the process's peak anonymous memory (``RssAnon`` of /proc/self/status,
sampled every 2 ms by :class:`scripts._common.MemoryPeak` while the publish runs) beyond
a baseline, as a multiple of the model's size:

- ``python``: the baseline is ``RssAnon`` once the imports are done and the caller's
  tensors are loaded, before the ``Publisher`` exists. The tensors are private copies
  (anonymous memory, as a trainer holds its weights), and version 2 is copied into them
  in place, which adds no memory; so what the publisher keeps between versions counts.
  This is the quantity ``scripts/bench_scale.py`` prints for its Python child, measured
  the same way (it samples from its parent every 10 ms and adds ``RssShmem``, which is
  zero here: nothing Bulletin maps is shared memory or tmpfs unless the store or cache
  directory is on tmpfs);
- ``cli``: the baseline is ``RssAnon`` when ``bulletin.cli.main`` is called, its modules
  imported.

The checkpoint folders and the publisher's cache are read through memory maps: file
pages, not counted. The baseline of time is ``safetensors.torch.save_file`` of version
2 from the same in-memory tensors, fsynced, in the same run: the issue's target is a
patch publish no slower than it and <= 0.25x the model in anonymous memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

import numpy as np

ROOT: Final = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bulletin.checkpoint import (  # noqa: E402
    INDEX_NAME,
    Checkpoint,
    encode_safetensors_header,
    hf_index,
    plan_checkpoint,
)
from patcher.patch import TensorSpec  # noqa: E402

CHANGED: Final = 0.004
SHARD_BYTES: Final = 512 << 20


def llama_specs(gigabytes: float) -> dict[str, TensorSpec]:
    """A Llama-shaped BF16 model of about ``gigabytes`` (tied embedding, GQA 4:1, SwiGLU)."""
    hidden = 1024 if gigabytes < 1 else 2048
    inter, vocab, kv = int(hidden * 2.75) // 64 * 64, 32000, hidden // 4
    per_layer = 2 * hidden * hidden + 2 * kv * hidden + 3 * inter * hidden + 2 * hidden
    layers = max(1, round((gigabytes * 1e9 / 2 - vocab * hidden) / per_layer))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    return {name: TensorSpec(name, "BF16", shape) for name, shape in shapes.items()}


def _write_folder(folder: Path, specs: dict[str, TensorSpec], bits_of: Any) -> None:
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=folder.parent))
    plan = plan_checkpoint(specs, SHARD_BYTES)
    for file_name, shard in plan:
        header, _ = encode_safetensors_header(shard, {"format": "pt"})
        with open(staging / file_name, "wb") as fh:
            fh.write(header)
            for spec in shard:
                fh.write(np.ascontiguousarray(bits_of(spec)).tobytes())
    if len(plan) > 1:
        (staging / INDEX_NAME).write_bytes(hf_index(plan))
    (staging / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    staging.rename(folder)


def build(cache: Path, gigabytes: float) -> tuple[Path, Path, int]:
    """The two versions' folders (built unless cached) and the model's size in bytes."""
    specs = llama_specs(gigabytes)
    root = cache / f"llama-{gigabytes:g}gb"
    first, second = root / "v1", root / "v2"
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    if not first.is_dir():

        def random_bits(spec: TensorSpec) -> np.ndarray:
            values = (rng.standard_normal(spec.shape, dtype=np.float32) * 0.02).view(np.uint32)
            return (values >> 16).astype(np.uint16)

        _write_folder(first, specs, random_bits)
    if not second.is_dir():
        with Checkpoint(first) as ckpt:

            def stepped(spec: TensorSpec) -> np.ndarray:
                bits = np.array(ckpt.bits(spec.name), copy=True).reshape(-1)
                where = rng.choice(bits.size, size=max(1, int(bits.size * CHANGED)), replace=False)
                bits[where] += rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), size=where.size)
                return bits

            _write_folder(second, specs, stepped)
    return first, second, sum(s.nbytes for s in specs.values())


# -- children: one publish each, in a fresh process ------------------------------------------


def _torch_state(folder: Path) -> dict[str, Any]:
    import torch

    with Checkpoint(folder) as ckpt:
        return {n: torch.from_numpy(np.array(ckpt.bits(n)).view(np.int16)).view(torch.bfloat16) for n in ckpt}


def _overwrite(state: dict[str, Any], folder: Path) -> None:
    import torch

    with Checkpoint(folder) as ckpt:
        for name, tensor in state.items():
            tensor.view(torch.int16).copy_(torch.from_numpy(np.asarray(ckpt.bits(name)).view(np.int16)))


def child(mode: str, store: str, folders: list[Path], cache_dir: str | None) -> dict[str, Any]:
    from scripts._common import MemoryPeak, memory_status

    out: dict[str, Any] = {}
    if mode in ("python", "python-async"):
        from bulletin import Publisher

        kwargs: dict[str, Any] = {"cache_dir": cache_dir} if cache_dir else {}
        state = _torch_state(folders[0])
        tensors = memory_status()["RssAnon"]  # the caller's own: what "beyond" is measured from
        pub = Publisher(store, "bench", keyframe_every=1000, **kwargs)
        for phase, folder in (("keyframe", None), ("patch", folders[1])):
            if folder is not None:
                _overwrite(state, folder)
            t0 = time.perf_counter()
            with MemoryPeak() as peak:
                if mode == "python-async" and phase == "patch":
                    pub.publish_async(state)
                    out["async_return_s"] = time.perf_counter() - t0
                    pub.flush()
                else:
                    pub.publish(state)
            # Beyond the caller's tensors, so what the publisher keeps between versions counts.
            out[phase] = {"seconds": time.perf_counter() - t0, "anon_beyond": peak.anon - tensors}
        pub.close()
    elif mode == "cli":
        import contextlib
        import io

        from bulletin.cli import main

        args = [str(folders[0]), "--store", store, "--run", "bench", "--keyframe-every", "1000", "--json"]
        if cache_dir:
            args += ["--cache-dir", cache_dir]
        t0 = time.perf_counter()
        printed = io.StringIO()
        with MemoryPeak() as peak, contextlib.redirect_stdout(printed):
            code = main(["publish", *args])
        if code:
            raise SystemExit(printed.getvalue())
        out["publish"] = {"seconds": time.perf_counter() - t0, "anon_beyond": peak.beyond, "cli": printed.getvalue()}
    elif mode == "save_file":
        import torch
        from safetensors.torch import save_file

        state = _torch_state(folders[0])
        target = Path(store) / "baseline.safetensors"
        t0 = time.perf_counter()
        save_file(state, str(target))
        fd = os.open(target, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        out["save_file"] = {"seconds": time.perf_counter() - t0}
        del torch
    return out


def _spawn(mode: str, store: str, folders: list[Path], cache_dir: str | None) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", mode, "--store", store, *map(str, folders)]
    if cache_dir:
        argv += ["--cache-dir", cache_dir]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run_size(gigabytes: float, cache: Path, work: Path, with_cache_dir: bool) -> dict[str, Any]:
    first, second, size = build(cache, gigabytes)
    out: dict[str, Any] = {"size_gb": gigabytes, "model_bytes": size}
    for mode in ("python", "python-async"):
        store = tempfile.mkdtemp(dir=work)
        cache_dir = tempfile.mkdtemp(dir=work) if with_cache_dir else None
        out[mode] = _spawn(mode, store, [first, second], cache_dir)
        shutil.rmtree(store)
        if cache_dir:
            shutil.rmtree(cache_dir)
    store = tempfile.mkdtemp(dir=work)
    cache_dir = tempfile.mkdtemp(dir=work) if with_cache_dir else None
    out["cli-keyframe"] = _spawn("cli", store, [first], cache_dir)["publish"]
    out["cli-patch"] = _spawn("cli", store, [second], cache_dir)["publish"]
    shutil.rmtree(store)
    if cache_dir:
        shutil.rmtree(cache_dir)
    baseline = tempfile.mkdtemp(dir=work)
    out["save_file"] = _spawn("save_file", baseline, [second], None)["save_file"]
    shutil.rmtree(baseline)
    return out


def report(results: list[dict[str, Any]]) -> None:
    print(f"{'size':>6} {'what':<22} {'seconds':>8} {'anon beyond':>12} {'x model':>8} {'/ save_file':>11}")
    for r in results:
        size, base = r["model_bytes"], r["save_file"]["seconds"]
        rows = [
            ("python keyframe", r["python"]["keyframe"]),
            ("python patch", r["python"]["patch"]),
            ("python async patch", r["python-async"]["patch"]),
            ("cli keyframe", r["cli-keyframe"]),
            ("cli patch", r["cli-patch"]),
        ]
        for what, m in rows:
            print(
                f"{r['size_gb']:>5g}G {what:<22} {m['seconds']:>8.2f} {m['anon_beyond'] / 2**20:>10.0f}Mi "
                f"{m['anon_beyond'] / size:>8.2f} {m['seconds'] / base:>11.2f}"
            )
        print(f"{r['size_gb']:>5g}G {'save_file (fsynced)':<22} {base:>8.2f}")
        returned = r["python-async"]["async_return_s"]
        print(
            f"{r['size_gb']:>5g}G {'async returned after':<22} {returned:>8.2f} "
            f"({returned / r['python']['patch']['seconds']:.2f}x the python patch publish)"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.5,2", help="model sizes in GB, comma-separated")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/bulletin-bench-publish"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--no-cache-dir", action="store_true", help="do not pass cache_dir (the code before it)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--store", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("folders", nargs="*", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.store, args.folders, args.cache_dir)))
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench-publish-", dir=args.cache.parent))
    try:
        results = [
            run_size(float(s), args.cache, work, not args.no_cache_dir) for s in args.sizes.split(",") if s.strip()
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
