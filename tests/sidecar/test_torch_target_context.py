"""TorchTarget and the context codec: patches resolved against the live bits, where they
live, through the tensor's backend (the NumPy twin here; the CUDA kernels on a GPU,
tests/sidecar/test_torch_target_gpu.py). No keyframe route when one version behind,
bit for bit what an ArrayTarget reaches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from numpy.typing import NDArray

from bulletin import Publisher, Subscriber
from bulletin.engines.torch_module import TorchTarget, torch_dtype
from bulletin.errors import FormatError, IncompatibleTensors, InvalidInput, VerificationFailed, WrongBase
from bulletin.run import Run
from bulletin.sidecar.worker import GatedTarget
from bulletin.storage import open_store
from bulletin.storage.wrapper import CountingStore
from bulletin.sync import execute, plan
from bulletin.target import ArrayTarget, Held
from bulletin_kernels import numpy_twin
from patcher.context_decode import CodedChanges, decode_changes
from patcher.decode import decode, shard_views
from patcher.format import DEFAULT_LIMITS, TensorInfo
from patcher.patch import TensorSpec
from schemas.manifest import PatchRefV2
from tests.run.helpers import SHAPES as RUN_SHAPES
from tests.run.helpers import ToyTrainer, assert_bits_equal
from tests.targets.modules import tensor_bits

Bits = NDArray[np.unsignedinteger]

#: The run tests' tensors with four times the rows, so that entries span several classes.
SHAPES: dict[str, tuple[int, ...]] = {name: (4 * shape[0], *shape[1:]) for name, shape in RUN_SHAPES.items() if shape}


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Bits]]]:
    """A run of six context-coded versions (a keyframe, then patches) and the bits each serves."""
    store = tmp_path_factory.mktemp("bucket")
    trainer = ToyTrainer(seed=7, shapes=SHAPES)
    served = []
    with Publisher(store, "run", keyframe_every=100, codec="context") as pub:
        for i in range(6):
            if i:
                trainer.step()
            pub.publish(trainer.state)
            served.append(trainer.served())
    return store, served


def _torch_target() -> TorchTarget:
    return TorchTarget({name: torch.zeros(shape, dtype=torch_dtype("BF16")) for name, shape in SHAPES.items()})


def _at(store: Path, version: int) -> tuple[Run, TorchTarget]:
    """The run, and a fresh TorchTarget synced to ``version``."""
    target = _torch_target()
    assert Subscriber(store, "run", target=target).sync(version) == version
    return Run(open_store(store), "run"), target


def _transition(run: Run, version: int) -> tuple[list[CodedChanges], dict[str, TensorInfo], list[bytes]]:
    """Version ``version``'s shards, their entropy stage and the tensors they describe."""
    ref = run.read_manifest(version).manifest.patch
    assert isinstance(ref, PatchRefV2) and ref.context == "base"
    shards = run.download(ref.shards)
    views, headers, infos = shard_views(shards, DEFAULT_LIMITS)
    changes = [c for view, header in zip(views, headers, strict=True) for c in decode_changes(view, header)]
    return changes, infos, shards


