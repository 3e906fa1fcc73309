"""One rank of a sharded publishing job: every scenario, in one process (spawned once per
world size by tests/distributed/test_sharded.py).

``python -m tests.distributed.worker RANK WORLD INIT_FILE STORE_DIR``. Scenarios:

- ``fsdp``: a tiny transformers Llama, FSDP2 ``fully_shard`` over gloo, AdamW on FP32
  masters, published as BF16 (sync and async steps, a keyframe mid-run), then a new
  publisher (a restarted job) resumes and publishes two more steps: every rank from its
  cached blocks, except the last rank, whose cache is damaged first and which must
  rebuild its blocks from the run (:func:`_damage`). Only rank 0's loss
  counts (the others' is multiplied by 0 and rank 0's by the world size, a power of two):
  FSDP's gradient reduction then adds exact zeros and divides by powers of two, so the
  weights are bit-identical at every world size and the runs can be compared.
  With one rank the plain :class:`bulletin.Publisher` publishes the same steps to
  ``fsdp-single``.
- ``megatron``: column-parallel (dim 0) and row-parallel (dim 1) blocks as
  :class:`~bulletin.distributed.LocalShard`, a replicated bias; two commits (a patch and
  a keyframe) whose responses rank 0 loses, each settled by the next publish.
- ``pipeline``: stage r holds layers r, r + W, ...: whole tensors, different per rank.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bulletin import Publisher
from bulletin.distributed import LocalShard, ShardedPublisher
from bulletin.signing import Signer

STEPS = 6
#: Small shards and keyframe files, so that several ranks write each version's.
FSDP_OPTIONS: dict[str, Any] = {
    "keyframe_every": 4,
    "max_shard_bytes": 1 << 14,
    "keyframe_file_bytes": 1 << 14,
    "timeout_s": 60,
}


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def fsdp(rank: int, world: int, store: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _llama()
    single = _llama() if world == 1 else None
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    pub = ShardedPublisher(store, "fsdp", **FSDP_OPTIONS)
    plain = Publisher(store, "fsdp-single", keyframe_every=4, codec="zstd") if world == 1 else None
    pending = []

    def train_step() -> None:
        ids = torch.randint(0, 96, (2, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss * (world if rank == 0 else 0.0)
        loss.backward()
        opt.step()
        opt.zero_grad()

    damaged = rank == world - 1
    for step in range(STEPS + 2):
        if step == STEPS:  # the job restarts: a new publisher resumes from the run
            for f in pending:
                f.result()
            pub.close()
            if damaged:
                _damage(pub.cache_dir)
            pub = ShardedPublisher(store, "fsdp", **FSDP_OPTIONS)
            said = _listen("bulletin.base")
        train_step()
        state = model.state_dict()
        if step % 2:
            pending.append(pub.publish_async(state))
        else:
            pub.publish(state)
        if step == STEPS:
            rebuilt = any("now holds version" in m for m in said)
            assert rebuilt == damaged, f"rank {rank}: rebuilt {rebuilt}, damaged {damaged}: {said}"
            assert damaged == any("does not verify" in m for m in said), said
        if plain is not None:
            plain.publish({k: v.full_tensor() for k, v in state.items()})
    pub.close()
    if plain is not None:
        plain.close()
    del single


def _damage(cache: Path) -> None:
    """Flip the last byte of the folder the cache's state names (a bit of its last block:
    one file of a rank's blocks, or a one-rank job's keyframe files)."""
    folder = cache / json.loads((cache / "state.json").read_bytes())["folder"]
    data = sorted(folder.glob("*.safetensors"))[-1]
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01
    data.write_bytes(bytes(raw))


def _listen(logger: str) -> list[str]:
    """The messages ``logger`` logs from now on, at every level."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    log = logging.getLogger(logger)
    log.setLevel(logging.DEBUG)
    log.addHandler(Keep())
    return said


def _full(name: str, shape: tuple[int, ...], version: int) -> torch.Tensor:
    """The deterministic full value of a tensor at a version (every rank can make it)."""
    seed = (sum(map(ord, name)) * 7919 + version) % (2**31)
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=torch.Generator().manual_seed(sum(map(ord, name))))
    return base + 1e-2 * version * torch.randn(shape, generator=g)


def _split(n: int, world: int, rank: int) -> tuple[int, int]:
    lo = n * rank // world
    return lo, n * (rank + 1) // world - lo


