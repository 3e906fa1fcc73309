"""Tensor-parallel vLLM, end to end, on vLLM's own layers in real processes (gloo, CPU).

Four rank processes (``tests/tp/conftest.py``) import vLLM 0.33.0's code once
(``scripts/vllm_source.py``) and set up its groups; each test picks a TP size (4: one
engine of four ranks; 2: two engines of two, vLLM's data-parallel layout) and builds on
every rank a Llama from vLLM's parallel layers, loaded through vLLM's own
``AutoWeightsLoader`` / ``weight_loader``s (``scripts/_vllm_tp.py``). The ranks look to
a loopback vLLM server (``tests/sidecar/engine_servers.py``) like vLLM's workers with
``BulletinWorkerExtension`` mixed in; the real :class:`~bulletin.engines.vllm.VLLMTarget`
and :class:`~bulletin.subscriber.Subscriber` follow a run that a real transformers Llama,
trained with AdamW on FP32 masters, publishes as BF16 with
:class:`~bulletin.publisher.Publisher`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bulletin.checkpoint import write_checkpoint
from bulletin.engines.rank_layout import RankLayout, ReplicaPlan
from bulletin.engines.vllm import VLLMTarget
from bulletin.errors import IncompatibleLayout, VerificationFailed, WrongBase
from bulletin.publisher import Publisher
from bulletin.snapshot import snapshot
from bulletin.subscriber import Subscriber
from bulletin.target import LocalDirTarget
from patcher.patch import TensorSpec
from scripts._common import llama
from scripts._vllm_tp import Cluster, RankWorker
from tests.sidecar.engine_servers import VllmServer
from tests.tp import ranks
from tests.tp.conftest import WORLD

TOKENS = [[1, 5, 9, 100, 3, 7, 42, 64], [99, 2, 0, 17, 33, 65, 8, 100]]
QKV = "model.layers.0.self_attn.qkv_proj.weight"


def _engines(cluster: Cluster, tp: int, variant: str | None = None) -> list[list[RankWorker]]:
    placed = cluster.run(ranks.engine, tp, variant)
    groups: dict[int, list[RankWorker]] = {}
    for info in placed:
        groups.setdefault(info["engine"], []).append(RankWorker(cluster, info["rank"]))
    return [groups[e] for e in sorted(groups)]


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, ranks.SIZES["vocab"], (2, 16), generator=gen)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


def _check_version(cluster: Cluster, engines: list[list[RankWorker]], ckpt: Path) -> None:
    """Every engine's logits are bit for bit those of the same TP engine loaded fresh from
    the checkpoint by vLLM's loaders, and every rank's shards are the checkpoint's bits."""
    for workers in engines:
        group = [w.rank for w in workers]
        patched = cluster.run(ranks.logits, TOKENS, ranks=group)
        fresh = cluster.run(ranks.fresh_check, str(ckpt), TOKENS, ranks=group)
        for rank, mine, theirs in zip(group, patched, fresh, strict=True):
            assert theirs["params"] == [] and theirs["pieces"] == [], (rank, theirs["params"], theirs["pieces"])
            assert np.array_equal(mine, theirs["logits"]), f"rank {rank}: logits differ from a fresh load"


