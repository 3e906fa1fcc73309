"""Sharded publishing: per-rank peak memory and publish time for 1, 2 and 4 ranks on the
same model, next to gathering the whole model to rank 0 and publishing it there with the
plain ``Publisher`` (what a sharded trainer does without ``ShardedPublisher``), measured
in the same run.

    python scripts/bench_sharded.py [--params 16e6] [--hidden 512] [--worlds 1,2,4] [--steps 3]
                                    [--modes sharded,gather]

Every job is fresh processes (gloo over a file store, local-directory store). The model:
Llama-shaped FP32 matrices split by rows across ranks (FSDP2's ``Shard(0)``), each rank
generating only its own rows (values are a function of the global index); each step
moves 0.4% of the elements by about 1%. Version 1 is a keyframe, the rest patches.
Memory is each rank's peak resident set during a publish (VmHWM after ``clear_refs``)
against the 2 bytes per BF16 element of the rank's shard: the working set (the peak above
what the rank held when the step began) plus the kept bits held then, the pages of the
publisher's cache folder mapped by the process (their Rss in ``/proc/self/smaps``). Patch
versions are reported (max over versions 2..; the working set over versions 3.., as
version 2 also maps the kept bits in), and the keyframe step (which makes the kept
bits, and receives the blocks of the keyframe files it writes, one at a time). The
baseline's rank 0 also holds the gathered FP32 model.
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
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _mapped(folder: str) -> int:
    """Bytes resident in this process's mappings of files under ``folder``."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and not head[0].endswith(":"):  # a mapping's first line: range perms offset dev inode [path]
            inside = len(head) > 5 and head[5].startswith(folder)
        elif inside and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _shapes(params: float, hidden: int) -> dict[str, tuple[int, int]]:
    layers = max(1, int(params / (12 * hidden * hidden)))
    shapes: dict[str, tuple[int, int]] = {}
    for i in range(layers):
        shapes[f"model.layers.{i}.self_attn.qkv.weight"] = (3 * hidden, hidden)
        shapes[f"model.layers.{i}.self_attn.o_proj.weight"] = (hidden, hidden)
        shapes[f"model.layers.{i}.mlp.gate_up.weight"] = (8 * hidden, hidden)
    return shapes


def _block(shape: tuple[int, int], rank: int, world: int, step: int) -> tuple[np.ndarray, int]:
    rows = shape[0] // world
    lo = rank * rows
    idx = np.arange(lo * shape[1], (lo + rows) * shape[1], dtype=np.int64)
    value = np.sin(idx * 0.7311).astype(np.float32)
    for s in range(1, step + 1):
        moved = (idx * 2654435761 + s * 40503) % 250 == 0  # 0.4% of the elements per step
        value[moved] *= np.float32(1.01)
    return value.reshape(rows, shape[1]), lo


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from bulletin import Publisher
    from bulletin.distributed import LocalShard, ShardedPublisher

    torch.set_num_threads(1)
    rank, world = args.rank, args.world
    dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=rank, world_size=world)
    shapes = _shapes(args.params, args.hidden)
    report: dict[str, Any] = {"mode": args.mode, "world": world, "rank": rank, "steps": []}
    sharded = ShardedPublisher(args.store, "bench", keyframe_every=1000) if args.mode == "sharded" else None
    plain = Publisher(args.store, "bench", keyframe_every=1000) if args.mode == "gather" and rank == 0 else None
    shard_elements = 0
    cache = os.environ["BULLETIN_CACHE_DIR"]
    for step in range(args.steps):
        blocks = {name: _block(shape, rank, world, step) for name, shape in shapes.items()}
        shard_elements = sum(b.size for b, _ in blocks.values())
        dist.barrier()
        rss, kept = _status("VmRSS"), _mapped(cache)
        _reset_peak()
        wall, cpu = time.perf_counter(), time.process_time()
        if sharded is not None:
            sharded.publish({n: LocalShard(b, shapes[n], (lo, 0)) for n, (b, lo) in blocks.items()})
        else:
            gathered: dict[str, Any] = {}
            for name, (b, _) in blocks.items():  # all-gather of every tensor's rows to rank 0
                t = torch.from_numpy(b)
                parts = [torch.empty_like(t) for _ in range(world)] if rank == 0 else None
                dist.gather(t, parts, dst=0)
                if rank == 0:
                    assert parts is not None
                    gathered[name] = torch.cat(parts)
            if plain is not None:
                plain.publish(gathered)
            del gathered
        dist.barrier()
        report["steps"].append(
            {
                "wall_s": time.perf_counter() - wall,
                "cpu_s": time.process_time() - cpu,
                "peak_extra_bytes": _status("VmHWM") - rss + kept,
                "working_bytes": _status("VmHWM") - rss,
            }
        )
    report["shard_bf16_bytes"] = 2 * shard_elements
    if sharded is not None:
        sharded.close()
    if plain is not None:
        plain.close()
    dist.destroy_process_group()
    print(json.dumps(report))


