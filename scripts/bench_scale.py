#!/usr/bin/env python
"""Benchmark of Bulletin at model scale: memory, time, disk and store bytes per operation.

    .venv/bin/python scripts/bench_scale.py                          # 0.5 and 2 GB, local store
    .venv/bin/python scripts/bench_scale.py --sizes 0.5,2,6 --json out.json
    .venv/bin/python scripts/bench_scale.py --sizes 0.5 --s3 auto     # a private LocalStack
    .venv/bin/python scripts/bench_scale.py --s3 http://127.0.0.1:4566 --stores local,s3

Models: Llama-shaped BF16 Hugging Face folders (sharded safetensors, the index,
``config.json``) of about the sizes asked for (GB, 10^9 bytes), drawn with NumPy from a
fixed seed (weights N(0, 0.02), norms 1). Version k+1 changes 0.4% of the elements of
version k (``--changed``), each by one BF16 unit in the last place up or down: what an
Adam step at a fine-tuning learning rate does to BF16 weights. Versions 1 and 2 are
written once as folders under ``--cache`` and reused; later versions are applied in
memory by the process that publishes them.

Each operation runs in a fresh subprocess (its own session), so that its figures are its
own:

- **time**: wall clock of the process (CLI commands, ``cp``), or of the measured phase
  inside a Python child (the Python ``Publisher``, ``save_file``, boto3) without its
  imports and loading;
- **anon**: peak anonymous memory (``RssAnon`` + ``RssShmem`` of /proc/<pid>/status,
  summed over the process's session), sampled every ``--sample-ms``; printed beyond a
  baseline. For a Python child the baseline is the child's anonymous memory once its
  imports are done and the caller's tensors are loaded, before the ``Publisher`` exists:
  the tensors are copied out of ``load_file``'s memory maps into anonymous memory, as a
  trainer holds them, so the in-place update between versions adds nothing, and what
  the publisher keeps between versions counts (the same quantity, measured the same way,
  as ``scripts/bench_publish.py``). For a CLI command the baseline is the interpreter
  with Bulletin's CLI modules imported (the ``idle`` line); the folder it publishes is
  read through memory maps, file pages, not counted. Memory cgroups are not used: on
  this machine they belong to the sandbox that runs the session;
- **VmHWM**: peak resident set, file pages included: the kernel's own high-water mark
  (``ru_maxrss`` of the process from wait4, or VmHWM reset at the start of a phase);
- **disk**: bytes read from and written to block devices: ``ru_inblock``/``ru_oublock``
  of wait4 (the process and every descendant it waited for; the kernel's
  /proc/<pid>/io ``read_bytes`` and ``write_bytes - cancelled_write_bytes``), or the
  difference of /proc/self/io across a phase. Writes count when a page is dirtied, so a
  scattered change to a file counts its whole 4 KiB page; reads served from the page
  cache count nothing (the folders are usually cached: they were just written). With
  ``--layout log``, a catch-up's writes per version leave out the compactions it ran
  (new bases, as ``bulletin sync --json`` reports them under ``written``), printed
  apart, amortised over its versions;
- **store**: on S3, bytes on the wire both ways through a counting TCP proxy in front of
  the server (HTTP included, every operation, the boto3 baselines too); on the local
  store, for the Python ``Publisher`` its ``CountingStore`` (payload bytes), for the CLI
  the bytes of the files a command created or replaced in the store directory (up) and
  the ``bytes_downloaded`` the ``sync`` command reports (down).

Operations, for each size and store: ``bulletin publish DIR`` of version 1 (keyframe)
and 2 (patch), the Python ``Publisher`` publishing the same two versions from a state
dict of torch tensors loaded from the folder (one process, as a trainer holds it),
``bulletin sync --to NODE`` of a fresh node, then catch-ups of 1 and of ``--catch-up``
versions (published first, not measured, with the Python ``Publisher``). Baselines in
the same run: ``cp -r`` + fsync of the version-1 folder, ``safetensors.torch.save_file``
of version 2 (fsynced; the patch publish's target) and, on S3, boto3 ``upload_file`` /
``download_file`` of the same files with ``TransferConfig()`` defaults. Ratios are
Bulletin / baseline (above 1.0: Bulletin is slower); memory is a multiple of the model's
size. The targets of issue 11 are printed next to each figure with PASS / FAIL.

Memory guard: a process is killed (SIGKILL to its session) when the machine's
``MemAvailable`` falls under ``--reserve-gb`` or its anonymous memory passes
``--max-anon-gb``; it is then reported as "did not complete" with the peak it reached,
and the operations that needed it are skipped. The run keyframes every
``--keyframe-every`` versions (default 1000), so that catch-ups fold patches. The
publishers' cache of the last published bits (``BULLETIN_CACHE_DIR``) lives in the
scratch directory and goes with it. The header names the git commit measured and whether
the working tree differed from it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

ROOT: Final = Path(__file__).resolve().parents[1]
#: Bumped whenever a change here changes the bits of a generated folder (invalidates caches).
GENERATOR_VERSION: Final = 1
GB: Final = 10**9
MB: Final = 10**6
#: Issue 11's targets.
MEMORY_TARGET: Final = 0.25  # anonymous memory beyond the caller's tensors, x the model
KEYFRAME_TIME_TARGET: Final = 1.2  # keyframe publish and fresh sync, x plain copies / boto3
PATCH_TIME_TARGET: Final = 1.0  # patch publish, x save_file + fsync
WRITES_PER_PATCH_TARGET: Final = 3.0  # disk writes per applied version, x the patch (+ a constant)


# -- the model: shapes, generation, deltas -------------------------------------------------


@dataclass(frozen=True)
class Llama:
    """A Llama-shaped decoder: head size 64, a quarter as many KV heads, SwiGLU, untied head."""

    hidden: int
    layers: int
    intermediate: int
    vocab: int

    @property
    def heads(self) -> int:
        return self.hidden // 64

    @property
    def kv_heads(self) -> int:
        return max(1, self.heads // 4)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        h, kv, ff = self.hidden, self.kv_heads * 64, self.intermediate
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (ff, h),
                p + "mlp.up_proj.weight": (ff, h),
                p + "mlp.down_proj.weight": (h, ff),
            }
        return shapes | {"model.norm.weight": (h,), "lm_head.weight": (self.vocab, h)}

    @property
    def nbytes(self) -> int:
        return 2 * sum(math.prod(s) for s in self.shapes().values())

    def config(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "vocab_size": self.vocab,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }

    @classmethod
    def of_size(cls, nbytes: float) -> Llama:
        """The shape nearest ``nbytes`` of BF16: layers = hidden / 128 (as Llama 2 7B,
        Llama 3.2 1B), SwiGLU width 8/3 of the hidden size rounded up to 256."""
        vocab = 32_000 if nbytes >= 200 * MB else 4_096
        best: Llama | None = None
        for hidden in range(128, 16_384 + 1, 128):
            model = cls(hidden, max(2, hidden // 128), -(-hidden * 8 // 3 // 256) * 256, vocab)
            if best is None or abs(model.nbytes - nbytes) < abs(best.nbytes - nbytes):
                best = model
            if model.nbytes > nbytes:
                break
        assert best is not None
        return best


def _bf16(values: NDArray[np.float32]) -> NDArray[np.uint16]:
    """Round to nearest even, as torch casts to BF16 (no NaNs here)."""
    u = values.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def initial_bits(name: str, shape: tuple[int, ...], index: int, seed: int) -> Iterator[NDArray[np.uint16]]:
    """Version 1 of one tensor, in chunks of at most 16M elements (bounded memory)."""
    n = math.prod(shape)
    if name.endswith("norm.weight"):
        yield np.full(n, 0x3F80, dtype=np.uint16)  # 1.0
        return
    rng = np.random.default_rng([seed, 0, index])
    for start in range(0, n, 1 << 24):
        chunk = rng.standard_normal(min(1 << 24, n - start), dtype=np.float32)
        chunk *= 0.02
        yield _bf16(chunk)


def apply_delta(bits: NDArray[np.uint16], version: int, index: int, share: float, seed: int) -> int:
    """Version ``version`` of tensor ``index`` from version ``version - 1``, in place:
    ``share`` of its elements (drawn with replacement, so a few fewer) move by one BF16
    unit in the last place, up or down. Returns the elements changed."""
    flat = bits.reshape(-1)
    k = round(share * flat.size)
    if k == 0:
        return 0
    rng = np.random.default_rng([seed, version, index])
    at = np.unique(rng.integers(0, flat.size, size=k))
    step = (rng.integers(0, 2, size=at.size, dtype=np.int32) * 2 - 1).astype(np.int16).view(np.uint16)
    flat[at] += step  # wraps: 0xFFFF is -1
    return int(at.size)


# -- safetensors folders -------------------------------------------------------------------


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header and the offset of its data."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def plan_shards(model: Llama, shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in layout order, each shard at most ``shard_bytes`` (or one tensor)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in model.shapes().items():
        size = 2 * math.prod(shape)
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_folder(folder: Path, model: Llama, seed: int, shard_bytes: int) -> None:
    """Version 1 as a Hugging Face folder, streamed tensor by tensor."""
    shapes = model.shapes()
    index = {name: i for i, name in enumerate(shapes)}
    shards = plan_shards(model, shard_bytes)
    weight_map: dict[str, str] = {}
    for n, names in enumerate(shards, 1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in names:
            size = 2 * math.prod(shapes[name])
            header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[name] = file
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with (folder / file).open("wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for name in names:
                for chunk in initial_bits(name, shapes[name], index[name], seed):
                    f.write(chunk.tobytes())
    total = model.nbytes
    index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(model.config(), indent=2) + "\n")


def tensor_views(folder: Path, mode: str = "r") -> Iterator[tuple[str, NDArray[np.uint16]]]:
    """Every BF16 tensor of a folder as a memory map (``mode`` "r" or "r+")."""
    for path in sorted(folder.glob("*.safetensors")):
        header, start = read_header(path)
        mm = np.memmap(path, dtype=np.uint8, mode=mode)  # type: ignore[call-overload]
        for name, info in header.items():
            begin, end = info["data_offsets"]
            yield name, mm[start + begin : start + end].view(np.uint16)
        del mm


def ensure_versions(cache: Path, model: Llama, seed: int, share: float, shard_bytes: int) -> tuple[Path, Path]:
    """Folders of versions 1 and 2 under ``cache``, built once (atomically) and reused."""
    key = (
        f"llama-h{model.hidden}-l{model.layers}-v{model.vocab}-s{seed}-c{share:g}-sh{shard_bytes}-g{GENERATOR_VERSION}"
    )
    base = cache / key
    v1, v2 = base / "v1", base / "v2"
    index = {name: i for i, name in enumerate(model.shapes())}
    for version, folder in ((1, v1), (2, v2)):
        if folder.is_dir():
            continue
        tmp = base / f".v{version}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if version == 1:
            write_folder(tmp, model, seed, shard_bytes)
        else:
            for item in v1.iterdir():
                shutil.copyfile(item, tmp / item.name)
            for name, bits in tensor_views(tmp, "r+"):
                apply_delta(bits, 2, index[name], share, seed)
        for item in tmp.iterdir():
            _fsync(item)
        tmp.rename(folder)
    return v1, v2


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # a directory too
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- children: one operation in a fresh process ---------------------------------------------


def _proc_fields(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """``Name: value`` fields of a /proc file (status: kB, scaled to bytes; io: bytes)."""
    found: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in names:
                parts = rest.split()
                found[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return found


STATUS_FIELDS: Final = ("VmHWM", "VmRSS", "RssAnon", "RssShmem")


class Phases:
    """A Python child's measured phases: seconds, VmHWM, anonymous memory and disk I/O each."""

    def __init__(self) -> None:
        self.done: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[dict[str, Any]]:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from VmRSS
        s0 = _proc_fields("/proc/self/status", STATUS_FIELDS)
        io0 = _proc_fields("/proc/self/io", ("read_bytes", "write_bytes", "cancelled_write_bytes"))
        extra: dict[str, Any] = {}
        t0 = time.monotonic()
        yield extra
        t1 = time.monotonic()
        s1 = _proc_fields("/proc/self/status", STATUS_FIELDS)
        io1 = _proc_fields("/proc/self/io", ("read_bytes", "write_bytes", "cancelled_write_bytes"))
        self.done[name] = {
            "t0": t0,
            "t1": t1,
            "seconds": t1 - t0,
            "hwm": s1.get("VmHWM", 0),
            "anon_start": s0.get("RssAnon", 0) + s0.get("RssShmem", 0),
            "anon_end": s1.get("RssAnon", 0) + s1.get("RssShmem", 0),
            "disk_read": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
            "disk_write": (io1.get("write_bytes", 0) - io1.get("cancelled_write_bytes", 0))
            - (io0.get("write_bytes", 0) - io0.get("cancelled_write_bytes", 0)),
        } | extra


