"""``bulletin serve --layout log``: the node's folder as a base plus a log of patches
(docs/FORMAT.md 9.1) behind engines that hold the live bits themselves, and refused, with
the reason, where the engine reloads versions from the folder.

Real pieces throughout: the torch engine built by ``build_sidecar`` from an HF config,
and loopback servers speaking vLLM's and SGLang's HTTP (tests/sidecar/engine_servers.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from bulletin.cli import main
from bulletin.engines.sglang import SGLangInPlaceTarget, open_sglang
from bulletin.engines.sglang_loader import LOADER
from bulletin.engines.torch_module import TorchTarget
from bulletin.errors import ConfigError
from bulletin.publisher import Publisher
from bulletin.replica_log import LogDirTarget
from bulletin.run import Run
from bulletin.sidecar import SidecarSettings, SidecarStack, TorchEngineSettings, build_sidecar
from bulletin.sidecar.folder_backed import FolderBackedTarget
from bulletin.sidecar.worker import SubscriberLike
from bulletin.storage import open_store
from bulletin.subscriber import Subscriber
from bulletin.target import read_local_state
from schemas.local_state import LocalStateV3
from scripts._common import llama, llama_config
from tests.cli.test_serve import root_logging  # noqa: F401 - the fixture
from tests.sidecar.engine_servers import SglangServer, VllmServer, extended_worker
from tests.sidecar.test_sglang_adapter import CONFIG as SGLANG_CONFIG
from tests.sidecar.test_sglang_adapter import _same_bits, _step
from tests.sidecar.test_vllm_adapter import CONFIG as VLLM_CONFIG
from tests.sidecar.test_vllm_adapter import VllmLlama, assert_holds

CONFIG = llama_config(vocab=64, hidden=16, intermediate=32, layers=1, heads=2, kv_heads=1, max_positions=32, tied=False)


def _nudge(trainer: torch.nn.Module, step: int) -> None:
    """A training step that changes about 0.4% of the served elements (under the default
    compaction share of 2% for a few versions)."""
    with torch.no_grad():
        for p in trainer.parameters():
            p.view(-1)[step % 250 :: 250] += 0.25


def _follow(
    sub: SubscriberLike, store: str, trainer: torch.nn.Module, versions: int, check: Callable[[], None] = lambda: None
) -> None:
    """Publish ``versions`` versions of ``trainer`` (a nudge between two) and sync each, then ``check()``."""
    with Publisher(store, "r", keyframe_every=10) as pub:
        for step in range(versions):
            if step:
                _nudge(trainer, step)
            version = pub.publish(trainer.state_dict())
            assert sub.sync() == version
            check()


def _fingerprints(store: str, version: int) -> dict[str, int]:
    return dict(Run(open_store(store), "r").read_manifest(version).manifest.fingerprints)


def _base(tmp_path: Path, **changes: object) -> dict[str, object]:
    return {"store": str(tmp_path / "store"), "run": "r", "local_dir": tmp_path / "node", "layout": "log"} | changes


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"engine": "local", "upstream": "http://127.0.0.1:9"}, "cannot serve --engine local, which reads DIR/current"),
        (
            {"engine": "sglang", "upstream": "http://127.0.0.1:9", "sglang_mode": "disk"},
            "cannot serve --sglang-mode disk, which reloads the folder",
        ),
        ({"engine": "torch", "torch": TorchEngineSettings(model_config=Path("c")), "local_dir": None}, "give one"),
        ({"engine": "vllm", "upstream": "http://127.0.0.1:9", "layout": "sparse"}, "unknown layout"),
    ],
)
def test_settings_refuse_the_log_layout_where_the_engine_reads_the_folder(
    tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        SidecarSettings(**_base(tmp_path, **changes))  # type: ignore[arg-type]
    if "reads" in message or "reloads" in message:
        assert "loadable DIR/current only after a compaction" in str(caught.value)  # says why
    assert not (tmp_path / "node").exists()  # refused before anything was opened


@pytest.mark.usefixtures("root_logging")
def test_serve_refuses_layout_log_for_the_local_engine_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            *("serve", "--store", str(tmp_path / "store"), "--run", "r", "--upstream", "http://127.0.0.1:9"),
            *("--local-dir", str(tmp_path / "node"), "--layout", "log"),
        ]
    )
    _, err = capsys.readouterr()
    assert code == 2 and err.startswith("error: config_error: --layout log cannot serve --engine local"), err
    assert err.count("\n") == 1


# -- torch: the folder is the durable copy of the live module ----------------------------------


def _torch_stack(tmp_path: Path, layout: str = "log") -> SidecarStack:
    CONFIG.save_pretrained(tmp_path / "config")
    return build_sidecar(
        SidecarSettings(
            store=str(tmp_path / "store"),
            run="r",
            engine="torch",
            local_dir=tmp_path / "node",
            layout=layout,  # type: ignore[arg-type]
            torch=TorchEngineSettings(model_config=tmp_path / "config"),
            port=0,
        )
    )


def _close(stack: SidecarStack) -> None:
    stack.sidecar.subscriber.close()
    if stack.engine.listener is not None:
        stack.engine.listener.close()


def _live(stack: SidecarStack) -> TorchTarget:
    target = stack.engine.target
    assert isinstance(target, FolderBackedTarget) and isinstance(target.engine, TorchTarget)
    return target.engine


def test_a_restarted_torch_sidecar_restores_the_exact_version_from_its_log_folder(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    trainer = llama(CONFIG, 0)
    stack = _torch_stack(tmp_path)
    try:
        _follow(stack.sidecar.subscriber, store, trainer, 4)
        fps = _fingerprints(store, 4)
        assert _live(stack).full_fingerprints() == fps
        state = read_local_state(tmp_path / "node")
        assert isinstance(state, LocalStateV3) and state.base_version == 1
        assert [e.version for e in state.log] == [2, 3, 4]  # no loadable copy per version: a log
        metrics = stack.sidecar.metrics
        per_version = metrics.replica_written.value("version")
        assert (
            0 < per_version < 3 * sum(e.size for e in state.log) + 3 * (tmp_path / "node" / "state.json").stat().st_size
        )
        assert metrics.replica_written.value("keyframe") > 0
    finally:
        _close(stack)
    # A new process: a new model with random weights, restored from the folder at start,
    # before any poll (nothing downloaded), bit for bit.
    again = _torch_stack(tmp_path)
    try:
        assert again.sidecar.subscriber.current_version == 4
        assert again.sidecar.metrics.bytes_downloaded.value() == 0
        assert _live(again).full_fingerprints() == fps
        served = {n: t for n, t in _live(again).tensors.items()}
        for name, tensor in trainer.state_dict().items():
            assert torch.equal(served[name].view(torch.int16), tensor.to(torch.bfloat16).view(torch.int16)), name
        _nudge(trainer, 5)
        with Publisher(store, "r", keyframe_every=10) as pub:
            assert pub.publish(trainer.state_dict()) == 5
        assert again.sidecar.subscriber.sync() == 5
        assert _live(again).full_fingerprints() == _fingerprints(store, 5)
    finally:
        _close(again)


def test_a_damaged_log_folder_restores_nothing_and_a_keyframe_route_rebuilds_both(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    trainer = llama(CONFIG, 0)
    stack = _torch_stack(tmp_path)
    try:
        _follow(stack.sidecar.subscriber, store, trainer, 3)
    finally:
        _close(stack)
    state = read_local_state(tmp_path / "node")
    assert isinstance(state, LocalStateV3) and state.log
    with open(tmp_path / "node" / state.log[-1].file, "r+b") as fh:  # one byte of the last patch flipped
        fh.seek(20)
        byte = fh.read(1)
        fh.seek(20)
        fh.write(bytes([byte[0] ^ 1]))
    again = _torch_stack(tmp_path)
    try:
        assert again.sidecar.subscriber.current_version is None  # never claimed
        assert again.sidecar.subscriber.sync() == 3
        assert _live(again).full_fingerprints() == _fingerprints(store, 3)
    finally:
        _close(again)


# -- vLLM and SGLang in place ------------------------------------------------------------------


def test_vllm_in_place_follows_the_run_in_a_log_folder_and_a_restarted_engine_is_loaded_from_it(
    tmp_path: Path,
) -> None:
    store = str(tmp_path / "store")
    trainer = llama(VLLM_CONFIG, 0)
    models = [VllmLlama(), VllmLlama()]
    server = VllmServer([extended_worker(m) for m in models])
    settings = SidecarSettings(
        store=store, run="r", engine="vllm", upstream=server.url, local_dir=tmp_path / "node", layout="log", port=0
    )
    try:
        stack = build_sidecar(settings)
        try:

            def each_engine_holds_it() -> None:
                for model in models:
                    assert_holds(model, trainer)

            _follow(stack.sidecar.subscriber, store, trainer, 3, each_engine_holds_it)
            state = read_local_state(tmp_path / "node")
            assert isinstance(state, LocalStateV3) and [e.version for e in state.log] == [2, 3]
        finally:
            _close(stack)
    finally:
        server.close()
    # The engine restarted too (from another checkpoint: a log folder has no current/ to
    # start it from): the sidecar loads the folder's version into it, without a download.
    fresh = [VllmLlama(), VllmLlama()]
    server = VllmServer([extended_worker(m) for m in fresh])
    try:
        again = build_sidecar(dataclass_replace(settings, upstream=server.url))
        try:
            assert again.sidecar.subscriber.current_version == 3
            assert again.sidecar.metrics.bytes_downloaded.value() == 0
            for model in fresh:
                assert_holds(model, trainer)
            state = read_local_state(tmp_path / "node")  # loading it wrote a new base
            assert isinstance(state, LocalStateV3) and (state.base_version, state.log) == (3, [])
            assert server.weight_versions == ["3"]
        finally:
            _close(again)
    finally:
        server.close()


def dataclass_replace(settings: SidecarSettings, **changes: object) -> SidecarSettings:
    import dataclasses

    return dataclasses.replace(settings, **changes)  # type: ignore[arg-type]


def test_sglang_in_place_follows_the_run_in_a_log_folder(tmp_path: Path) -> None:
    engine = llama(SGLANG_CONFIG, 1, dtype=torch.bfloat16)
    server = SglangServer(engine, custom_weight_loader=[LOADER])
    try:
        target = open_sglang(LogDirTarget(tmp_path / "node", run="r", compact_share=1.0), server.url)
        assert isinstance(target, SGLangInPlaceTarget)
        trainer = llama(SGLANG_CONFIG, 0)
        with (
            Subscriber(str(tmp_path / "store"), "r", target=target) as sub,
            Publisher(str(tmp_path / "store"), "r", keyframe_every=10) as pub,
        ):
            for step in range(4):
                if step:
                    _step(trainer)
                version = pub.publish(trainer.state_dict())
                assert sub.sync() == version
                assert _same_bits(engine, trainer) and server.weight_version == str(version)
        state = read_local_state(tmp_path / "node")
        assert isinstance(state, LocalStateV3) and [e.version for e in state.log] == [2, 3, 4]
        assert server.count("/update_weights_from_disk") == 0
    finally:
        server.close()


def test_an_sglang_server_served_from_disk_refuses_a_log_folder_at_start(tmp_path: Path) -> None:
    server = SglangServer(llama(SGLANG_CONFIG, 1, dtype=torch.bfloat16))  # no Bulletin loader: auto is disk
    try:
        settings = SidecarSettings(
            store=str(tmp_path / "store"),
            run="r",
            engine="sglang",
            upstream=server.url,
            local_dir=tmp_path / "node",
            layout="log",
            port=0,
        )
        with pytest.raises(ConfigError, match="cannot serve this SGLang server from disk"):
            build_sidecar(settings)
        LogDirTarget(tmp_path / "node", run="r").close()  # the folder's lock was given back
    finally:
        server.close()