@pytest.mark.parametrize("tp", [4, 2])
def test_versions_are_patched_in_place_bit_exact_and_a_bad_rank_refuses_the_version(
    cluster: Cluster, tmp_path: Path, tp: int
) -> None:
    engines = _engines(cluster, tp)
    assert len(engines) == WORLD // tp and all(len(e) == tp for e in engines)
    server = VllmServer(engines=[list(e) for e in engines])
    trainer = llama(ranks.config(), 0)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    store = str(tmp_path / "store")
    local = LocalDirTarget(tmp_path / "local", run="r")
    target = VLLMTarget(local, server.url)
    sub = Subscriber(store, "r", target=target)
    try:
        with Publisher(store, "r", keyframe_every=100) as pub:
            for step in range(4):
                if step:
                    _train_step(trainer, opt, step)
                version = pub.publish(trainer.state_dict())
                server.rpc_methods.clear()
                assert sub.sync() == version
                # The first version is a keyframe; every later one a patch, in place.
                assert ("bulletin_load" if step == 0 else "bulletin_apply") in server.rpc_methods
                assert step == 0 or "bulletin_load" not in server.rpc_methods
                snap = snapshot(trainer.state_dict(), dtype="BF16")
                ckpt = tmp_path / f"ckpt-{version}"
                write_checkpoint(ckpt, snap.specs, snap.bits)
                _check_version(cluster, engines, ckpt)
            assert target.plan is not None and len(target.plan.layouts) == tp
            # A bad rank: the last rank of the LAST engine (with TP 2, an engine whose
            # results vLLM does not return) no longer holds the version where the next
            # patch writes.
            bad = engines[-1][-1].rank
            cluster.run(ranks.damage, QKV, 1, ranks=[bad])
            held = cluster.run(ranks.digest)
            _train_step(trainer, opt, 99)
            pub.publish(trainer.state_dict())
            with pytest.raises((WrongBase, VerificationFailed)):
                sub.sync()
            # Refused as a whole: no version activated anywhere, every rank back on its bits.
            assert sub.current_version == version
            restored = local.restored()
            assert restored is not None and restored.version == version
            assert server.weight_versions == [str(version)] * len(engines)
            assert cluster.run(ranks.digest) == held
            # Repaired, the same version goes through and is exact everywhere.
            cluster.run(ranks.damage, QKV, -1, ranks=[bad])
            assert sub.sync() == version + 1
            snap = snapshot(trainer.state_dict(), dtype="BF16")
            write_checkpoint(tmp_path / "ckpt-last", snap.specs, snap.bits)
            _check_version(cluster, engines, tmp_path / "ckpt-last")
    finally:
        sub.close()
        server.close()


@pytest.mark.parametrize("tp", [2, 4])
def test_the_layout_names_what_vllms_loaders_put_where(cluster: Cluster, tp: int) -> None:
    results = cluster.run(ranks.probe, tp)
    shapes = {n: tuple(t.shape) for n, t in ranks._hf_shapes().items()}
    specs = {n: TensorSpec(n, "BF16", s) for n, s in shapes.items()}
    for r in results:
        assert r["placed"].keys() == r["expect"].keys() == specs.keys()
        for name in specs:  # element for element, vLLM's own weight_loader
            assert np.array_equal(r["placed"][name], r["expect"][name]), name
    # vLLM writes every element (the vocabulary's padding rows with zeros): nothing is
    # left at -1; the pieces name each checkpoint element once per replica set.
    assert all(r["untouched"] == 0 for r in results)
    layouts = [RankLayout.from_json(r["layout"]) for r in results]
    plan = ReplicaPlan(layouts[:tp], specs)  # one engine
    vocab, hidden = ranks.SIZES["vocab"], ranks.SIZES["hidden"]
    embed = [p.pieces.get("model.embed_tokens.weight") for p in layouts[:tp]]
    padded = -(-vocab // 64) * 64  # pad_vocab_size: DEFAULT_VOCAB_PADDING_SIZE = 64
    assert sum(p.numel for p in embed if p is not None) == vocab * hidden < padded * hidden
    k = "model.layers.0.self_attn.k_proj.weight"
    kv_heads = ranks.SIZES["kv_heads"]
    if tp > kv_heads:  # KV heads replicated: ranks 2r, 2r+1 hold the same rows
        assert len(plan.sets[k]) == kv_heads and all(len(s) == tp // kv_heads for s in plan.sets[k])
    else:
        assert len(plan.sets[k]) == tp


def test_layouts_the_rules_cannot_map_are_refused_at_bind(cluster: Cluster, tmp_path: Path) -> None:
    found = cluster.run(ranks.refusals, 2)[0]  # the in-place rules, on vLLM's layers
    assert "MyReplicatedLinear" in found["replicated_subclass"] and "ReplicatedLinear" in found["replicated_subclass"]
    assert "packed" in found["packed"] and "down_proj" in found["packed"]
    assert "DerivedRowParallelLinear" in found["derived"]
    # Through the sidecar, a layout that no path can take (a loader that derives weights
    # rather than placing checkpoint elements) is refused with the permanent error at
    # bind, before anything is loaded into the engine.
    engines = _engines(cluster, 2, "derived")
    server = VllmServer(engines=[list(e) for e in engines])
    store = str(tmp_path / "store")
    sub = Subscriber(store, "r", target=VLLMTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url))
    try:
        with Publisher(store, "r") as pub:
            pub.publish(llama(ranks.config(), 0).state_dict())
        with pytest.raises(IncompatibleLayout, match="down_proj"):
            sub.sync()
        assert sub.current_version is None
        assert "bulletin_load" not in server.rpc_methods
    finally:
        sub.close()
        server.close()
