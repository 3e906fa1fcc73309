"""The SGLang adapters against a loopback server imitating SGLang 0.5.23: the disk reload
and the in-place path through Bulletin's loader (tests/sidecar/engine_servers.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bulletin.engines.rank_layout import ReplicaPlan
from bulletin.engines.sglang import SGLangInPlaceTarget, SGLangTarget, open_sglang
from bulletin.engines.sglang_loader import LOADER
from bulletin.errors import ConfigError, EngineError, InvalidInput, VerificationFailed, WrongBase
from bulletin.publisher import Publisher
from bulletin.subscriber import Subscriber
from bulletin.target import LocalDirTarget
from scripts._common import llama, llama_config
from tests.sidecar.engine_servers import LoadFault, SglangServer, prefix_values
from tests.sidecar.sglang_model import loaded_like, sglang_ranks

CONFIG = llama_config(vocab=64, hidden=16, intermediate=32, layers=1, heads=2, kv_heads=1, max_positions=32, tied=False)


def _same_bits(engine: torch.nn.Module, trainer: torch.nn.Module) -> bool:
    live = engine.state_dict()
    return all(
        torch.equal(live[n].view(torch.int16), t.detach().to(dtype=torch.bfloat16).view(torch.int16))
        for n, t in trainer.state_dict().items()
    )


def _step(trainer: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 1e-2)


def test_each_version_is_reloaded_and_labelled(tmp_path: Path) -> None:
    trainer, engine = llama(CONFIG, 0), llama(CONFIG, 1, dtype=torch.bfloat16)
    server = SglangServer(engine)
    try:
        local = LocalDirTarget(tmp_path / "local", run="r")
        sub = Subscriber(str(tmp_path / "store"), "r", target=SGLangTarget(local, server.url))
        with Publisher(str(tmp_path / "store"), "r", keyframe_every=2) as pub:
            for step in range(4):
                if step:
                    _step(trainer)
                version = pub.publish(trainer.state_dict())
                assert sub.sync() == version
                assert server.weight_version == str(version)
                assert _same_bits(engine, trainer)
                assert Path(server.loaded_from[-1]) == (local.dir / "current").resolve()
    finally:
        server.close()


def _two_versions(
    tmp_path: Path, server: SglangServer, target: Any = None, config: Any = CONFIG
) -> tuple[Subscriber, Any, Publisher, torch.nn.Module, torch.nn.Module]:
    """A subscriber on version 1, version 2 published; the trainers' copies of both."""
    trainer = llama(config, 0)
    if target is None:
        target = SGLangTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url)
    sub = Subscriber(str(tmp_path / "store"), "r", target=target)
    pub = Publisher(str(tmp_path / "store"), "r", keyframe_every=10)
    pub.publish(trainer.state_dict())
    sub.sync()
    v1 = llama(config, 0)
    v1.load_state_dict(trainer.state_dict())
    _step(trainer)
    pub.publish(trainer.state_dict())
    return sub, target, pub, v1, trainer


@pytest.mark.parametrize("engines", [1, 2])
def test_a_failed_reload_that_left_the_new_weights_is_undone(tmp_path: Path, engines: int) -> None:
    models = [llama(CONFIG, 1, dtype=torch.bfloat16) for _ in range(engines)]
    server = SglangServer(engines=models)
    try:
        sub, target, pub, v1, v2 = _two_versions(tmp_path, server)
        # SGLang fails mid-load and "rolls back" by loading the new folder again, on the
        # last data-parallel engine: every engine now holds version 2's bits, and it says 400.
        server.fault = LoadFault(after=2, rollback=True, engines={engines - 1})
        with pytest.raises(EngineError, match="Rolling back"):
            sub.sync()
        assert sub.current_version == 1 and server.weight_version == "1"
        assert all(_same_bits(m, v1) for m in models)  # version 1 reloaded into every engine
        assert target.lost is None and target.full_fingerprints() == sub.held.fingerprints  # type: ignore[union-attr]
        assert sub.sync() == 2
        assert all(_same_bits(m, v2) for m in models) and server.weight_version == "2"
        pub.close()
    finally:
        server.close()


