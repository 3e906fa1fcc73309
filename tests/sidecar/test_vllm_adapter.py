"""The vLLM adapter: the worker extension patches fused parameters in place, driven
through vLLM's ``/collective_rpc`` contract by the sidecar-side VLLMTarget."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from transformers import LlamaForCausalLM

from bulletin.engines.rank_layout import RankLayout, ReplicaPlan
from bulletin.engines.vllm import VLLMTarget, WorkerState
from bulletin.engines.wire import specs_from_json
from bulletin.errors import EngineError, IncompatibleTensors, InvalidInput, VerificationFailed, WrongBase
from bulletin.publisher import Publisher
from bulletin.snapshot import snapshot
from bulletin.subscriber import Subscriber
from bulletin.target import LocalDirTarget
from patcher.fingerprint import fingerprint, parse_fingerprint
from scripts._common import llama, llama_config
from tests.sidecar.engine_servers import VllmServer, extended_worker

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 32, 48, 2, 4, 2, 100
CONFIG = llama_config(
    vocab=VOCAB, hidden=HIDDEN, intermediate=INTERMEDIATE, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS
)
PADDED_VOCAB = 128  # vLLM pads the vocabulary (to a multiple of 64)


def _weight(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(*shape, dtype=torch.bfloat16), requires_grad=False)


class _Weight(torch.nn.Module):
    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = _weight(*shape)


class _Attention(torch.nn.Module):
    def __init__(self, h: int, kv: int) -> None:
        super().__init__()
        self.qkv_proj = _Weight(h + 2 * kv, h)
        self.o_proj = _Weight(h, h)


class _Mlp(torch.nn.Module):
    def __init__(self, h: int, i: int) -> None:
        super().__init__()
        self.gate_up_proj = _Weight(2 * i, h)
        self.down_proj = _Weight(h, i)


class _Layer(torch.nn.Module):
    def __init__(self, h: int, i: int, kv: int) -> None:
        super().__init__()
        self.self_attn = _Attention(h, kv)
        self.mlp = _Mlp(h, i)
        self.input_layernorm = _Weight(h)
        self.post_attention_layernorm = _Weight(h)


class _Inner(torch.nn.Module):
    def __init__(self, h: int, i: int, kv: int, layers: int) -> None:
        super().__init__()
        self.embed_tokens = _Weight(PADDED_VOCAB, h)
        self.layers = torch.nn.ModuleList(_Layer(h, i, kv) for _ in range(layers))
        self.norm = _Weight(h)


class VllmLlama(torch.nn.Module):
    """A Llama laid out as vLLM lays it out: qkv and gate/up fused, vocabulary padded,
    lm_head tied to the embedding. Zeros until something loads weights into it."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self) -> None:
        super().__init__()
        self.model = _Inner(HIDDEN, INTERMEDIATE, KV_HEADS * HIDDEN // HEADS, LAYERS)
        self.lm_head = _Weight(1)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied, as vLLM ties it

    def layer(self, n: int) -> _Layer:
        layer = self.model.layers[n]
        assert isinstance(layer, _Layer)
        return layer


def _fps(answer: dict[str, Any]) -> dict[str, int]:
    return {n: parse_fingerprint(v) for n, v in answer["fingerprints"].items()}


def expected_fused(trainer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What each vLLM parameter must hold: the trainer's BF16 tensors, fused and padded."""
    sd = {k: v.detach().to(torch.bfloat16) for k, v in trainer.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    embed = torch.zeros(PADDED_VOCAB, HIDDEN, dtype=torch.bfloat16)
    embed[:VOCAB] = sd["model.embed_tokens.weight"]
    out["model.embed_tokens.weight"] = embed
    for n in range(LAYERS):
        pre = f"model.layers.{n}."
        out[pre + "self_attn.qkv_proj.weight"] = torch.cat([sd[pre + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[pre + "mlp.gate_up_proj.weight"] = torch.cat(
            [sd[pre + "mlp.gate_proj.weight"], sd[pre + "mlp.up_proj.weight"]]
        )
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            out[pre + name] = sd[pre + name]
        out[pre + "post_attention_layernorm.weight"] = sd[pre + "post_attention_layernorm.weight"]
    out["model.norm.weight"] = sd["model.norm.weight"]
    return out


def assert_holds(engine: VllmLlama, trainer: torch.nn.Module) -> None:
    params = dict(engine.named_parameters())
    for name, want in expected_fused(trainer).items():
        got = params[name]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randint(0, VOCAB, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture
def trainer() -> LlamaForCausalLM:
    return llama(CONFIG, 0)


@pytest.fixture
def engines() -> Iterator[tuple[VllmServer, list[VllmLlama]]]:
    models = [VllmLlama(), VllmLlama()]  # two workers
    server = VllmServer([extended_worker(m) for m in models])
    try:
        yield server, models
    finally:
        server.close()


def test_worker_binds_and_loads_a_keyframe_into_fused_parameters(tmp_path: Path, trainer: LlamaForCausalLM) -> None:
    from bulletin.checkpoint import write_checkpoint

    snap = snapshot(trainer.state_dict(), dtype="BF16")
    write_checkpoint(tmp_path / "kf", snap.specs, snap.bits)
    engine = VllmLlama()
    state = WorkerState(engine)
    specs = [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in snap.specs.values()]
    out = state.handle("load", json.dumps({"specs": specs, "path": str(tmp_path / "kf")}))
    assert out["ok"] is True
    # What it answers is read back from the live parameters: the keyframe's fingerprints.
    assert _fps(out) == {n: fingerprint(b) for n, b in snap.bits.items()}
    assert_holds(engine, trainer)
    # The tie held: lm_head is the embedding, written once through its served name.
    assert engine.lm_head.weight.data_ptr() == engine.model.embed_tokens.weight.data_ptr()


def test_worker_errors_come_back_as_codes_not_exceptions(trainer: LlamaForCausalLM) -> None:
    state = WorkerState(VllmLlama())
    assert state.handle("apply", "not json")["code"] == "invalid_input"
    assert state.handle("apply", "{}") == {
        "ok": False,
        "code": "invalid_input",
        "message": "the worker has not been bound to a layout yet",
    }
    # A tensor the rank cannot place is absent (another pipeline stage may hold it); the
    # sidecar's plan over every rank refuses one that no rank holds.
    bad = [{"name": "model.layers.0.self_attn.q_proj.weight", "dtype": "BF16", "shape": [33, 32]}]
    out = state.handle("bind", json.dumps({"specs": bad}))
    assert out["ok"] is True and out["layout"]["absent"] == [bad[0]["name"]]
    with pytest.raises(IncompatibleTensors, match="held by no rank"):
        ReplicaPlan([RankLayout.from_json(out["layout"])], specs_from_json(bad))
    assert state.handle("nonsense", json.dumps({"specs": []}))["code"] == "invalid_input"


def test_sidecar_target_follows_a_run_through_collective_rpc(
    tmp_path: Path, trainer: LlamaForCausalLM, engines: tuple[VllmServer, list[VllmLlama]]
) -> None:
    server, models = engines
    store = str(tmp_path / "store")
    target = VLLMTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url)
    sub = Subscriber(store, "r", target=target)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    with Publisher(store, "r", keyframe_every=10) as pub:
        for step in range(3):
            if step:
                train_step(trainer, opt)
            version = pub.publish(trainer.state_dict())
            assert sub.sync() == version
            for model in models:
                assert_holds(model, trainer)
    assert not any(target.spool_dir.iterdir())  # spooled patches are cleaned up
    methods = [json.loads(json.dumps(c)) for c in server.calls]
    assert ["POST", "/collective_rpc"] in methods
    # Binding may probe parameters (the sparse fallback): the engine never steps meanwhile.
    binds = [p for m, p in zip(server.rpc_methods, server.rpc_paused, strict=True) if m == "bulletin_bind"]
    assert binds and all(p is not None for p in binds) and server.paused is None
    # A restarted sidecar recognises that the engine already holds the folder's version.
    sub.close()  # the folder has one writer at a time
    again = VLLMTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url)
    restored = again.restored()
    assert restored is not None and restored.version == 3


def test_a_tampered_worker_is_refused_and_nothing_moves(
    tmp_path: Path, trainer: LlamaForCausalLM, engines: tuple[VllmServer, list[VllmLlama]]
) -> None:
    server, models = engines
    store = str(tmp_path / "store")
    local = LocalDirTarget(tmp_path / "local", run="r")
    sub = Subscriber(store, "r", target=VLLMTarget(local, server.url))
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    with Publisher(store, "r", keyframe_every=10) as pub:
        pub.publish(trainer.state_dict())
        sub.sync()
        with torch.no_grad():
            # Worker 1 no longer holds version 1 where the next patch writes. (Applies are
            # O(changed): damage elsewhere is for a full `verify`, not for an apply, to find.)
            models[1].layer(0).self_attn.qkv_proj.weight.add_(1)
        before = [m.layer(0).self_attn.qkv_proj.weight.clone() for m in models]
        train_step(trainer, opt)
        pub.publish(trainer.state_dict())
        with pytest.raises(WrongBase):
            sub.sync()
    assert sub.current_version == 1
    restored = local.restored()
    assert restored is not None and restored.version == 1
    for model, old in zip(models, before, strict=True):  # worker 0 applied, then took it back
        assert torch.equal(model.layer(0).self_attn.qkv_proj.weight, old)


def test_engine_without_dev_mode_is_a_clear_error(tmp_path: Path) -> None:
    server = VllmServer([], dev_mode=False)
    try:
        target = VLLMTarget(LocalDirTarget(tmp_path / "local"), server.url)
        with pytest.raises(EngineError, match="VLLM_SERVER_DEV_MODE"):
            target.call("fingerprints", {})
    finally:
        server.close()
    dead = VLLMTarget(LocalDirTarget(tmp_path / "local2"), server.url)
    with pytest.raises(EngineError, match="unreachable"):
        dead.call("fingerprints", {})


def test_worker_extension_names_cannot_clash_with_vllm_workers() -> None:
    from bulletin.engines.vllm import BulletinWorkerExtension

    names: list[Any] = [n for n in dir(BulletinWorkerExtension) if not n.startswith("__")]
    assert names and all(n.startswith("bulletin_") for n in names)


# -- what the real engine does around a weight change ------------------------------------


def _completion(server: VllmServer, prompt: list[int], **extra: Any) -> dict[str, Any]:
    import urllib.request

    req = urllib.request.Request(
        f"{server.url}/v1/completions", data=json.dumps({"prompt": prompt, **extra}).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


def test_a_prompt_sharing_a_cached_prefix_gets_the_new_versions_numbers(
    tmp_path: Path, trainer: LlamaForCausalLM, engines: tuple[VllmServer, list[VllmLlama]]
) -> None:
    from tests.sidecar.engine_servers import prefix_values

    server, models = engines
    store = str(tmp_path / "store")
    sub = Subscriber(store, "r", target=VLLMTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url))
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    with Publisher(store, "r", keyframe_every=10) as pub:
        pub.publish(trainer.state_dict())
        sub.sync()
        old = _completion(server, prompt)["choices"][0]["prompt_logprobs"]
        assert server.caches[0].blocks  # the engine cached the prompt's blocks
        train_step(trainer, opt)
        pub.publish(trainer.state_dict())
        sub.sync()
    new = _completion(server, [*prompt, 7])["choices"][0]["prompt_logprobs"]
    # Exactly what the new bits compute, not the cached old prefix (which differs).
    assert new == prefix_values(models[0], [*prompt, 7])
    assert new[: len(prompt)] != old
    assert server.encoder_resets >= 1
    # vLLM labels its outputs with Bulletin's version.
    assert server.weight_versions == ["2"] and sub.target.engine_version() == "2"  # type: ignore[attr-defined]


def test_the_engine_is_paused_while_bits_change_and_running_requests_end_as_aborted(
    tmp_path: Path, trainer: LlamaForCausalLM, engines: tuple[VllmServer, list[VllmLlama]]
) -> None:
    import threading

    server, _ = engines
    store = str(tmp_path / "store")
    sub = Subscriber(store, "r", target=VLLMTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url))
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    with Publisher(store, "r", keyframe_every=10) as pub:
        pub.publish(trainer.state_dict())
        sub.sync()
        answers: list[dict[str, Any]] = []
        running = threading.Thread(target=lambda: answers.append(_completion(server, [1, 2], hold=True)))
        running.start()  # a request that outlived the sidecar's drain
        while not server.running:
            pass
        train_step(trainer, opt)
        pub.publish(trainer.state_dict())
        server.calls.clear()
        sub.sync()
        running.join(10)
    assert answers[0]["choices"][0]["finish_reason"] == "abort"  # a clear signal, not a silent cut
    paths = [p for _, p in server.calls]
    assert paths.index("/pause") < paths.index("/resume")
    assert paths.index("/reset_prefix_cache") < paths.index("/resume") and server.paused is None
    # The workers decode and check their parts while the engine serves; only the writes
    # run paused.
    modes = dict(zip(server.rpc_methods, server.rpc_paused, strict=True))
    assert modes["bulletin_prepare"] is None and modes["bulletin_apply"] == "abort"


def test_every_data_parallel_engine_is_checked_not_only_the_first(tmp_path: Path, trainer: LlamaForCausalLM) -> None:
    models = [VllmLlama(), VllmLlama()]
    server = VllmServer(engines=[[extended_worker(models[0])], [extended_worker(models[1])]])
    try:
        store = str(tmp_path / "store")
        local = LocalDirTarget(tmp_path / "local", run="r")
        target = VLLMTarget(local, server.url)
        sub = Subscriber(store, "r", target=target)
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
        with Publisher(store, "r", keyframe_every=10) as pub:
            pub.publish(trainer.state_dict())
            sub.sync()
            assert_holds(models[1], trainer)  # the second engine loaded too
            with torch.no_grad():  # damage on the engine whose results vLLM does not return
                models[1].layer(0).self_attn.qkv_proj.weight.add_(1)
            found = target.full_fingerprints()
            assert found != sub.held.fingerprints  # type: ignore[union-attr]
            train_step(trainer, opt)
            pub.publish(trainer.state_dict())
            with pytest.raises(WrongBase):  # refused by engine 1, although only engine 0 answers
                sub.sync()
        assert sub.current_version == 1
    finally:
        server.close()


def test_a_keyframe_is_read_back_from_the_engine_before_activation(
    tmp_path: Path, trainer: LlamaForCausalLM, engines: tuple[VllmServer, list[VllmLlama]]
) -> None:
    server, _models = engines
    store = str(tmp_path / "store")
    sub = Subscriber(store, "r", target=VLLMTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url))
    worker = server.workers[1]
    state = worker.bulletin_state()
    real_bind = state.bind

    def bind_then_lose_writes(specs: Any) -> None:
        real_bind(specs)
        target = state.target
        assert target is not None
        real_load = target.load_full

        def load_but_one(tensors: Any, specs: Any) -> None:
            real_load(tensors, specs)
            with torch.no_grad():  # one element of this worker's copy did not land
                target.tensors["model.norm.weight"].view(torch.int16)[0] += 1

        target.load_full = load_but_one  # type: ignore[method-assign]

    state.bind = bind_then_lose_writes
    with Publisher(store, "r", keyframe_every=10) as pub:
        pub.publish(trainer.state_dict())
        with pytest.raises(VerificationFailed, match="holds other bits"):
            sub.sync()
    assert sub.current_version is None  # never activated


def test_tensors_the_engine_does_not_serve_are_kept_in_the_folder_only(tmp_path: Path) -> None:
    trainer = llama(CONFIG, 0)
    # A rotary table and an MTP layer (index past the engine's last layer) in the checkpoint.
    extra = {
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.arange(4, dtype=torch.float32),
        f"model.layers.{LAYERS}.eh_proj.weight": torch.ones(HIDDEN, 2 * HIDDEN),
    }
    models = [VllmLlama()]
    server = VllmServer([extended_worker(m) for m in models])
    try:
        store = str(tmp_path / "store")
        target = VLLMTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url)
        sub = Subscriber(store, "r", target=target)
        with Publisher(store, "r", keyframe_every=10) as pub:
            pub.publish({**trainer.state_dict(), **extra})
            assert sub.sync() == 1
            assert target.dropped == frozenset(extra)
            assert_holds(models[0], trainer)
            pub.publish({**trainer.state_dict(), **{n: t + 1 for n, t in extra.items()}})
            assert sub.sync() == 2  # patched in the folder, not in the engine
        assert sub.verify().ok
        # Anything else the engine lacks is an incompatibility, named.
        missing = {**trainer.state_dict(), "model.layers.0.mlp.extra.weight": torch.ones(2)}
        with Publisher(store, "r2", keyframe_every=10) as pub:
            pub.publish(missing)
        other = VLLMTarget(LocalDirTarget(tmp_path / "local2", run="r2"), server.url)
        with pytest.raises(IncompatibleTensors, match="extra"):
            Subscriber(store, "r2", target=other).sync()
    finally:
        server.close()


def test_engine_errors_bad_json_and_timeouts_are_clear(tmp_path: Path, engines: tuple[VllmServer, Any]) -> None:
    import urllib.error
    import urllib.request

    server, _ = engines
    req = urllib.request.Request(f"{server.url}/collective_rpc", data=b"{nope", method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(req, timeout=10)
    assert caught.value.code == 400  # as vLLM answers a body that is not JSON
    caught.value.close()
    target = VLLMTarget(LocalDirTarget(tmp_path / "local"), server.url, timeout=0.05)
    server.worker_delay = 1.0
    with pytest.raises(EngineError, match="timed out"):
        target.call("fingerprints", {})
    server.worker_delay = 0.0
    with pytest.raises(InvalidInput, match="specs must be a list"):  # a worker's error, by its code
        target.call("abort", {"specs": "bad"})


def _stage(model: VllmLlama, drop: list[str]) -> VllmLlama:
    """A pipeline stage: the layers another stage holds are vLLM's ``PPMissingLayer``
    (an ``Identity``, ``model_executor/models/utils.py``), without parameters."""
    for path in drop:
        parent, _, name = path.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if isinstance(owner, torch.nn.ModuleList):
            owner[int(name)] = torch.nn.Identity()
        else:
            setattr(owner, name, torch.nn.Identity())
    return model


def test_pipeline_stages_patch_only_their_own_layers_and_must_cover_every_tensor(
    tmp_path: Path, trainer: LlamaForCausalLM
) -> None:
    # Stage 0: embedding and layer 0; stage 1: layer 1, the final norm and the tied head
    # (vLLM's last stage holds lm_head, here the embedding it is tied to).
    stages = [_stage(VllmLlama(), ["model.layers.1", "model.norm"]), _stage(VllmLlama(), ["model.layers.0"])]
    server = VllmServer([extended_worker(m, pp_rank=i) for i, m in enumerate(stages)])
    store = str(tmp_path / "store")
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    try:
        sub = Subscriber(store, "r", target=VLLMTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url))
        with Publisher(store, "r", keyframe_every=10) as pub:
            for step in range(3):  # a keyframe, then two patches applied in place per stage
                if step:
                    train_step(trainer, opt)
                version = pub.publish(trainer.state_dict())
                assert sub.sync() == version
                want = expected_fused(trainer)
                for stage in stages:
                    params = dict(stage.named_parameters())
                    held = [n for n in want if n in params]
                    assert held and all(
                        torch.equal(params[n].view(torch.int16), want[n].view(torch.int16)) for n in held
                    )
        sub.close()
    finally:
        server.close()
    # A tensor no stage holds (the final norm dropped from both) is refused at bind.
    uncovered = [
        _stage(VllmLlama(), ["model.layers.1", "model.norm"]),
        _stage(VllmLlama(), ["model.layers.0", "model.norm"]),
    ]
    server = VllmServer([extended_worker(m, pp_rank=i) for i, m in enumerate(uncovered)])
    try:
        sub = Subscriber(store, "r", target=VLLMTarget(LocalDirTarget(tmp_path / "other", run="r"), server.url))
        with pytest.raises(IncompatibleTensors, match=r"model\.norm\.weight"):
            sub.sync()
        sub.close()
    finally:
        server.close()


def test_activation_makes_no_worker_call_and_an_abort_never_undoes_an_activated_apply(
    tmp_path: Path, trainer: LlamaForCausalLM, engines: tuple[VllmServer, list[VllmLlama]]
) -> None:
    import copy

    server, models = engines
    store = str(tmp_path / "store")
    local = LocalDirTarget(tmp_path / "local", run="r")
    target = VLLMTarget(local, server.url)
    sub = Subscriber(store, "r", target=target)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    with Publisher(store, "r", keyframe_every=10) as pub:
        pub.publish(trainer.state_dict())
        sub.sync()
        train_step(trainer, opt)
        pub.publish(trainer.state_dict())
        server.rpc_methods.clear()
        sub.sync()
        # The pause is pause, apply, the cache resets and the label at once, resume: the
        # workers keep their undo data until the next request naming a base commits it.
        assert server.rpc_methods == ["bulletin_prepare", "bulletin_apply"]
        assert server.weight_versions == ["2"] and server.paused is None
        at_two = copy.deepcopy(trainer)
        # The next version fails on the sidecar after the folder's apply and before any
        # worker hears of it: the abort that follows names no apply of theirs, so the
        # activated one (still undoable on the workers) stays.
        train_step(trainer, opt)
        pub.publish(trainer.state_dict())
        spool = target.spool_dir
        target.spool_dir = tmp_path / "not-a-folder"
        target.spool_dir.write_text("")
        with pytest.raises(OSError):
            sub.sync()
        assert "bulletin_abort" in server.rpc_methods and server.paused is None
        for model in models:
            assert_holds(model, at_two)
        target.spool_dir = spool
        assert sub.sync() == 3  # the next prepare commits version 2's apply, then applies 3
        for model in models:
            assert_holds(model, trainer)
    sub.close()


class _FailingResetServer(VllmServer):
    """``/reset_encoder_cache`` fails while ``fail`` is set (the other calls succeed)."""

    fail = False

    def _reset_encoder_cache(self, call: Any) -> tuple[int, Any]:
        if self.fail:
            return 500, {"error": {"message": "reset failed", "code": 500}}
        return super()._reset_encoder_cache(call)


def test_a_failed_activation_puts_the_workers_the_label_and_the_folder_back(
    tmp_path: Path, trainer: LlamaForCausalLM
) -> None:
    import copy

    models = [VllmLlama(), VllmLlama()]
    server = _FailingResetServer([extended_worker(m) for m in models])
    try:
        store = str(tmp_path / "store")
        local = LocalDirTarget(tmp_path / "local", run="r")
        sub = Subscriber(store, "r", target=VLLMTarget(local, server.url))
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
        with Publisher(store, "r", keyframe_every=10) as pub:
            for step in range(2):
                if step:
                    train_step(trainer, opt)
                pub.publish(trainer.state_dict())
                sub.sync()
            at_two = copy.deepcopy(trainer)
            train_step(trainer, opt)
            pub.publish(trainer.state_dict())
            server.fail = True
            with pytest.raises(EngineError, match="reset_encoder_cache"):
                sub.sync()
            # Every worker wrote version 3 and is back on 2; vLLM's label, set to 3 while
            # the reset failed beside it, is 2 again, and the engine runs.
            assert sub.current_version == 2 and server.paused is None
            assert server.weight_versions == ["2"]
            for model in models:
                assert_holds(model, at_two)
            restored = local.restored()
            assert restored is not None and restored.version == 2
            server.fail = False
            assert sub.sync() == 3
            assert server.weight_versions == ["3"]
            for model in models:
                assert_holds(model, trainer)
        sub.close()
    finally:
        server.close()


def test_workers_speaking_another_protocol_are_refused_at_bind(tmp_path: Path, trainer: LlamaForCausalLM) -> None:
    from bulletin.engines import vllm
    from bulletin.errors import ConfigError

    class OldState(WorkerState):
        def handle(self, method: str, request: str) -> dict[str, Any]:
            answer = super().handle(method, request)
            answer.pop("protocol", None)  # an extension from before applies carried tokens
            return answer

    model = VllmLlama()
    worker = extended_worker(model)
    worker._bulletin_worker_state = OldState(model)
    server = VllmServer([worker])
    try:
        store = str(tmp_path / "store")
        sub = Subscriber(store, "r", target=VLLMTarget(LocalDirTarget(tmp_path / "local", run="r"), server.url))
        with Publisher(store, "r", keyframe_every=10) as pub:
            pub.publish(trainer.state_dict())
            with pytest.raises(ConfigError, match=f"protocol None; this sidecar speaks {vllm.PROTOCOL}"):
                sub.sync()
        assert "bulletin_load" not in server.rpc_methods and server.paused is None
        sub.close()
    finally:
        server.close()
