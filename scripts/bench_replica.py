"""What a rollout node's replica folder costs per version: memory of a catch-up, disk writes.

    python scripts/bench_replica.py [--elements 25000000] [--changed 0.004] [--behind 1,10,30]

A run of one BF16 model (``--elements`` elements in a few Llama-like tensors, ``--changed``
of them changed per version, scattered) is published to a local store; then, for each
number of versions behind, a node folder (``LocalDirTarget``) at version 1 syncs to 1+k:

- **catch-up working set**: the peak of Python/NumPy allocations (``tracemalloc``: the
  anonymous memory a sync adds; the replica's files are memory-mapped and not counted)
  with the bounded fold (``bulletin.sync.FOLD_BATCH_BYTES``) and, as the baseline in
  the same run, with every version decoded before one fold (what sync did before);
- **disk writes per applied version**: ``write_bytes`` of ``/proc/self/io`` (bytes this
  process made the kernel write, page dirtying included) for the dense layout
  (``LocalDirTarget``) and the log layout (``LogDirTarget``, docs/FORMAT.md 9.1), one
  version at a time, against the patch's size; the log layout's compaction (a new base)
  is measured apart and amortised over the versions between two compactions.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bulletin.sync
from bulletin import Publisher, Subscriber
from bulletin.checkpoint import write_checkpoint
from bulletin.replica_log import DEFAULT_COMPACT_SHARE, LogDirTarget
from bulletin.run import Run
from bulletin.storage import open_store
from patcher.patch import TensorSpec


def layout(elements: int, layers: int = 16) -> dict[str, TensorSpec]:
    """Llama-like proportions: an embedding (a tenth), then ``layers`` layers of attention
    and MLP matrices (q, k, v, o: 1 share each; gate, up, down: 2.75) and their norms."""
    hidden = 1024
    shares = {"self_attn.q_proj": 1, "self_attn.k_proj": 1, "self_attn.v_proj": 1, "self_attn.o_proj": 1}
    shares |= {"mlp.gate_proj": 2.75, "mlp.up_proj": 2.75, "mlp.down_proj": 2.75}
    unit = 0.9 * elements / (layers * sum(shares.values()))
    specs = {
        "model.embed_tokens.weight": TensorSpec(
            "model.embed_tokens.weight", "BF16", (int(0.1 * elements) // hidden, hidden)
        )
    }
    for i in range(layers):
        for part, share in shares.items():
            name = f"model.layers.{i}.{part}.weight"
            specs[name] = TensorSpec(name, "BF16", (max(1, int(unit * share) // hidden), hidden))
        name = f"model.layers.{i}.input_layernorm.weight"
        specs[name] = TensorSpec(name, "BF16", (hidden,))
    return specs


def step(rng: np.random.Generator, bits: dict[str, NDArray[np.uint16]], share: float) -> None:
    """Change ``share`` of the elements of every matrix, scattered (norms stay)."""
    for name, b in bits.items():
        if "norm" in name:
            continue
        flat = b.reshape(-1)
        idx = rng.choice(flat.size, size=max(1, int(flat.size * share)), replace=False)
        flat[idx] += rng.integers(1, 4, size=idx.size, dtype=np.uint16)


def publish(store: Path, work: Path, specs: dict[str, TensorSpec], versions: int, share: float) -> list[int]:
    """Versions 1..versions (keyframe 1 only); the patch bytes of each."""
    rng = np.random.default_rng(0)
    bits = {n: rng.integers(0, 1 << 16, size=s.shape, dtype=np.uint16) for n, s in specs.items()}
    folder = work / "ckpt"
    with Publisher(str(store), "run", keyframe_every=10_000) as pub:
        for version in range(1, versions + 1):
            if version > 1:
                step(rng, bits, share)
            write_checkpoint(folder, specs, bits)
            assert pub.publish_checkpoint(folder).version == version
    shutil.rmtree(folder)
    run = Run(open_store(str(store)), "run")
    return [run.read_manifest(v).manifest.stats.patch_bytes for v in range(1, versions + 1)]


def write_bytes() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("no write_bytes in /proc/self/io")


@contextlib.contextmanager
def fold_bounds(batch_bytes: int, round_share: float) -> Iterator[None]:
    saved = bulletin.sync.FOLD_BATCH_BYTES, bulletin.sync.ROUND_SHARE
    bulletin.sync.FOLD_BATCH_BYTES, bulletin.sync.ROUND_SHARE = batch_bytes, round_share
    try:
        yield
    finally:
        bulletin.sync.FOLD_BATCH_BYTES, bulletin.sync.ROUND_SHARE = saved


def catch_up_peak(store: Path, template: Path, node: Path, version: int) -> int:
    """Peak traced allocation (bytes) of one sync of a copy of ``template`` to ``version``."""
    if node.exists():
        shutil.rmtree(node)
    shutil.copytree(template, node, symlinks=True)
    with Subscriber(str(store), "run", node) as sub:
        tracemalloc.start()
        try:
            assert sub.sync(version) == version
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    return peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=25_000_000)
    parser.add_argument("--changed", type=float, default=0.004)
    parser.add_argument("--behind", default="1,10,30")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument(
        "--fold-batch-mib",
        type=float,
        default=None,
        help="FOLD_BATCH_BYTES for the bounded runs (default: scaled from 16 MiB per 0.5 GB model)",
    )
    args = parser.parse_args()
    behind = [int(k) for k in args.behind.split(",")]
    specs = layout(args.elements)
    numel = sum(s.numel for s in specs.values())
    model_bytes = sum(s.nbytes for s in specs.values())
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        store = work / "store"
        t0 = time.perf_counter()
        patch_bytes = publish(store, work, specs, 1 + max(behind), args.changed)
        print(
            f"model: {numel / 1e6:.1f} M BF16 elements ({model_bytes / 2**20:.0f} MiB), "
            f"{args.changed:.2%} changed per version; published {1 + max(behind)} versions "
            f"in {time.perf_counter() - t0:.1f}s; mean patch {np.mean(patch_bytes[1:]) / 2**20:.2f} MiB"
        )
        template = work / "template"
        with Subscriber(str(store), "run", template) as sub:
            sub.sync(1)
        node = work / "node"
        changed = int(numel * args.changed)
        print("\ncatch-up working set (tracemalloc peak), node folder at version 1:")
        batch = int((args.fold_batch_mib or 16 * model_bytes / 0.5e9) * 2**20)
        print(
            f"bounded: FOLD_BATCH_BYTES {batch / 2**20:.1f} MiB, ROUND_SHARE {bulletin.sync.ROUND_SHARE}; "
            "before: every version decoded, one fold, one apply"
        )
        print(
            f"{'behind':>6}  {'bounded fold':>14}  {'one fold (before)':>18}  {'ratio':>6}  "
            f"{'bytes/changed/version':>22}  {'x model':>8}"
        )
        for k in behind:
            with fold_bounds(batch, bulletin.sync.ROUND_SHARE):
                bounded = catch_up_peak(store, template, node, 1 + k)
            with fold_bounds(1 << 62, float("inf")):
                before = catch_up_peak(store, template, node, 1 + k)
            print(
                f"{k:>6}  {bounded / 2**20:>11.1f} MiB  {before / 2**20:>15.1f} MiB  {bounded / before:>6.2f}  "
                f"{bounded / (changed * k):>10.1f} (before {before / (changed * k):.1f})  "
                f"{bounded / model_bytes:>8.3f}"
            )
        print("\ndisk writes per applied version, one version at a time (/proc/self/io write_bytes):")
        if node.exists():
            shutil.rmtree(node)
        shutil.copytree(template, node, symlinks=True)
        written = []
        with Subscriber(str(store), "run", node) as sub:
            for version in range(2, 2 + min(10, max(behind))):
                before = write_bytes()
                assert sub.sync(version) == version
                written.append(write_bytes() - before)
        mean_patch = float(np.mean(patch_bytes[1 : 1 + len(written)]))
        mean = float(np.mean(written))
        print(
            f"dense replica (LocalDirTarget): {mean / 2**20:.1f} MiB per version = {mean / mean_patch:.0f}x the patch "
            f"({mean_patch / 2**20:.2f} MiB), {mean / model_bytes:.2f}x the model; target <= 3x the patch + a constant"
        )
        # The log layout, from the same folder at version 1 (it becomes the base): no
        # compaction during the versions (share 1.0), then one compaction, measured apart.
        shutil.rmtree(node)
        shutil.copytree(template, node, symlinks=True)
        logged = []
        target = LogDirTarget(node, run="run", compact_share=1.0)
        with Subscriber(str(store), "run", target=target) as sub:
            for version in range(2, 2 + len(written)):
                before = write_bytes()
                assert sub.sync(version) == version
                logged.append(write_bytes() - before)
            overlay = target.overlay_elements
            before = write_bytes()
            target.compact()
            compaction = write_bytes() - before
        mean_log = float(np.mean(logged))
        constant = 64 << 10  # state.json and directory entries: about 60 bytes per tensor
        # Versions between two compactions at the default share, from the overlay's growth.
        per_version = overlay / len(logged)
        every = max(1.0, DEFAULT_COMPACT_SHARE * numel / per_version)
        print(
            f"log replica (LogDirTarget): {mean_log / 2**20:.2f} MiB per version = "
            f"{mean_log / mean_patch:.2f}x the patch, {mean_log / mean:.4f}x dense; "
            f"(written - 64 KiB) / patch = {(mean_log - constant) / mean_patch:.2f} "
            f"(target <= 3): {'met' if mean_log <= 3 * mean_patch + constant else 'MISSED'}"
        )
        print(
            f"  compaction (apart): {compaction / 2**20:.1f} MiB = {compaction / model_bytes:.2f}x the model, "
            f"about every {every:.0f} versions at compact_share {DEFAULT_COMPACT_SHARE} "
            f"(overlay grows {per_version / numel:.3%} of the elements per version): "
            f"amortised {compaction / every / 2**20:.2f} MiB per version = "
            f"{compaction / every / mean_patch:.1f}x the patch"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