def test_a_reload_that_cannot_be_undone_leaves_nothing_claimed_until_repaired(tmp_path: Path) -> None:
    engine = llama(CONFIG, 1, dtype=torch.bfloat16)
    server = SglangServer(engine)
    try:
        sub, target, pub, v1, _ = _two_versions(tmp_path, server)
        server.fault = LoadFault(after=2, rollback=False, times=2)  # the restore fails too: mixed bits
        with pytest.raises(EngineError):
            sub.sync()
        assert target.lost is not None
        assert target.full_fingerprints() == {}  # nothing vouched for: a verification finds damage
        report = sub.verify()  # what the sidecar runs at once (worker.py), repairing from a keyframe
        assert not report.ok and report.repaired_to == 1
        assert target.lost is None and _same_bits(engine, v1) and server.weight_version == "1"
        pub.close()
    finally:
        server.close()


def test_a_reload_whose_cache_flush_is_refused_is_not_reported_as_the_old_version(tmp_path: Path) -> None:
    import threading
    import urllib.request

    engine = llama(CONFIG, 1, dtype=torch.bfloat16)
    server = SglangServer(engine)
    try:
        sub, target, pub, v1, _v2 = _two_versions(tmp_path, server)
        target.abort_all_requests = False  # a request keeps running across the reload
        body = json.dumps({"prompt": [1, 2], "hold": True}).encode()

        def request() -> None:
            req = urllib.request.Request(f"{server.url}/v1/completions", data=body, method="POST")
            with urllib.request.urlopen(req, timeout=30) as resp:
                resp.read()

        running = threading.Thread(target=request)
        running.start()
        while not server.running:
            pass
        with pytest.raises(EngineError, match="cache was not flushed"):
            sub.sync()
        # SGLang loaded new bits and could not flush its cache (nor after reloading version 1):
        # the node claims nothing until a verification repairs it.
        assert target.lost is not None and target.full_fingerprints() == {}
        server.release()
        running.join(10)
        assert sub.verify().repaired_to == 1 and _same_bits(engine, v1)
        pub.close()
    finally:
        server.close()


def test_a_prompt_sharing_a_cached_prefix_gets_the_new_versions_numbers(tmp_path: Path) -> None:
    engine = llama(CONFIG, 1, dtype=torch.bfloat16)
    server = SglangServer(engine)
    try:
        sub, _, pub, _, _ = _two_versions(tmp_path, server)
        prompt = [5, 3, 5, 8, 9, 7, 9]
        old = _completion(server, prompt)
        assert server.caches[0].blocks
        assert sub.sync() == 2
        new = _completion(server, [*prompt, 1])
        assert new == prefix_values(engine, [*prompt, 1]) and new[: len(prompt)] != old
        assert server.count("/flush_cache") >= 1
        pub.close()
    finally:
        server.close()


def test_data_parallel_engines_holding_different_weights_are_refused(tmp_path: Path) -> None:
    models = [llama(CONFIG, 1, dtype=torch.bfloat16) for _ in range(2)]
    server = SglangServer(engines=models)
    try:
        _sub, target, pub, _, _ = _two_versions(tmp_path, server)
        with torch.no_grad():
            next(models[1].parameters()).view(torch.int16)[0] += 1
        with pytest.raises(EngineError, match="data-parallel engines hold different weights"):
            target.checksum()
        pub.close()
    finally:
        server.close()