def _anon_now() -> int:
    s = _proc_fields("/proc/self/status", STATUS_FIELDS)
    return s.get("RssAnon", 0) + s.get("RssShmem", 0)


def load_shard(path: Path) -> dict[str, Any]:
    """One shard's tensors in the process's own anonymous memory, as a trainer holds its
    weights. ``load_file`` (safetensors 0.8, its default ``mmap`` backend) returns views of
    a private memory map of the file: file pages until written. The in-place update
    between versions touches nearly every page (0.4% of elements, scattered), and each
    page it touches turns anonymous by copy-on-write after the caller's tensors were
    measured, so the model's size was charged to the patch publish (1.07x at 0.5, 2 and 6 GB
    before this copy)."""
    from safetensors.torch import load_file

    return {name: tensor.clone() for name, tensor in load_file(path).items()}


def load_state(folder: Path) -> dict[str, Any]:
    """A folder's tensors as the Python ``Publisher``'s caller holds them (:func:`load_shard`)."""
    state: dict[str, Any] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_shard(shard))
    return state


def apply_to_state(state: dict[str, Any], version: int, order: list[str], share: float, seed: int) -> None:
    """Version ``version`` of a :func:`load_state` state dict from the one before, in place
    (:func:`apply_delta`; ``order``: the model's tensor names, as indexed there)."""
    import torch

    for i, name in enumerate(order):
        apply_delta(state[name].view(torch.int16).numpy().view(np.uint16), version, i, share, seed)