@pytest.fixture
def selects(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The dtypes of every ``select_ranks`` call the NumPy twin (the CPU backend) serves."""
    calls: list[str] = []
    real = numpy_twin.select_ranks

    def spy(base: Any, dtype: str, *args: Any) -> Any:
        calls.append(dtype)
        return real(base, dtype, *args)

    monkeypatch.setattr(numpy_twin, "select_ranks", spy)
    return calls


def test_context_patches_reach_a_torch_target_without_keyframes(
    published: tuple[Path, list[dict[str, Bits]]], selects: list[str]
) -> None:
    store, served = published
    counting = CountingStore(open_store(store))
    target = _torch_target()
    assert target.resolves_context and target.context_bits() is None  # nothing copied to the host
    sub = Subscriber(counting, "run", target=target)
    reference = Subscriber(store, "run")  # an ArrayTarget, straight from the shards
    assert sub.sync(1) == 1 and reference.sync(1) == 1
    keyframe_bytes = Run(open_store(store), "run").read_manifest(1).manifest.stats.keyframe_bytes
    for version in (2, 3, 4):
        counting.reset()
        assert sub.sync(version) == version and reference.sync(version) == version
        report = sub.stats.last_report
        assert report is not None and report.keyframe is None and report.transitions == 1
        assert counting.reset().down < keyframe_bytes  # the patch alone was downloaded
        assert isinstance(reference.target, ArrayTarget)
        assert_bits_equal(tensor_bits(target.tensors), reference.target.arrays)
        assert_bits_equal(tensor_bits(target.tensors), served[version - 1])
    # Two behind: the second transition is resolved against the bits held read through
    # the first (not applied yet), then both are applied as one folded patch.
    assert sub.sync(6) == 6
    report = sub.stats.last_report
    assert report is not None and report.keyframe is None and report.transitions == 2
    assert_bits_equal(tensor_bits(target.tensors), served[5])
    assert selects and set(selects) == {"BF16"}  # the ranks went through the backend


def test_a_gated_torch_target_resolves_context_patches_too(published: tuple[Path, list[dict[str, Bits]]]) -> None:
    store, served = published
    inner = _torch_target()
    gated = GatedTarget(inner)
    assert gated.resolves_context
    sub = Subscriber(store, "run", target=gated)
    sub.sync(1)
    sub.sync(3)
    report = sub.stats.last_report
    assert report is not None and report.keyframe is None and report.transitions == 2
    assert_bits_equal(tensor_bits(inner.tensors), served[2])


def test_resolved_patches_are_the_codecs_own(published: tuple[Path, list[dict[str, Bits]]]) -> None:
    store, served = published
    run, target = _at(store, 2)
    held = Held.at(run.read_manifest(2))
    changes, infos, shards = _transition(run, 3)
    got = target.resolve_context(changes, infos, held.fingerprints)
    want = decode(shards, base=served[1], base_fingerprints=held.fingerprints)
    assert got.tensors.keys() == want.tensors.keys()
    for name, td in want.tensors.items():
        mine = got.tensors[name]
        assert np.array_equal(mine.indices, td.indices), name
        assert np.array_equal(mine.delta, td.delta), name
        assert (mine.base_fingerprint, mine.target_fingerprint) == (td.base_fingerprint, td.target_fingerprint)
    # Through an earlier transition not yet applied (what a node two behind does).
    first, infos2, _ = _transition(run, 2)
    _, at1 = _at(store, 1)
    fps1 = Held.at(run.read_manifest(1)).fingerprints
    through = at1.resolve_context(changes, infos, fps1, pending=at1.resolve_context(first, infos2, fps1))
    for name, td in want.tensors.items():
        assert np.array_equal(through.tensors[name].indices, td.indices), name


def test_a_wrong_base_is_refused_before_anything_is_written(published: tuple[Path, list[dict[str, Bits]]]) -> None:
    run, target = _at(published[0], 2)
    before = tensor_bits(target.tensors)
    held = Held.at(run.read_manifest(2))
    changes, infos, _ = _transition(run, 3)
    name = next(c.entry.tensor for c in changes if c.entry.count and c.entry.classes > 1)
    # The record of the bits held is not the transition's base.
    with pytest.raises(WrongBase, match="coded against base"):
        target.resolve_context(changes, infos, dict(held.fingerprints, **{name: held.fingerprints[name] ^ 1}))
    with pytest.raises(WrongBase):
        target.resolve_context(changes, infos, {})
    # Earlier changes that do not lead to this transition's base (they end past it).
    step = target.resolve_context(changes, infos, held.fingerprints)
    with pytest.raises(WrongBase):
        target.resolve_context(changes, infos, held.fingerprints, pending=step)
    # Another layout, or an entry of another tensor.
    other = dict(infos, extra=TensorInfo(TensorSpec("extra", "BF16", (4,)), 0, 0, 0))
    with pytest.raises(IncompatibleTensors, match="tensor sets differ"):
        target.resolve_context(changes, other, held.fingerprints)
    assert_bits_equal(tensor_bits(target.tensors), before)
    with pytest.raises(InvalidInput, match="resolves_context"):
        ArrayTarget().resolve_context(changes, infos, held.fingerprints)


def test_live_bits_that_are_not_the_record_are_refused_unwritten(
    published: tuple[Path, list[dict[str, Bits]]],
) -> None:
    run, target = _at(published[0], 2)
    # Something changed the live bits behind the record's back: every exponent moves, so
    # the classes the ranks count in are not the ones the patch was coded against.
    name = "model.embed_tokens.weight"
    bits = target.tensors[name].view(torch.uint16)
    bits.copy_(bits ^ 0x0880)
    tampered = tensor_bits(target.tensors)
    held = Held.at(run.read_manifest(2))
    with pytest.raises((VerificationFailed, FormatError)):
        execute(run, plan(run, run.read_manifest(3), held), target, held)
    assert_bits_equal(tensor_bits(target.tensors), tampered)  # nothing was written