def _completion(server: SglangServer, prompt: list[int]) -> list[float]:
    import urllib.request

    req = urllib.request.Request(
        f"{server.url}/v1/completions", data=json.dumps({"prompt": prompt}).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        values: list[float] = json.loads(resp.read())["choices"][0]["prompt_logprobs"]
    return values


@pytest.mark.parametrize("legacy", [False, True])
def test_reconcile_reloads_an_engine_that_reports_another_version(tmp_path: Path, legacy: bool) -> None:
    trainer, engine = llama(CONFIG, 0), llama(CONFIG, 1, dtype=torch.bfloat16)
    server = SglangServer(engine, legacy=legacy)
    try:
        with Publisher(str(tmp_path / "store"), "r") as pub:
            pub.publish(trainer.state_dict())
        Subscriber(str(tmp_path / "store"), "r", local_dir=tmp_path / "local").sync()
        target = SGLangTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url)
        assert target.engine_version() == "default"  # SGLang's label before any update
        target.reconcile()
        assert server.weight_version == "1" and _same_bits(engine, trainer)
        calls = len(server.calls)
        target.reconcile()  # already there: only the version (and the checksum) is asked for
        asked = [p for _, p in server.calls[calls:]]
        assert "/update_weights_from_disk" not in asked
        assert asked[0] == "/model_info" and ("/get_weight_version" in asked) is legacy
    finally:
        server.close()


def test_bad_urls_and_dead_engines(tmp_path: Path) -> None:
    local = LocalDirTarget(tmp_path / "local")
    with pytest.raises(ConfigError):
        SGLangTarget(local, "localhost:30000")
    server = SglangServer(llama(CONFIG, 1))
    url = server.url
    server.close()
    with pytest.raises(EngineError, match="unreachable"):
        SGLangTarget(local, url, timeout=5.0).engine_version()


# -- in place, through Bulletin's loader on every TP rank ---------------------------------


@pytest.fixture
def inplace() -> Iterator[tuple[torch.nn.Module, SglangServer]]:
    """An engine model and an SGLang server running Bulletin's loader over it."""
    engine = llama(CONFIG, 1, dtype=torch.bfloat16)
    server = SglangServer(engine, custom_weight_loader=[LOADER])
    yield engine, server
    server.close()


def _inplace_versions(
    tmp_path: Path, server: SglangServer
) -> tuple[Subscriber, SGLangInPlaceTarget, Publisher, torch.nn.Module, torch.nn.Module]:
    target = open_sglang(LocalDirTarget(tmp_path / "local", run="r"), server.url)
    assert isinstance(target, SGLangInPlaceTarget)
    return _two_versions(tmp_path, server, target)


def _five_versions_in_place(
    tmp_path: Path, server: SglangServer, config: Any, exact: Callable[[torch.nn.Module], bool]
) -> tuple[Subscriber, SGLangInPlaceTarget]:
    """Five versions (keyframes 1 and 4) synced in place; after each, ``exact(trainer)``
    and SGLang's label."""
    trainer = llama(config, 0)
    target = open_sglang(LocalDirTarget(tmp_path / "local", run="r"), server.url)
    assert isinstance(target, SGLangInPlaceTarget)
    sub = Subscriber(str(tmp_path / "store"), "r", target=target)
    with Publisher(str(tmp_path / "store"), "r", keyframe_every=3) as pub:
        for step in range(5):
            if step:
                _step(trainer)
            version = pub.publish(trainer.state_dict())
            assert sub.sync() == version
            assert exact(trainer), f"version {version}"
            assert server.weight_version == str(version)
    return sub, target


def test_in_place_versions_are_bit_exact_labelled_and_never_reloaded(
    tmp_path: Path, inplace: tuple[torch.nn.Module, SglangServer]
) -> None:
    engine, server = inplace
    _five_versions_in_place(tmp_path, server, CONFIG, lambda trainer: _same_bits(engine, trainer))
    assert server.count("/update_weights_from_disk") == 0  # no reload, ever
    assert server.count("/flush_cache") == 0  # SGLang flushed inside the activating call
    assert server.count("/pause_generation") == server.count("/continue_generation") == 5
    assert server.session is None and not server.paused and server.dead is None


