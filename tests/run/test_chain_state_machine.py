"""A hypothesis state machine: the manifest chain and the sync client against a model.

The model is a plain dict of version -> the BF16 bits the trainer published. Rules
publish (small changes, a layout change now and then), restart the publisher, sync
nodes to random versions (forwards and backwards), restart a node from its folder,
and collect garbage. After every step the bucket, the head and every node must agree
with the model, bit for bit.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bulletin import Publisher, Subscriber
from bulletin.errors import VersionNotFound
from bulletin.maintenance import collect_garbage
from bulletin.run import Run
from bulletin.storage import open_store
from bulletin.target import ArrayTarget, LocalDirTarget
from patcher.cast import cast_bits


class ChainMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.url = f"memory://{uuid.uuid4().hex}"
        self.tmp = Path(tempfile.mkdtemp(prefix="bulletin-sm-"))
        self.rng = np.random.default_rng(0)
        self.state = {"w": np.zeros((40, 8), np.float32), "b": np.zeros(8, np.float32)}
        self.keyframe_every = 3
        self.publisher = Publisher(self.url, "run", keyframe_every=self.keyframe_every)
        self.model: dict[int, dict[str, np.ndarray]] = {}
        self.floor = 1
        self.nodes: dict[str, Subscriber] = {}

    def teardown(self) -> None:
        self.publisher.close()
        for node in self.nodes.values():
            node.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def served(self) -> dict[str, np.ndarray]:
        return {n: cast_bits(np.ascontiguousarray(w).view(np.uint32), "F32", "BF16") for n, w in self.state.items()}

    @rule(fraction=st.sampled_from([0.0, 0.01, 0.2, 1.0]), scale=st.sampled_from([1e-3, 1.0]))
    def publish(self, fraction: float, scale: float) -> None:
        for w in self.state.values():
            mask = self.rng.random(w.shape) < fraction
            w[mask] += (scale * self.rng.standard_normal(int(mask.sum()))).astype(np.float32)
        version = self.publisher.publish(self.state)
        assert version == len(self.model) + 1
        self.model[version] = self.served()

    @precondition(lambda self: len(self.model) > 0)
    @rule()
    def change_layout(self) -> None:
        rows = self.state["extra"].shape[0] % 4 + 1 if "extra" in self.state else 1
        self.state["extra"] = self.rng.standard_normal((rows, 3)).astype(np.float32)
        version = self.publisher.publish(self.state)
        self.model[version] = self.served()
        assert self.publisher.results[-1].keyframe

    @rule()
    def restart_publisher(self) -> None:
        self.publisher.close()
        self.publisher = Publisher(self.url, "run", keyframe_every=self.keyframe_every)

    @precondition(lambda self: len(self.model) > 0)
    @rule(name=st.sampled_from(["a", "b"]), data=st.data())
    def sync_node(self, name: str, data: st.DataObject) -> None:
        node = self.nodes.get(name)
        if node is None:
            node = self.nodes[name] = Subscriber(self.url, "run", self.tmp / name)
        version = data.draw(st.integers(min_value=self.floor, max_value=len(self.model)) | st.none())
        assert node.sync(version) == (version or len(self.model))

    @precondition(lambda self: len(self.model) > 0)
    @rule(name=st.sampled_from(["a", "b"]))
    def restart_node(self, name: str) -> None:
        if name in self.nodes:
            self.nodes.pop(name).close()
            self.nodes[name] = Subscriber(self.url, "run", self.tmp / name)

    @precondition(lambda self: len(self.model) > 2)
    @rule(keep=st.integers(min_value=1, max_value=4))
    def gc(self, keep: int) -> None:
        report = collect_garbage(Run(open_store(self.url), "run"), keep=keep)
        assert report.floor <= max(self.floor, len(self.model) - keep + 1)
        self.floor = max(self.floor, report.floor)

    @invariant()
    def bucket_matches_model(self) -> None:
        run = Run(open_store(self.url), "run")
        expected = list(range(self.floor, len(self.model) + 1)) if self.model else []
        assert run.versions() == expected
        head = run.read_head()
        assert (head.head.version if head else 0) == len(self.model)

    @invariant()
    def nodes_hold_exact_versions(self) -> None:
        for node in self.nodes.values():
            version = node.current_version
            if version is None:
                continue
            target = node.target
            assert isinstance(target, LocalDirTarget)
            restored = target.restored()
            assert target.full_fingerprints() == (restored.fingerprints if restored else {})
            if version in self.model:
                held = ArrayTarget()
                try:
                    Subscriber(self.url, "run", target=held).sync(version)
                except VersionNotFound:
                    continue  # collected: nothing left to compare with
                for n, bits in self.model[version].items():
                    assert np.array_equal(held.arrays[n], bits)
                model_fps = {n: int(v) for n, v in held.full_fingerprints().items()}
                assert target.full_fingerprints() == model_fps


ChainMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestChain = ChainMachine.TestCase