def _refused(pub: ShardedPublisher, rank: int, world: int) -> None:
    """Bad input on one rank, and blocks that overlap: the step fails on every rank alike,
    typed, and nothing is committed; the next step follows from the committed version."""
    from bulletin.errors import IncompatibleLayout, InvalidInput, RankFailed

    bad: dict[str, Any] = {"x": "not a tensor"} if rank == world - 1 else {"x": torch.zeros(4)}
    try:
        pub.publish(bad)
    except (InvalidInput, RankFailed) as exc:
        assert isinstance(exc, InvalidInput if rank == world - 1 else RankFailed), exc
    else:
        raise AssertionError("a bad state dict was published")
    if world > 1:
        overlap = {"x": LocalShard(torch.zeros(3), (4,), (min(rank, 1),))}
        try:
            pub.publish(overlap)
        except IncompatibleLayout:
            pass
        else:
            raise AssertionError("overlapping blocks were published")
    assert pub.version is None  # nothing was committed


def megatron(rank: int, world: int, store: str) -> None:
    """Column and row splits. Rank 0's commits of versions 2 (a patch) and 4 (a keyframe)
    land but their responses are lost: the step fails on every rank, and the next
    publish settles it (rank 0 commits the same manifest again and finds it; every rank
    advances its base with what it kept of that step) before its own version."""
    from bulletin.errors import RankFailed, StorageUnavailable
    from bulletin.storage import open_store
    from tests.run.test_ambiguous_commit import LostCommitResponse

    lossy = LostCommitResponse(open_store(store))
    pub = ShardedPublisher(lossy if rank == 0 else store, "megatron", keyframe_every=3, timeout_s=60)
    _refused(pub, rank, world)
    for version in range(1, 7):
        if version in (3, 5):  # the version before landed; this publish settles it first
            assert pub.version == version - 2, (rank, pub.version)
        up = _full("mlp.up.weight", (24, 10), version)
        down = _full("mlp.down.weight", (10, 24), version)
        bias = _full("mlp.down.bias", (10,), version)
        o0, n0 = _split(24, world, rank)
        state = {
            "mlp.up.weight": LocalShard(up[o0 : o0 + n0].clone(), (24, 10), (o0, 0)),
            "mlp.down.weight": LocalShard(down[:, o0 : o0 + n0].contiguous(), (10, 24), (0, o0)),
            "mlp.down.bias": bias,  # replicated: published once
        }
        if version in (2, 4):
            lossy.arm(reads=1)  # the manifest lands; its response and the read-back are lost
            try:
                pub.publish(state)
            except (StorageUnavailable, RankFailed) as exc:
                assert isinstance(exc, StorageUnavailable if rank == 0 else RankFailed), exc
            else:
                raise AssertionError("a commit whose response was lost returned")
            continue
        assert pub.publish(state) == version
    pub.close()


#: The trainer's key of the pipeline run: rank 0 alone is given it, and signs the job's
#: manifests and heads (tests/distributed/test_sharded.py checks them).
SIGNING_SEED = bytes(range(32))
#: The pipeline run's model file.
CONFIG = b'{"model_type": "toy", "torch_dtype": "float32"}'


def pipeline(rank: int, world: int, store: str) -> None:
    key = Signer(Ed25519PrivateKey.from_private_bytes(SIGNING_SEED)) if rank == 0 else None
    pub = ShardedPublisher(store, "pipeline", keyframe_every=3, timeout_s=60, signing_key=key)
    for version in range(1, 5):
        state = {
            f"layers.{i}.weight": _full(f"layers.{i}.weight", (6, 5), version) for i in range(4) if i % world == rank
        }
        if rank == world - 1:
            state["head.weight"] = _full("head.weight", (3, 5), version).to(torch.float64)
        # Rank 0's files go with the version (the other ranks' are ignored); kept after.
        files = {"config.json": CONFIG} if version == 1 and rank == 0 else {"x.txt": b"ignored"} if rank else None
        pub.publish(state, files=files)
    pub.close()


def reshard(rank: int, world: int, store: str) -> None:
    """The same tensors placed otherwise between steps (rows given to other ranks, then
    cut along another dimension): no rank's kept blocks are the base of its new ones, so
    each new placement is published in full, the same versions as one process's."""
    pub = ShardedPublisher(store, "reshard", keyframe_every=10, timeout_s=60)
    for version in range(1, 5):
        w, v = _full("w", (8, 6), version), _full("v", (6, 8), version)
        lo, n = _split(8, world, rank if version < 3 else world - 1 - rank)
        state = {"w": LocalShard(w[lo : lo + n].clone(), (8, 6), (lo, 0))}
        if version < 4:
            state["v"] = LocalShard(v[lo * 6 // 8 : (lo + n) * 6 // 8].clone(), (6, 8), (lo * 6 // 8, 0))
        else:
            state["v"] = LocalShard(v[:, lo : lo + n].contiguous(), (6, 8), (0, lo))
        pub.publish(state)
    pub.close()


def main() -> None:
    rank, world, init, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)  # the same matmul blocking at every world size
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    for scenario in (fsdp, megatron, pipeline, reshard):
        scenario(rank, world, store)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