def test_in_place_a_rank_holding_other_bits_refuses_the_version_before_writing(
    tmp_path: Path, inplace: tuple[torch.nn.Module, SglangServer]
) -> None:
    engine, server = inplace
    sub, _target, pub, v1, v2 = _inplace_versions(tmp_path, server)
    with torch.no_grad():  # the rank's copy of one tensor is damaged
        engine.model.norm.weight.view(torch.int16)[0] += 1
    damaged = {n: t.clone() for n, t in engine.state_dict().items()}
    with pytest.raises(WrongBase):
        sub.sync()
    assert sub.current_version == 1 and server.weight_version == "1"
    assert all(torch.equal(damaged[n], t) for n, t in engine.state_dict().items())  # nothing written
    assert not server.paused  # generation resumed on the version held
    report = sub.verify()  # what the sidecar runs after a failed sync: damage found, rebuilt
    assert not report.ok and report.repaired_to == 1 and _same_bits(engine, v1)
    assert sub.sync() == 2 and _same_bits(engine, v2) and server.weight_version == "2"
    pub.close()


def test_in_place_a_failure_inside_a_rank_is_reported_and_never_kills_sglang(
    tmp_path: Path, inplace: tuple[torch.nn.Module, SglangServer]
) -> None:
    engine, server = inplace
    _sub, target, pub, v1, _ = _inplace_versions(tmp_path, server)
    # An exception in the loader would kill SGLang's scheduler: the rank answers instead.
    with pytest.raises(EngineError, match="FileNotFoundError"):
        target.call("apply", {"shards": [str(tmp_path / "gone.bpatch")], "fingerprints": {}})
    with pytest.raises(InvalidInput, match="unknown method"):
        target.call("format_disk", {})
    assert server.dead is None and server.session is None and _same_bits(engine, v1)
    # What SGLang does with an exception in a rank, for contrast: the server is gone.
    server.custom_weight_loader.append("tests.sidecar.engine_servers.no_such_loader")
    target.loader = "tests.sidecar.engine_servers.no_such_loader"
    with pytest.raises(EngineError, match="HTTP 500"):
        target.call("fingerprints", {})
    assert server.dead is not None
    pub.close()


def test_in_place_a_prompt_sharing_a_cached_prefix_gets_the_new_versions_numbers(
    tmp_path: Path, inplace: tuple[torch.nn.Module, SglangServer]
) -> None:
    engine, server = inplace
    sub, _, pub, _, _ = _inplace_versions(tmp_path, server)
    prompt = [5, 3, 5, 8, 9, 7, 9]
    old = _completion(server, prompt)
    assert server.caches[0].blocks
    assert sub.sync() == 2
    new = _completion(server, [*prompt, 1])
    assert new == prefix_values(engine, [*prompt, 1]) and new[: len(prompt)] != old
    pub.close()


def test_in_place_a_restarted_sidecar_resumes_a_server_its_predecessor_left_paused(
    tmp_path: Path, inplace: tuple[torch.nn.Module, SglangServer]
) -> None:
    _, server = inplace
    _sub, target, pub, _, _ = _inplace_versions(tmp_path, server)
    target.pause()  # a sidecar that died mid-update
    target.close()
    local = LocalDirTarget(tmp_path / "local", run="r")
    again = Subscriber(str(tmp_path / "store"), "r", target=open_sglang(local, server.url))
    assert again.current_version == 1 and not server.paused
    assert again.sync() == 2
    pub.close()