def _counting(url: str) -> Any:
    from bulletin.storage import open_store
    from bulletin.storage.wrapper import CountingStore

    return CountingStore(open_store(url))


def child(op: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Run one operation here; returns what the parent prints (phases and facts)."""
    phases = Phases()
    info: dict[str, Any] = {}
    if op == "idle":  # what a CLI command holds before it touches a model
        import bulletin.cli
        import bulletin.publisher
        import bulletin.subscriber
        import bulletin.target  # noqa: F401

        with phases.phase("idle"):
            pass
    elif op in {"py-publish", "py-setup"}:
        from bulletin.publisher import Publisher

        order = list(Llama(**spec["model"]).shapes())
        before = _anon_now()
        state = load_state(Path(spec["folder"]))
        info["anon_tensors"] = _anon_now() - before
        info["anon_loaded"] = _anon_now()
        store = _counting(spec["store"])
        pub = Publisher(store, spec["run"], keyframe_every=spec["keyframe_every"])
        for version in spec.get("apply_first", []):
            apply_to_state(state, version, order, spec["share"], spec["seed"])
        results = []
        for n, version in enumerate(spec["versions"]):
            if n or op == "py-setup":
                apply_to_state(state, version, order, spec["share"], spec["seed"])
            store.reset()
            name = spec["phase_names"][n] if op == "py-publish" else f"v{version}"
            with phases.phase(name) as extra:
                got = pub.publish(state, files=spec["folder"] if version == 1 else None)
                traffic = store.reset()
                extra |= {"store_up": traffic.up, "store_down": traffic.down, "version": got}
            result = pub.results[-1]
            results.append(
                {"version": got, "keyframe": result.keyframe, "patch_bytes": result.patch_bytes}
                | {"keyframe_bytes": result.keyframe_bytes, "changed_elements": result.changed_elements}
            )
        pub.close()
        info["results"] = results
    elif op == "save-file":
        from safetensors.torch import save_file

        shards: dict[str, dict[str, Any]] = {}
        before = _anon_now()
        for path in sorted(Path(spec["folder"]).glob("*.safetensors")):
            shards[path.name] = load_shard(path)  # held as the Publisher's caller holds them
        info["anon_tensors"] = _anon_now() - before
        info["anon_loaded"] = _anon_now()
        dst = Path(spec["dst"])
        with phases.phase("save_file"):
            for file, tensors in shards.items():
                save_file(tensors, dst / file, metadata={"format": "pt"})
                _fsync(dst / file)
            _fsync(dst)
    elif op in {"boto3-up", "boto3-down"}:
        import boto3
        from boto3.s3.transfer import TransferConfig

        client = boto3.client("s3", endpoint_url=spec["endpoint"], region_name="us-east-1")
        config = TransferConfig()
        files = sorted(Path(spec["folder"]).iterdir())
        info["anon_loaded"] = _anon_now()
        if op == "boto3-up":
            with phases.phase("upload_file"):
                for path in files:
                    client.upload_file(str(path), spec["bucket"], f"{spec['prefix']}/{path.name}", Config=config)
        else:
            dst = Path(spec["dst"])
            with phases.phase("download_file"):
                for path in files:
                    client.download_file(spec["bucket"], f"{spec['prefix']}/{path.name}", str(dst / path.name))
            with phases.phase("fsync"):
                for path in files:
                    _fsync(dst / path.name)
                _fsync(dst)
    else:
        raise SystemExit(f"unknown child operation {op!r}")
    return {"phases": phases.done, "info": info}


# -- the parent: running, sampling, guarding ------------------------------------------------


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` (the child and whatever it started)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                    pids.append(int(entry.name))
    return pids or [sid]


def _mem_available() -> int:
    return _proc_fields("/proc/meminfo", ("MemAvailable",)).get("MemAvailable", 1 << 62)


class Watch(threading.Thread):
    """Samples a process session's memory (and the proxy's counters) and kills it when the
    machine runs short of memory or it passes its cap."""

    def __init__(
        self, sid: int, period: float, reserve: int, cap: int | None, counters: Callable[[], tuple[int, int]]
    ) -> None:
        super().__init__(daemon=True)
        self.sid, self.period, self.reserve, self.cap, self.counters = sid, period, reserve, cap, counters
        self.samples: list[tuple[float, int, int, int, int]] = []  # t, anon, rss, sent, received
        self.killed: str | None = None
        self.peak_anon = 0
        self.peak_hwm = 0
        self._halt = threading.Event()

    def run(self) -> None:
        tree, scanned = [self.sid], 0.0
        while not self._halt.is_set():
            now = time.monotonic()
            if now - scanned > 0.25:
                tree, scanned = _session(self.sid), now
            anon = rss = 0
            hwm = 0
            for pid in tree:
                s = _proc_fields(f"/proc/{pid}/status", STATUS_FIELDS)
                anon += s.get("RssAnon", 0) + s.get("RssShmem", 0)
                rss += s.get("VmRSS", 0)
                hwm = max(hwm, s.get("VmHWM", 0))
            self.peak_hwm = max(self.peak_hwm, hwm)
            sent, received = self.counters()
            self.samples.append((now, anon, rss, sent, received))
            self.peak_anon = max(self.peak_anon, anon)
            available = _mem_available()
            reason = None
            if available < self.reserve:
                reason = f"MemAvailable {available / GB:.2f} GB under the reserve"
            elif self.cap is not None and anon > self.cap:
                reason = f"anonymous memory over the cap of {self.cap / GB:.2f} GB"
            if reason and self.killed is None:
                self.killed = f"out of memory ({reason}): killed at anon {anon / GB:.2f} GB"
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.sid, signal.SIGKILL)
            self._halt.wait(self.period)

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def window(self, t0: float, t1: float) -> tuple[int, int, int]:
        """Peak anon in [t0, t1] and the proxy's bytes sent and received over it."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        before = [s for s in self.samples if s[0] <= t0] or self.samples[:1]
        after = [s for s in self.samples if s[0] >= t1] or self.samples[-1:]
        peak = max((s[1] for s in inside), default=0)
        if not before or not after:
            return peak, 0, 0
        return peak, after[0][3] - before[-1][3], after[0][4] - before[-1][4]