def job(mode: str, world: int, args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    folder.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BULLETIN_CACHE_DIR": str(folder / "cache")}
    command = [sys.executable, __file__, "--rank", "{rank}", "--world", str(world), "--mode", mode]
    command += ["--init", str(folder / "init"), "--store", str(folder / "store")]
    command += ["--params", str(args.params), "--hidden", str(args.hidden), "--steps", str(args.steps)]
    procs = [
        subprocess.Popen([c.format(rank=r) for c in command], cwd=ROOT, env=env, stdout=subprocess.PIPE)
        for r in range(world)
    ]
    out = []
    for proc in procs:
        stdout, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"{mode} world {world}: a rank exited {proc.returncode}")
        out.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=16e6)
    parser.add_argument(
        "--hidden",
        type=int,
        default=512,
        help="the model's hidden size: with --params, how many tensors (3 a layer) and how large",
    )
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", default="sharded,gather", help="which jobs: sharded, gather (the baseline), or both")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int)
    parser.add_argument("--mode", choices=("sharded", "gather"))
    parser.add_argument("--init")
    parser.add_argument("--store")
    args = parser.parse_args()
    if args.hidden < 8:
        parser.error("--hidden must be >= 8")
    if args.rank is not None:
        rank_main(args)
        return
    shapes = _shapes(args.params, args.hidden)
    total = sum(a * b for a, b in shapes.values())
    print(
        f"model: {total / 1e6:.1f}M FP32 parameters in {len(shapes)} tensors (hidden {args.hidden}; "
        f"{2 * total / 2**20:.0f} MiB served as BF16), {args.steps} steps"
    )
    print(
        "mode     world  keyframe wall  patch wall  patch CPU/rank  "
        "patch peak/rank, kept bits + working set (x its BF16 shard): max, mean, rank 0; "
        "working set max (versions 3..)  keyframe peak max"
    )
    reference: float | None = None
    with tempfile.TemporaryDirectory(prefix="bench-sharded-") as scratch:
        for world in (int(w) for w in args.worlds.split(",")):
            for mode in (m for m in ("sharded", "gather") if m in args.modes.split(",")):
                os.sync()  # the job before's writes flushed now, not during this job's fsyncs
                reports = job(mode, world, args, Path(scratch) / f"{mode}-{world}")
                # Its store and caches go (and their pages with them): every job starts
                # with the same free memory, not the page cache of the jobs before.
                shutil.rmtree(Path(scratch) / f"{mode}-{world}")
                key = [max(r["steps"][0]["wall_s"] for r in reports)]
                patch_wall = np.mean([max(r["steps"][s]["wall_s"] for r in reports) for s in range(1, args.steps)])
                patch_cpu = np.mean([r["steps"][s]["cpu_s"] for r in reports for s in range(1, args.steps)])
                ratios = [max(s["peak_extra_bytes"] for s in r["steps"][1:]) / r["shard_bf16_bytes"] for r in reports]
                # The first patch step also maps the kept bits in: the working set of the steps after it.
                later = slice(2, None) if args.steps > 2 else slice(1, None)
                working = max(s["working_bytes"] / r["shard_bf16_bytes"] for r in reports for s in r["steps"][later])
                kf = max(r["steps"][0]["peak_extra_bytes"] / r["shard_bf16_bytes"] for r in reports)
                if mode == "sharded" and world == 1:
                    reference = float(patch_wall)
                speed = f"{reference / patch_wall:.2f}x of 1 rank" if reference else ""
                print(
                    f"{mode:8} {world:5}  {key[0]:12.2f}s  {patch_wall:9.2f}s  {patch_cpu:13.2f}s  "
                    f"{max(ratios):.2f}x  {np.mean(ratios):.2f}x  {ratios[0]:.2f}x; {working:.2f}x  {kf:.2f}x  {speed}"
                )


if __name__ == "__main__":
    main()