def test_the_mode_follows_the_server(tmp_path: Path) -> None:
    local = LocalDirTarget(tmp_path / "local", run="r")
    cases = [
        (SglangServer(llama(CONFIG, 1), custom_weight_loader=[LOADER]), "auto", SGLangInPlaceTarget),
        (SglangServer(llama(CONFIG, 1)), "auto", SGLangTarget),
        (SglangServer(llama(CONFIG, 1), legacy=True), "auto", SGLangTarget),
        (
            SglangServer(engines=[llama(CONFIG, 1), llama(CONFIG, 1)], custom_weight_loader=[LOADER]),
            "auto",
            SGLangTarget,
        ),
        (SglangServer(llama(CONFIG, 1), custom_weight_loader=[LOADER]), "disk", SGLangTarget),
    ]
    try:
        for server, mode, kind in cases:
            assert type(open_sglang(local, server.url, mode=mode)) is kind
        with pytest.raises(ConfigError, match="custom-weight-loader"):
            open_sglang(local, cases[1][0].url, mode="inplace")
        with pytest.raises(ConfigError, match="data-parallel"):
            open_sglang(local, cases[3][0].url, mode="inplace")
        with pytest.raises(ConfigError, match="unknown SGLang mode"):
            open_sglang(local, cases[0][0].url, mode="fast")
    finally:
        for server, _, _ in cases:
            server.close()


@pytest.mark.parametrize("readback", [True, False])
def test_a_reload_that_silently_kept_old_bits_is_caught_by_the_ranks_fingerprints(
    tmp_path: Path, readback: bool
) -> None:
    engine = llama(CONFIG, 1, dtype=torch.bfloat16)
    server = SglangServer(engine, custom_weight_loader=[LOADER])
    try:
        local = LocalDirTarget(tmp_path / "local", run="r")
        sub, _target, pub, v1, v2 = _two_versions(tmp_path, server, SGLangTarget(local, server.url, readback=readback))
        # SGLang reports success, its checksum is self-consistent, but some tensors were skipped.
        server.fault = LoadFault(after=2, silent=True)
        if readback:
            with pytest.raises(VerificationFailed, match="other bits than the folder"):
                sub.sync()
            assert sub.current_version == 1 and _same_bits(engine, v1) and server.weight_version == "1"
            assert sub.sync() == 2 and _same_bits(engine, v2)
        else:  # without the read-back the version is taken over bits it does not have
            assert sub.sync() == 2 and not _same_bits(engine, v2)
        pub.close()
    finally:
        server.close()


def test_serve_settings_refuse_an_unknown_sglang_mode(tmp_path: Path) -> None:
    from bulletin.sidecar.compose import SidecarSettings

    with pytest.raises(ConfigError, match="unknown SGLang mode"):
        SidecarSettings(
            store=str(tmp_path),
            run="r",
            engine="sglang",
            upstream="http://127.0.0.1:9",
            local_dir=tmp_path,
            sglang_mode="x",
        )


# -- tensor parallel: every TP rank patches its own shards in place ------------------------

#: Four query and two KV heads (KV heads replicated at TP=4), a vocabulary of 100 that
#: SGLang pads per rank with its own rule (padding 6: 102 rows at TP=2; at TP=4 102 does
#: not divide by 4, so the padding becomes 24 and rank 3 holds 10 rows and 20 padding).
TP_CONFIG = llama_config(
    vocab=100, hidden=16, intermediate=32, layers=2, heads=4, kv_heads=2, max_positions=32, tied=False
)


def _reference(trainer: torch.nn.Module, ranks: list[Any]) -> list[torch.nn.Module]:
    """What SGLang's own loader puts into each of ``ranks`` from the trainer's BF16 checkpoint."""
    return list(loaded_like(ranks, trainer.state_dict()))


def _same_shards(ranks: list[torch.nn.Module], reference: list[torch.nn.Module]) -> bool:
    return all(
        torch.equal(a.view(torch.int16), b.view(torch.int16))
        for live, ref in zip(ranks, reference, strict=True)
        for a, b in zip(live.state_dict().values(), ref.state_dict().values(), strict=True)
    )


@pytest.fixture(params=[(2, None), (4, None), (4, 2)], ids=["tp2", "tp4", "tp4-kv-group2"])
def tp_server(request: pytest.FixtureRequest) -> Iterator[tuple[list[torch.nn.Module], SglangServer]]:
    # tp4-kv-group2: QKV's K/V over a KV group of 2 (rank r % 2) under TP 4.
    tp, kv_tp = request.param
    ranks: list[torch.nn.Module] = list(sglang_ranks(TP_CONFIG, tp, kv_tp=kv_tp, padding_size=6))
    server = SglangServer(ranks=ranks, custom_weight_loader=[LOADER])
    yield ranks, server
    server.close()