@dataclass
class Proc:
    """One finished subprocess."""

    rc: int
    wall_s: float
    hwm: int
    disk_read: int
    disk_write: int
    stdout: str
    stderr: str
    watch: Watch

    @property
    def ok(self) -> bool:
        return self.rc == 0 and self.watch.killed is None

    def failure(self) -> str:
        if self.watch.killed:
            return f"did not complete: {self.watch.killed} (peak {self.watch.peak_anon / GB:.2f} GB)"
        tail = (self.stderr.strip().splitlines() or self.stdout.strip().splitlines() or [""])[-1]
        return f"did not complete: exit {self.rc}: {tail[:200]}"


@dataclass
class Figure:
    """One measured operation (or phase) as printed."""

    name: str
    ok: bool
    seconds: float = 0.0
    anon_peak: int = 0
    anon_beyond: int = 0
    hwm: int = 0
    disk_read: int | None = None
    disk_write: int | None = None
    store_up: int | None = None
    store_down: int | None = None
    error: str | None = None
    baseline: str | None = None
    ratio: float | None = None
    targets: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


class Bench:
    """Runs the operations of one store, for every size."""

    def __init__(self, args: argparse.Namespace, work: Path, store_kind: str, endpoint: str | None) -> None:
        self.args, self.work, self.kind = args, work, store_kind
        self.endpoint = endpoint  # the proxy's, on S3
        self.proxy: Any = None
        self.bucket = f"bench-scale-{uuid.uuid4().hex[:12]}"
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), self.env.get("PYTHONPATH")]))
        self.bulletin = str(Path(sys.executable).parent / "bulletin")
        if not Path(self.bulletin).exists():
            self.bulletin = shutil.which("bulletin") or "bulletin"
        self.idle_anon = 0
        self.cold: list[Path] = []  # with --cold: evicted from the page cache before each operation

    def counters(self) -> tuple[int, int]:
        return (self.proxy.sent, self.proxy.received) if self.proxy is not None else (0, 0)

    def run(self, argv: list[str]) -> Proc:
        cap = int(self.args.max_anon_gb * GB) if self.args.max_anon_gb else None
        if self.args.cold:
            evict(self.cold)
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            t0 = time.monotonic()
            proc = subprocess.Popen(argv, stdout=out, stderr=err, env=self.env, start_new_session=True)
            watch = Watch(proc.pid, self.args.sample_ms / 1000, int(self.args.reserve_gb * GB), cap, self.counters)
            watch.start()
            _, status, usage = os.wait4(proc.pid, 0)
            wall = time.monotonic() - t0
            proc.returncode = os.waitstatus_to_exitcode(status)
            watch.stop()
            out.seek(0)
            err.seek(0)
            return Proc(
                proc.returncode,
                wall,
                # Not ru_maxrss: exec records the forking parent's peak there. VmHWM, sampled.
                watch.peak_hwm,
                usage.ru_inblock * 512,
                usage.ru_oublock * 512,
                out.read(),
                err.read(),
                watch,
            )

    def child(self, op: str, spec: dict[str, Any]) -> tuple[Proc, dict[str, Any]]:
        proc = self.run([sys.executable, __file__, "--child", op, "--spec", json.dumps(spec)])
        report: dict[str, Any] = {}
        if proc.ok:
            report = json.loads(proc.stdout.strip().splitlines()[-1])
        return proc, report

    def phase_figures(self, proc: Proc, report: dict[str, Any], names: dict[str, str]) -> dict[str, Figure]:
        """A figure per phase of a Python child, named by ``names`` (phase: what it measured)."""
        info = report.get("info", {})
        loaded = info.get("anon_loaded", 0)
        figures = {}
        for name, p in report.get("phases", {}).items():
            peak, sent, received = proc.watch.window(p["t0"], p["t1"])
            peak = max(peak, p["anon_start"], p["anon_end"])  # a phase shorter than one sample
            s3 = self.kind == "s3"
            figures[name] = Figure(
                names.get(name, name),
                True,
                seconds=p["seconds"],
                anon_peak=peak,
                anon_beyond=max(0, peak - loaded),
                hwm=p["hwm"],
                disk_read=p["disk_read"],
                disk_write=p["disk_write"],
                store_up=sent if s3 else p.get("store_up"),
                store_down=received if s3 else p.get("store_down"),
                extra={"anon_tensors": info.get("anon_tensors")},
            )
        return figures

    def cli(self, name: str, argv: list[str], store_dir: Path | None) -> tuple[Figure, dict[str, Any]]:
        listed = _listing(store_dir) if store_dir is not None else {}
        sent0, received0 = self.counters()
        proc = self.run([self.bulletin, *argv, "--json"])
        if not proc.ok:
            return Figure(name, False, error=proc.failure(), anon_peak=proc.watch.peak_anon), {}
        data = json.loads(proc.stdout)
        sent, received = self.counters()
        if self.kind == "s3":
            up, down = sent - sent0, received - received0
        else:
            assert store_dir is not None
            after = _listing(store_dir)
            up = sum(size for key, (size, stamp) in after.items() if listed.get(key) != (size, stamp))
            down = data.get("bytes_downloaded")
        return Figure(
            name,
            True,
            seconds=proc.wall_s,
            anon_peak=proc.watch.peak_anon,
            anon_beyond=max(0, proc.watch.peak_anon - self.idle_anon),
            hwm=proc.hwm,
            disk_read=proc.disk_read,
            disk_write=proc.disk_write,
            store_up=up,
            store_down=down,
            extra={"command_seconds": data.get("seconds")},
        ), data

    def size(self, size_gb: float) -> dict[str, Any]:
        args = self.args
        model = Llama.of_size(size_gb * GB)
        nbytes = model.nbytes
        shard = min(int(args.shard_gb * GB), -(-nbytes // 2))  # at least two shards: an index
        t0 = time.monotonic()
        v1, v2 = ensure_versions(args.cache, model, args.seed, args.changed, shard)
        built_s = time.monotonic() - t0
        work = self.work / f"{size_gb:g}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        order = list(model.shapes())
        if self.kind == "s3":
            url = f"s3://{self.bucket}/{size_gb:g}?endpoint_url={self.endpoint}&region=us-east-1"
            store_dir = None
        else:
            store_dir = work / "store"
            url = str(store_dir)
        node = work / "node"
        # The publisher's own cache of the last published bits: in the scratch directory
        # (removed with it), and evicted with the rest under --cold.
        self.env["BULLETIN_CACHE_DIR"] = str(work / "publisher-cache")
        self.cold = [v1, v2, node, work / "publisher-cache", *([store_dir] if store_dir is not None else [])]
        k = str(args.keyframe_every)
        common = {"store": url, "keyframe_every": args.keyframe_every, "share": args.changed, "seed": args.seed}
        common["model"] = asdict(model)
        figures: dict[str, Figure] = {}
        facts: dict[str, Any] = {}

        def fail(name: str, why: str) -> None:
            figures[name] = Figure(name, False, error=why)

        # Baselines.
        dst = work / "copy"
        proc = self.run(["bash", "-c", 'cp -r "$1" "$2" && sync "$2"/* "$2"', "cp", str(v1), str(dst)])
        figures["cp"] = Figure(
            "cp -r + fsync (v1)",
            proc.ok,
            seconds=proc.wall_s,
            anon_peak=proc.watch.peak_anon,
            hwm=proc.hwm,
            disk_read=proc.disk_read,
            disk_write=proc.disk_write,
            error=None if proc.ok else proc.failure(),
        )
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir()
        proc, report = self.child("save-file", {"folder": str(v2), "dst": str(dst)})
        if proc.ok:
            figures["save_file"] = self.phase_figures(
                proc, report, {"save_file": "safetensors save_file + fsync (v2)"}
            )["save_file"]
        else:
            fail("save_file", proc.failure())
        shutil.rmtree(dst, ignore_errors=True)
        if self.kind == "s3":
            boto = {"endpoint": self.endpoint, "bucket": self.bucket, "prefix": f"baseline-{size_gb:g}"}
            proc, report = self.child("boto3-up", boto | {"folder": str(v1)})
            if proc.ok:
                figures["boto3_up"] = self.phase_figures(proc, report, {"upload_file": "boto3 upload_file (v1)"})[
                    "upload_file"
                ]
                dst.mkdir()
                proc, report = self.child("boto3-down", boto | {"folder": str(v1), "dst": str(dst)})
                if proc.ok:
                    got = self.phase_figures(proc, report, {"download_file": "boto3 download_file (v1)"})
                    figures["boto3_down"] = got["download_file"]
                    both = got["download_file"]
                    fs = got["fsync"]
                    figures["boto3_down_fsync"] = Figure(
                        "boto3 download_file + fsync (v1)",
                        True,
                        seconds=both.seconds + fs.seconds,
                        anon_peak=max(both.anon_peak, fs.anon_peak),
                        anon_beyond=max(both.anon_beyond, fs.anon_beyond),
                        hwm=max(both.hwm, fs.hwm),
                        disk_read=(both.disk_read or 0) + (fs.disk_read or 0),
                        disk_write=(both.disk_write or 0) + (fs.disk_write or 0),
                        store_up=both.store_up,
                        store_down=both.store_down,
                    )
                else:
                    fail("boto3_down", proc.failure())
                shutil.rmtree(dst, ignore_errors=True)
            else:
                fail("boto3_up", proc.failure())

        # Publishing: the CLI, then the Python Publisher (its own run).
        figures["cli_keyframe"], _ = self.cli(
            "bulletin publish v1 (keyframe)",
            ["publish", str(v1), "--store", url, "--run", "cli", "--keyframe-every", k],
            store_dir,
        )
        if figures["cli_keyframe"].ok:
            figures["cli_patch"], _ = self.cli(
                "bulletin publish v2 (patch)",
                ["publish", str(v2), "--store", url, "--run", "cli", "--keyframe-every", k],
                store_dir,
            )
        else:
            fail("cli_patch", "skipped: the keyframe publish did not complete")
        spec = common | {"folder": str(v1), "run": "py", "versions": [1, 2]}
        proc, report = self.child("py-publish", spec | {"phase_names": ["keyframe", "patch"]})
        if proc.ok:
            names = {"keyframe": "Publisher.publish v1 (keyframe)", "patch": "Publisher.publish v2 (patch)"}
            got = self.phase_figures(proc, report, names)
            figures["py_keyframe"], figures["py_patch"] = got["keyframe"], got["patch"]
            facts["py_tensors_anon"] = report["info"].get("anon_tensors")
        else:
            fail("py_keyframe", proc.failure())
            fail("py_patch", "skipped: the Python publish process did not complete")
        if store_dir is not None:  # the Python run's keyframe is no longer needed: disk
            shutil.rmtree(store_dir / "py", ignore_errors=True)

        # Syncing: a fresh node, then catch-ups, each after unmeasured publishes.
        sync = ["sync", "--store", url, "--run", "cli", "--to", str(node), "--layout", args.layout]
        if not figures.get("cli_patch", Figure("", False)).ok:
            for name in ("sync_fresh", "catch_up_1", f"catch_up_{args.catch_up}"):
                fail(name, "skipped: the CLI publishes did not complete")
            return self._finish(size_gb, model, nbytes, v1, built_s, figures, facts)
        figures["sync_fresh"], data = self.cli("bulletin sync --to NODE (fresh, to v2)", sync, store_dir)
        if args.check and figures["sync_fresh"].ok:
            check_node(node, v2, 2, order, args.changed, args.seed)
        patches: dict[int, int] = {}
        tip = 2
        for behind in (1, args.catch_up):
            name = f"catch_up_{behind}"
            if not figures["sync_fresh"].ok:
                fail(name, "skipped: the fresh sync did not complete")
                continue
            spec = common | {"folder": str(v2), "run": "cli"}
            spec |= {"apply_first": list(range(3, tip + 1)), "versions": list(range(tip + 1, tip + behind + 1))}
            proc, report = self.child("py-setup", spec)
            if not proc.ok:
                fail(name, f"skipped: publishing versions {tip + 1}-{tip + behind} {proc.failure()}")
                break
            for r in report["info"]["results"]:
                patches[r["version"]] = r["patch_bytes"]
            tip += behind
            fig, data = self.cli(f"bulletin sync: catch-up of {behind} (to v{tip})", sync, store_dir)
            fig.extra["patch_bytes"] = [patches[v] for v in range(tip - behind + 1, tip + 1)]
            # The log layout's compactions (new bases), counted by the replica itself: the
            # target amortises them apart from the versions' own writes.
            fig.extra["compaction_bytes"] = (data.get("written") or {}).get("compaction", 0)
            if fig.ok and data.get("version") != tip:
                fig.ok, fig.error = False, f"reached version {data.get('version')}, not {tip}"
            figures[name] = fig
            if args.check and fig.ok:
                check_node(node, v2, tip, order, args.changed, args.seed)
            if not fig.ok:
                break
        facts["patch_bytes"] = patches
        return self._finish(size_gb, model, nbytes, v1, built_s, figures, facts)

    def _finish(
        self,
        size_gb: float,
        model: Llama,
        nbytes: int,
        v1: Path,
        built_s: float,
        figures: dict[str, Figure],
        facts: dict[str, Any],
    ) -> dict[str, Any]:
        judge(figures, nbytes, self.kind, self.args)
        shards = len(list(v1.glob("*.safetensors")))
        return {
            "size_gb": size_gb,
            "store": self.kind,
            "model": asdict(model) | {"bytes": nbytes, "shards": shards, "params": nbytes // 2},
            "folders_built_s": built_s,
            "idle_anon": self.idle_anon,
            "facts": facts,
            "figures": {key: asdict(f) for key, f in figures.items()},
        }


def evict(roots: list[Path]) -> None:
    """Drop these trees' files from the page cache (written back first: only clean pages go)."""
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for name in names:
                with contextlib.suppress(OSError):
                    fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                    try:
                        os.fdatasync(fd)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)


def _listing(root: Path | None) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: size and modification time (what a write changes)."""
    found: dict[str, tuple[int, int]] = {}
    if root is None or not root.exists():
        return found
    for dirpath, _, names in os.walk(root):
        for name in names:
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(dirpath, name))
                found[os.path.join(dirpath, name)] = (st.st_size, st.st_mtime_ns)
    return found


def check_node(node: Path, v2: Path, version: int, order: list[str], share: float, seed: int) -> None:
    """The node's ``current/`` holds exactly ``version``'s bits (from v2 and the deltas after it)."""
    index = {name: i for i, name in enumerate(order)}
    want = dict(tensor_views(v2))
    got = dict(tensor_views(node / "current"))
    if set(got) != set(want):
        raise SystemExit(f"check: node tensors differ from the model's: {sorted(set(got) ^ set(want))[:5]}")
    for name, bits in want.items():
        expected = np.array(bits)
        for v in range(3, version + 1):
            apply_delta(expected, v, index[name], share, seed)
        if not np.array_equal(expected, got[name]):
            raise SystemExit(f"check: {name} at {node} is not version {version}")


# -- targets and the table ------------------------------------------------------------------


def judge(figures: dict[str, Figure], nbytes: int, kind: str, args: argparse.Namespace) -> None:
    """Ratios against the baselines and issue 11's targets, on every figure that has one."""
    copy_up = "boto3_up" if kind == "s3" else "cp"
    copy_down = "boto3_down_fsync" if kind == "s3" else "cp"
    timed = {
        "cli_keyframe": (copy_up, KEYFRAME_TIME_TARGET),
        "py_keyframe": (copy_up, KEYFRAME_TIME_TARGET),
        "cli_patch": ("save_file", PATCH_TIME_TARGET),
        "py_patch": ("save_file", PATCH_TIME_TARGET),
        "sync_fresh": (copy_down, KEYFRAME_TIME_TARGET),
    }
    constant = args.write_constant_mb * MB
    for key, fig in figures.items():
        if not fig.ok or key in {"cp", "save_file"} or key.startswith("boto3"):
            continue
        fig.targets.append(
            {"what": "anon", "value": fig.anon_beyond / nbytes, "limit": MEMORY_TARGET}
            | {"pass": fig.anon_beyond <= MEMORY_TARGET * nbytes}
        )
        if key in timed:
            base_key, limit = timed[key]
            base = figures.get(base_key)
            if base is not None and base.ok and base.seconds > 0:
                fig.baseline, fig.ratio = base.name, fig.seconds / base.seconds
                fig.targets.append({"what": "time", "value": fig.ratio, "limit": limit, "pass": fig.ratio <= limit})
        if key.startswith("catch_up_") and fig.disk_write is not None:
            patches = fig.extra.get("patch_bytes", [])
            compaction = fig.extra.get("compaction_bytes", 0)
            per_version = max(0, fig.disk_write - compaction) / max(1, len(patches))
            limit_bytes = WRITES_PER_PATCH_TARGET * (sum(patches) / max(1, len(patches))) + constant
            fig.extra["disk_write_per_version"] = per_version
            fig.targets.append(
                {"what": "writes/version", "value": per_version, "limit": limit_bytes}
                | {"pass": per_version <= limit_bytes, "compaction": compaction / max(1, len(patches))}
            )


def _mb(n: int | float | None) -> str:
    return "n/a" if n is None else f"{n / MB:,.1f}"


def _target_text(t: dict[str, Any]) -> str:
    verdict = "PASS" if t["pass"] else "FAIL"
    if t["what"] == "writes/version":
        text = f"writes/version {_mb(t['value'])} MB <= {_mb(t['limit'])} MB {verdict}"
        if t.get("compaction"):
            text += f" (compaction apart: {_mb(t['compaction'])} MB/version amortised)"
        return text
    return f"{t['what']} {t['value']:.2f}x <= {t['limit']:.2f}x {verdict}"


def print_size(result: dict[str, Any], args: argparse.Namespace) -> None:
    m = result["model"]
    print(
        f"\n== {result['size_gb']:g} GB, store {result['store']}: Llama hidden {m['hidden']}, {m['layers']} layers, "
        f"vocab {m['vocab']}, {m['params'] / 1e6:,.0f}M parameters, {m['bytes'] / GB:.3f} GB BF16 in {m['shards']} "
        f"shards; {100 * args.changed:.2f}% changed per version =="
    )
    print(f"CLI baseline (interpreter + Bulletin's CLI imported): anon {_mb(result['idle_anon'])} MB")
    head = (
        f"{'operation':<44} {'time s':>8} {'own s':>7} {'ratio':>7} {'anon+ MB':>9} {'x model':>7} {'VmHWM MB':>9} "
        f"{'disk R MB':>10} {'disk W MB':>10} {'store up MB':>11} {'down MB':>9}  targets"
    )
    print(head)
    for fig in result["figures"].values():
        if not fig["ok"]:
            print(f"{fig['name']:<44} {fig['error']}")
            continue
        ratio = f"{fig['ratio']:.2f}x" if fig["ratio"] is not None else ""
        own = fig["extra"].get("command_seconds")
        own_s = f"{own:.2f}" if own is not None else ""
        x = fig["anon_beyond"] / m["bytes"]
        print(
            f"{fig['name']:<44} {fig['seconds']:>8.2f} {own_s:>7} {ratio:>7} {_mb(fig['anon_beyond']):>9} {x:>6.2f}x "
            f"{_mb(fig['hwm']):>9} {_mb(fig['disk_read']):>10} {_mb(fig['disk_write']):>10} "
            f"{_mb(fig['store_up']):>11} {_mb(fig['store_down']):>9}  {'; '.join(map(_target_text, fig['targets']))}"
        )
    print(
        "ratio: time / the baseline's (keyframe publish: "
        + ("boto3 upload_file" if result["store"] == "s3" else "cp -r + fsync")
        + "; patch publish: save_file + fsync; fresh sync: "
        + ("boto3 download_file + fsync" if result["store"] == "s3" else "cp -r + fsync")
        + f"); writes/version limit: {WRITES_PER_PATCH_TARGET:g} x the mean patch + {args.write_constant_mb:g} MB; "
        "time s: the process (CLI, cp) or the phase (Python); own s: the CLI command's own timer; anon+: "
        "beyond the caller's tensors (Python) or the CLI baseline above"
    )


# -- main ------------------------------------------------------------------------------------


@contextlib.contextmanager
def localstack() -> Iterator[str]:
    """A private LocalStack, as scripts/test.sh starts one (own run directory, free port)."""
    subprocess.run([str(ROOT / "localstack" / "install.sh")], check=True, stdout=subprocess.DEVNULL)
    run_dir = ROOT / ".localstack" / f"bench-scale-{os.getpid()}"
    env = dict(os.environ, LOCALSTACK_RUN_DIR=str(run_dir))
    try:
        out = subprocess.run(
            [str(ROOT / "localstack" / "start.sh")], check=True, capture_output=True, text=True, env=env
        )
        yield out.stdout.strip()
    finally:
        subprocess.run([str(ROOT / "localstack" / "stop.sh")], env=env, capture_output=True, check=False)
        shutil.rmtree(run_dir, ignore_errors=True)


def _empty_bucket(endpoint: str, bucket: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys: list[Any] = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
    client.delete_bucket(Bucket=bucket)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.5,2", help="model sizes in GB (10^9 bytes), comma-separated")
    parser.add_argument("--stores", default=None, help="local, s3 or local,s3 (default: s3 with --s3, else local)")
    parser.add_argument("--s3", default=None, metavar="auto|URL", help="S3 endpoint; auto starts a private LocalStack")
    parser.add_argument("--s3-endpoint", default=None, metavar="URL", help="same as --s3 URL")
    parser.add_argument("--cache", type=Path, default=None, help="generated folders (default ~/.cache/bulletin-scale)")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--changed", type=float, default=0.004, help="share of elements changed per version")
    parser.add_argument("--catch-up", type=int, default=10, help="versions behind for the long catch-up")
    parser.add_argument(
        "--layout",
        choices=["dense", "log"],
        default="dense",
        help="the node folder's layout for the syncs (bulletin sync --layout; log: about a patch written per version)",
    )
    parser.add_argument("--keyframe-every", type=int, default=1000)
    parser.add_argument("--shard-gb", type=float, default=1.0, help="largest shard (a model has two at least)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-ms", type=float, default=10.0, help="memory sampling period")
    parser.add_argument("--reserve-gb", type=float, default=1.5, help="kill an operation when less is available")
    parser.add_argument("--max-anon-gb", type=float, default=None, help="kill an operation above this anon memory")
    parser.add_argument("--write-constant-mb", type=float, default=16.0, help="the constant of the writes target")
    parser.add_argument(
        "--cold", action="store_true", help="evict the folders, store and node from the page cache first"
    )
    parser.add_argument("--check", action="store_true", help="compare every synced node's bits with the model's")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, json.loads(args.spec))))
        return 0
    sys.path.insert(0, str(ROOT))
    from scripts.bench_sync import CountingProxy

    s3 = args.s3_endpoint or args.s3
    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test")):
        os.environ.setdefault(name, value)  # LocalStack takes any credentials
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")  # never probe the cloud metadata address
    stores = (args.stores or ("s3" if s3 else "local")).split(",")
    if "s3" in stores and not s3:
        s3 = "auto"
    args.cache = args.cache or Path(os.environ.get("BULLETIN_SCALE_CACHE") or Path.home() / ".cache" / "bulletin-scale")
    sizes = [float(s) for s in args.sizes.split(",")]
    results: list[dict[str, Any]] = []
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    dirty = bool(
        subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=False).stdout
    )
    print(
        f"bench_scale: git {head[:12]}{' (working tree modified)' if dirty else ''}, sizes {sizes} GB, "
        f"stores {stores}, node layout {args.layout}"
    )
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=args.work, prefix="bench-scale-")))
        endpoint = None
        if "s3" in stores:
            endpoint = stack.enter_context(localstack()) if s3 == "auto" else s3
        for kind in stores:
            bench = Bench(args, work / kind, kind, None)
            if kind == "s3":
                assert endpoint is not None
                host, port = endpoint.split("://", 1)[1].rsplit(":", 1)
                bench.proxy = CountingProxy((host, int(port)))
                stack.callback(bench.proxy.close)
                bench.endpoint = f"http://127.0.0.1:{bench.proxy.port}"
                import boto3

                boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bench.bucket)
                stack.callback(_empty_bucket, endpoint, bench.bucket)
            proc, report = bench.child("idle", {})
            bench.idle_anon = report["phases"]["idle"]["anon_end"] if proc.ok else 0
            for size in sizes:
                result = bench.size(size)
                results.append(result)
                print_size(result, args)
                shutil.rmtree(work / kind / f"{size:g}", ignore_errors=True)
    if args.json:
        doc = {"git_head": head, "working_tree_modified": dirty, "args": {k: str(v) for k, v in vars(args).items()}}
        args.json.write_text(json.dumps(doc | {"results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