def test_tp_data_parallel_attention_with_whole_heads_per_rank_is_mapped_exactly(tmp_path: Path) -> None:
    # --enable-dp-attention, attention TP 1: every rank holds all heads (replicas), the
    # MLPs and embeddings are sharded over TP 2.
    ranks: list[torch.nn.Module] = list(sglang_ranks(TP_CONFIG, 2, attn_tp=1, padding_size=6))
    server = SglangServer(ranks=ranks, custom_weight_loader=[LOADER])
    try:
        sub, target, pub, _, v2 = _two_versions(
            tmp_path, server, open_sglang(LocalDirTarget(tmp_path / "local", run="r"), server.url), TP_CONFIG
        )
        assert sub.sync() == 2 and _same_shards(ranks, _reference(v2, ranks))
        assert target.plan.sets["model.layers.0.self_attn.q_proj.weight"] == [(0, 1)]  # one replica set
        assert len(target.plan.sets["model.layers.0.mlp.up_proj.weight"]) == 2  # two shards
        pub.close()
    finally:
        server.close()


def _every_rank_exact_in_place(tmp_path: Path, ranks: list[torch.nn.Module], server: SglangServer) -> ReplicaPlan:
    """Five versions synced in place, each rank's parameters what SGLang's loader puts
    there after each, never a new tensor nor a reload; a restarted sidecar resumes the
    last. Returns the ranks' plan."""
    storage = [[p.data_ptr() for p in m.parameters()] for m in ranks]
    sub, target = _five_versions_in_place(
        tmp_path, server, TP_CONFIG, lambda trainer: _same_shards(ranks, _reference(trainer, ranks))
    )
    plan = target.plan
    assert plan is not None and len(plan.layouts) == len(ranks)
    assert storage == [[p.data_ptr() for p in m.parameters()] for m in ranks]  # in place: no new tensors
    assert server.count("/update_weights_from_disk") == 0
    assert sub.verify().ok and server.session is None and not server.paused and server.dead is None
    target.close()  # a restarted sidecar takes the version the ranks' partials sum to
    again = open_sglang(LocalDirTarget(tmp_path / "local", run="r"), server.url)
    assert Subscriber(str(tmp_path / "store"), "r", target=again).current_version == 5
    again.close()
    return plan


def test_tp_in_place_every_rank_holds_exactly_its_shards_after_every_version(
    tmp_path: Path, tp_server: tuple[list[torch.nn.Module], SglangServer]
) -> None:
    ranks, server = tp_server
    plan = _every_rank_exact_in_place(tmp_path, ranks, server)
    if len(ranks) == 4:  # two KV heads over four ranks (or a KV group of 2): each KV piece held by two
        assert len(plan.sets["model.layers.0.self_attn.k_proj.weight"]) == 2


def _a_damaged_last_rank_refuses_the_version(
    tmp_path: Path, ranks: list[torch.nn.Module], server: SglangServer, layer: int, message: str
) -> None:
    """The last rank's shard of layer ``layer``'s down projection is damaged: the next
    version is refused as a whole (``message``), every rank rolled back, the damage found
    by the verification that follows and repaired, and the version then taken."""
    target = open_sglang(LocalDirTarget(tmp_path / "local", run="r"), server.url)
    sub, _target, pub, v1, v2 = _two_versions(tmp_path, server, target, TP_CONFIG)
    bad = ranks[-1]
    with torch.no_grad():
        bad.model.layers[layer].mlp.down_proj.weight.view(torch.int16)[:, :2] += 1
    damaged = {n: t.clone() for n, t in bad.state_dict().items()}
    with pytest.raises(WrongBase, match=message):
        sub.sync()
    assert sub.current_version == 1 and server.weight_version == "1" and not server.paused
    reference = _reference(v1, ranks)
    assert _same_shards(ranks[:-1], reference[:-1])  # the ranks that wrote put version 1 back
    assert all(torch.equal(damaged[n], t) for n, t in bad.state_dict().items())  # refused before writing
    report = sub.verify()  # what the sidecar runs after a failed sync: the damage is found
    assert not report.ok and report.mismatched == (f"model.layers.{layer}.mlp.down_proj.weight",)
    assert report.repaired_to == 1 and _same_shards(ranks, reference)
    assert sub.sync() == 2 and _same_shards(ranks, _reference(v2, ranks))
    assert server.dead is None and server.session is None
    pub.close()


def test_tp_a_corrupted_rank_refuses_the_whole_version_and_every_rank_rolls_back(
    tmp_path: Path, tp_server: tuple[list[torch.nn.Module], SglangServer]
) -> None:
    ranks, server = tp_server
    _a_damaged_last_rank_refuses_the_version(tmp_path, ranks, server, 0, f"TP rank {len(ranks) - 1}")


def test_tp_a_layout_that_cannot_be_mapped_is_refused_at_bind(tmp_path: Path) -> None:
    from bulletin.errors import IncompatibleLayout

    cases: list[tuple[str, list[torch.nn.Module]]] = []
    # Data-parallel attention with attention TP 2 of TP 4: attention layers are rank
    # r % 2 of 2, the rest rank r of 4; not one rank layout.
    cases.append(("disagree on their rank", list(sglang_ranks(TP_CONFIG, 4, attn_tp=2, padding_size=6))))
    # A quantized linear: its bits are not the checkpoint's.
    ranks = list(sglang_ranks(TP_CONFIG, 2, padding_size=6))
    fp8 = type("Fp8LinearMethod", (), {})
    for m in ranks:
        m.model.layers[1].mlp.down_proj.quant_method = fp8()
    cases.append(("quantized with Fp8LinearMethod", ranks))
    for i, (message, ranks) in enumerate(cases):
        server = SglangServer(ranks=ranks, custom_weight_loader=[LOADER])
        try:
            local = LocalDirTarget(tmp_path / f"local{i}", run="r")
            sub = Subscriber(str(tmp_path / "store"), "r", target=open_sglang(local, server.url))
            with Publisher(str(tmp_path / "store"), "r") as pub:
                if i == 0:
                    pub.publish(llama(TP_CONFIG, 0).state_dict())
                with pytest.raises(IncompatibleLayout, match=message):
                    sub.sync()
            assert sub.current_version is None and server.dead is None and server.session is None
        finally:
            server.close()


@pytest.mark.parametrize("silent", [False, True])
def test_tp_a_disk_reload_is_read_back_from_every_rank(tmp_path: Path, silent: bool) -> None:
    ranks: list[torch.nn.Module] = list(sglang_ranks(TP_CONFIG, 2, padding_size=6))
    server = SglangServer(ranks=ranks, custom_weight_loader=[LOADER])
    try:
        target = SGLangTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url, readback=True)
        sub, target, pub, v1, v2 = _two_versions(tmp_path, server, target, TP_CONFIG)
        assert _same_shards(ranks, _reference(v1, ranks))
        if silent:  # SGLang says success but skipped tensors: the ranks' partials show it
            server.fault = LoadFault(after=3, silent=True)
            with pytest.raises(VerificationFailed, match="other bits than the folder"):
                sub.sync()
            assert sub.current_version == 1 and _same_shards(ranks, _reference(v1, ranks))
        assert sub.sync() == 2 and _same_shards(ranks, _reference(v2, ranks)) and server.weight_version == "2"
        assert target.plan is not None and len(target.plan.layouts) == 2
        pub.close()
    finally:
        server.close()


# -- pipeline parallel: every stage's TP ranks patch the layers they hold -------------------


@pytest.fixture(params=[(1, 2), (2, 2)], ids=["pp2", "tp2-pp2"])
def pp_server(request: pytest.FixtureRequest) -> Iterator[tuple[list[torch.nn.Module], SglangServer]]:
    tp, pp = request.param
    ranks: list[torch.nn.Module] = list(sglang_ranks(TP_CONFIG, tp, padding_size=6, pp=pp))
    server = SglangServer(ranks=ranks, custom_weight_loader=[LOADER], pp_size=pp)
    yield ranks, server
    server.close()


def test_pp_in_place_every_stage_holds_exactly_its_layers_after_every_version(
    tmp_path: Path, pp_server: tuple[list[torch.nn.Module], SglangServer]
) -> None:
    # Stage 0: the embedding and layer 0; stage 1: layer 1 and the final norm; the untied
    # LM head on both (SGLang builds it on every stage). Stage 1 runs each call after
    # SGLang answered it: its replies are waited for.
    ranks, server = pp_server
    tp = server.tp_size
    plan = _every_rank_exact_in_place(tmp_path, ranks, server)
    assert [layout.key for layout in plan.layouts] == [f"{s}.{r}" for s in range(2) for r in range(tp)]
    assert len(plan.sets["model.layers.0.mlp.down_proj.weight"]) == tp  # stage 0's alone
    assert all(len(group) == 2 for group in plan.sets["lm_head.weight"])  # a replica on each stage


def test_pp_a_corrupted_rank_of_the_last_stage_refuses_the_whole_version(
    tmp_path: Path, pp_server: tuple[list[torch.nn.Module], SglangServer]
) -> None:
    ranks, server = pp_server  # the last stage holds layer 1
    _a_damaged_last_rank_refuses_the_version(
        tmp_path, ranks, server, 1, f"TP rank {server.tp_size - 1} of pipeline stage 1"
    )


def test_pp_a_stage_that_never_answers_is_an_engine_error_and_nothing_is_claimed(tmp_path: Path) -> None:
    ranks: list[torch.nn.Module] = list(sglang_ranks(TP_CONFIG, 1, padding_size=6, pp=2))
    server = SglangServer(ranks=ranks, custom_weight_loader=[LOADER], pp_size=2)
    try:
        local = LocalDirTarget(tmp_path / "local", run="r")
        sub = Subscriber(str(tmp_path / "store"), "r", target=open_sglang(local, server.url, timeout=0.5))
        with Publisher(str(tmp_path / "store"), "r") as pub:
            pub.publish(llama(TP_CONFIG, 0).state_dict())
            server.stage_lag = 2.0  # stage 1 lags past the sidecar's timeout
            with pytest.raises(EngineError, match="TP rank 0 of pipeline stage 1 did not answer bind"):
                sub.sync()
        assert sub.current_version is None
    finally:
        server.close()


def test_pp_a_rank_answers_only_requests_for_its_engines_stages(tmp_path: Path) -> None:
    import base64
    import pickle

    from bulletin.engines.sglang_loader import apply, encode_requests, reply_path

    stage1 = sglang_ranks(TP_CONFIG, 1, padding_size=6, pp=2)[1]
    base = {"method": "fingerprints", "rank": 0, "ranks": 1, "reply": str(tmp_path), "body": {}}
    cases = [
        ({"bulletin": 1, **base}, "a request for one pipeline stage reached stage 1 of 2"),
        ({"bulletin": 2, **base, "stages": 3, "per_stage": [{}, {}, {}]}, "request for 3 pipeline stages"),
        ({"bulletin": 2, **base, "stages": 2, "per_stage": [{}, []]}, "part for pipeline stage 1 is not an object"),
    ]
    for request, message in cases:
        (payload,) = encode_requests([request])
        apply(stage1, pickle.loads(base64.b64decode(payload)))  # never raises
        reply = json.loads(reply_path(tmp_path, 0, 1).read_text())  # stage 1's own file
        assert reply["ok"] is False and message in reply["message"] and reply["stage"] == 1
        assert not reply_path(tmp_path, 0).exists()  # stage 0's reply is never written by stage 1
