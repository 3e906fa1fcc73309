"""The sharded publisher's pieces in one process: block arithmetic, the layout plan,
renumbered shards, and the one-rank case (no ``torch.distributed`` group) against the
plain ``Publisher`` and through a commit whose outcome was lost."""

from __future__ import annotations

import itertools
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bulletin.distributed.publisher
from bulletin import Publisher, Subscriber
from bulletin.base import PublishedBase
from bulletin.blocks import (
    Block,
    block_diff,
    block_runs,
    block_span,
    contiguous_start,
    global_indices,
    local_indices,
    part_fingerprint,
)
from bulletin.distributed import LocalShard, ShardedPublisher
from bulletin.distributed.parts import RankLayout, plan_layout, run_parts, tally, totals
from bulletin.distributed.shards import renumber
from bulletin.errors import IncompatibleLayout, InvalidInput, StorageUnavailable
from bulletin.run import Run
from bulletin.storage import open_store
from patcher.cast import cast_bits
from patcher.context_diff import SMALLEST, RankedDelta, diff_ranked
from patcher.decode import decode
from patcher.diff import diff
from patcher.encode import encode, encode_parts
from patcher.fingerprint import fingerprint
from patcher.fingerprint_update import fingerprint_change
from patcher.format import TensorInfo, compute_patch_id
from patcher.patch import Patch, TensorDelta, TensorSpec
from schemas.manifest import manifest_files
from tests.run.helpers import ToyTrainer, assert_bits_equal
from tests.run.test_ambiguous_commit import LostCommitResponse
from tests.run.test_device_recovery import (  # noqa: F401 - emulated_device: a fixture
    OnDevice,
    _on_device,
    emulated_device,
    found_on_device,
)
from tests.run.test_keyframe_upload import Watching

pytest.importorskip("torch.distributed")


@pytest.mark.parametrize("shape", [(7,), (6, 5), (4, 3, 5), (2, 3, 4, 5)])
def test_blocks_of_every_dimension_add_up_to_the_tensor(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**16, size=shape, dtype=np.uint16)
    for dim in range(len(shape)):
        cuts = [0, shape[dim] // 3, shape[dim]]
        total = 0
        for lo, hi in itertools.pairwise(cuts):
            offsets = tuple(lo if d == dim else 0 for d in range(len(shape)))
            sizes = tuple(hi - lo if d == dim else n for d, n in enumerate(shape))
            block = Block(shape, offsets, sizes)
            part = np.ascontiguousarray(x[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))])
            total += part_fingerprint(block, part)
            g = global_indices(block, np.arange(part.size, dtype=np.int64))
            assert (x.reshape(-1)[g] == part.reshape(-1)).all()
            inside, local = local_indices(block, np.arange(x.size, dtype=np.int64))
            assert int(inside.sum()) == part.size
            assert (part.reshape(-1)[local] == x.reshape(-1)[inside]).all()
        assert total % 2**64 == fingerprint(x), dim


@pytest.mark.parametrize("shape", [(7,), (6, 5), (4, 3, 5), (2, 3, 4, 5)])
def test_a_blocks_runs_are_its_elements_in_its_own_order(shape: tuple[int, ...]) -> None:
    # What the keyframe writer pwrites: run k of the block's bits lands at starts[k].
    rng = np.random.default_rng(1)
    flat = np.arange(prod(shape), dtype=np.int64).reshape(shape)
    for _ in range(20):
        offsets = tuple(int(rng.integers(0, n)) for n in shape)
        sizes = tuple(int(rng.integers(0, n - o + 1)) for n, o in zip(shape, offsets, strict=True))
        block = Block(shape, offsets, sizes)
        want = flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].reshape(-1)
        starts, run = block_runs(block)
        got = (starts[:, None] + np.arange(run, dtype=np.int64)).reshape(-1)
        assert got.tolist() == want.tolist(), block


@pytest.mark.parametrize("shape", [(7,), (6, 5), (4, 3, 5), (1, 3, 4, 5), (2, 1, 4, 5)])
def test_global_indices_of_any_block_are_its_elements(shape: tuple[int, ...]) -> None:
    # One addition for a block that is one run of the tensor, coordinates for the rest:
    # both give each element's flat index in the whole tensor, and the run's start is
    # block_runs' single run.
    rng = np.random.default_rng(2)
    flat = np.arange(prod(shape), dtype=np.int64).reshape(shape)
    runs = 0
    for _ in range(60):
        offsets = tuple(int(rng.integers(0, n)) for n in shape)
        sizes = tuple(int(rng.integers(0, n - o + 1)) for n, o in zip(shape, offsets, strict=True))
        if rng.random() < 0.3:  # rows of the first dimension only: FSDP2's Shard(0)
            sizes = (sizes[0], *shape[1:])
            offsets = (offsets[0], *(0,) * (len(shape) - 1))
        block = Block(shape, offsets, sizes)
        want = flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].reshape(-1)
        local = np.arange(block.numel, dtype=np.int64)
        assert global_indices(block, local).tolist() == want.tolist(), block
        # The span a patch reader tests entries against: from its first element to its last.
        assert block_span(block) == ((int(want[0]), int(want[-1]) + 1) if block.numel else (0, 0)), block
        start = contiguous_start(block)
        starts, run = block_runs(block)
        if start is not None and block.numel:
            runs += 1
            assert starts.tolist() == [start] and run == block.numel, block
        elif block.numel:
            assert len(starts) > 1, block
    assert runs >= 10


@pytest.mark.parametrize("shape", [(300,), (40, 33), (6, 7, 9), (600, 512)])
def test_a_blocks_diff_is_its_part_of_the_tensors_diff(shape: tuple[int, ...]) -> None:
    # The one diff of both publishers: each block's changes, cast from F32 inside the
    # diff or diffed as served bits, are the tensor's own diff at its global indices,
    # and the blocks' fingerprint parts add up to the tensor's change.
    rng = np.random.default_rng(3)
    master = rng.standard_normal(shape).astype(np.float32)
    old = cast_bits(master.view(np.uint32), "F32", "BF16")
    moved = rng.random(shape) < 0.05
    master[moved] *= np.float32(1.03)
    new = cast_bits(master.view(np.uint32), "F32", "BF16")
    spec = TensorSpec("w", "BF16", shape)
    want = diff({"w": spec}, {"w": old}, {"w": new}).tensors["w"]
    assert want.changed > 0
    for dim in range(len(shape)):
        cuts = [0, shape[dim] // 3, shape[dim]]
        indices, deltas, part = [], [], 0
        for lo, hi in itertools.pairwise(cuts):
            offsets = tuple(lo if d == dim else 0 for d in range(len(shape)))
            sizes = tuple(hi - lo if d == dim else n for d, n in enumerate(shape))
            block = Block(shape, offsets, sizes)
            cut = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
            base = np.ascontiguousarray(old[cut])
            fp = part_fingerprint(block, base)
            for src, source in ((master[cut].view(np.uint32), "F32"), (new[cut], "BF16")):
                got = block_diff(spec, block, base, np.ascontiguousarray(src), source, fp)
                assert got.delta.base_fingerprint == fp
                assert got.delta.target_fingerprint == part_fingerprint(block, np.ascontiguousarray(new[cut]))
                assert (got.now == new[cut].reshape(-1)[got.local]).all()
                assert (global_indices(block, got.local) == got.delta.indices).all()
            indices.append(got.delta.indices)
            deltas.append(got.delta.delta)
            part += got.part
        order = np.argsort(np.concatenate(indices))
        assert (np.concatenate(indices)[order] == want.indices).all(), dim
        assert (np.concatenate(deltas)[order] == want.delta).all(), dim
        assert part % 2**64 == (want.target_fingerprint - want.base_fingerprint) % 2**64
    whole = Block.whole(shape)
    fp = fingerprint(old)
    ranked = block_diff(spec, whole, old, master.view(np.uint32), "F32", fp, ranked=True).delta
    reference = diff_ranked({"w": spec}, {"w": old}, {"w": new}, base_fingerprints={"w": fp}).tensors["w"]
    assert type(ranked) is type(reference)
    assert (ranked.indices == reference.indices).all() and ranked.target_fingerprint == reference.target_fingerprint
    assert isinstance(reference, RankedDelta) == (old.size >= SMALLEST)
    if isinstance(reference, RankedDelta):
        assert isinstance(ranked, RankedDelta) and (ranked.ranks == reference.ranks).all()


def _rank(rank: int, blocks: dict[str, Block], dtype: str = "BF16") -> RankLayout:
    return RankLayout(rank, {n: TensorSpec(n, dtype, b.shape) for n, b in blocks.items()}, blocks, {})


def test_the_plan_owns_each_block_once_and_spreads_the_writers() -> None:
    rows = [_rank(r, {"a": Block((8, 4), (4 * r, 0), (4, 4)), "r": Block.whole((3,))}) for r in range(2)]
    layout = plan_layout(rows)
    assert [owner for owner, _ in layout.owners["a"]] == [0, 1]
    assert len(layout.owners["r"]) == 1  # a replica is owned (and published) once
    assert sorted(layout.writers.values()) == [0, 1]  # two tensors, two writers


@pytest.mark.parametrize(
    ("blocks", "message"),
    [
        ([Block((8,), (0,), (5,)), Block((8,), (4,), (4,))], "overlap"),
        ([Block((8,), (0,), (3,)), Block((8,), (4,), (4,))], "7 of 8"),
    ],
)
def test_blocks_that_overlap_or_leave_a_gap_are_refused(blocks: list[Block], message: str) -> None:
    with pytest.raises(IncompatibleLayout, match=message):
        plan_layout([_rank(r, {"a": b}) for r, b in enumerate(blocks)])


def test_ranks_that_disagree_on_a_tensor_are_refused() -> None:
    with pytest.raises(IncompatibleLayout, match="F16"):
        plan_layout([_rank(0, {"a": Block.whole((4,))}), _rank(1, {"a": Block.whole((4,))}, "F16")])
    with pytest.raises(IncompatibleLayout, match="leaves dimension"):
        Block((4,), (2,), (3,))


def test_writers_shards_renumbered_are_one_patch() -> None:
    rng = np.random.default_rng(1)
    specs = {n: TensorSpec(n, "BF16", (64, 32)) for n in ("a", "b", "c")}
    old = {n: rng.integers(0, 2**16, size=(64, 32), dtype=np.uint16) for n in specs}
    new = {n: v.copy() for n, v in old.items()}
    for v in new.values():
        v.reshape(-1)[rng.choice(v.size, 200, replace=False)] += 1
    whole = diff(specs, old, new)
    parts = [Patch({"a": whole.tensors["a"]}), Patch({"b": whole.tensors["b"], "c": whole.tensors["c"]})]
    encoded = [encode(p, max_shard_bytes=600) for p in parts]
    infos = {
        n: TensorInfo(td.spec, td.base_fingerprint, td.target_fingerprint, td.changed)
        for n, td in whole.tensors.items()
    }
    patch_id = compute_patch_id(infos)
    total = sum(map(len, encoded))
    shards = [renumber(s, patch_id, i, total) for i, s in enumerate(s for part in encoded for s in part)]
    assert all(len(s) <= 600 for s in shards)
    got = decode(shards[::-1], specs=specs)
    for name, td in whole.tensors.items():
        assert (got.tensors[name].indices == td.indices).all() and (got.tensors[name].delta == td.delta).all()
    with pytest.raises(Exception, match="shard"):  # a writer's shards alone are not the patch
        decode(shards[:1], specs=specs)


def test_one_rank_publishes_what_the_publisher_publishes(tmp_path: Path) -> None:
    trainer = ToyTrainer(seed=3)
    sharded = ShardedPublisher(tmp_path / "a", "r", keyframe_every=3, keyframe_file_bytes=1 << 12)
    plain = Publisher(tmp_path / "b", "r", keyframe_every=3, codec="zstd", keyframe_file_bytes=1 << 12)
    names = sorted(trainer.state)
    for step in range(5):
        trainer.step(lr=3e-3)
        state = dict(trainer.state)
        # Half the tensors as blocks covering the whole tensor, through LocalShard.
        state.update(
            {n: LocalShard(trainer.state[n], trainer.state[n].shape, (0,) * trainer.state[n].ndim) for n in names[::2]}
        )
        if step % 2:
            sharded.publish_async(state).result()
        else:
            sharded.publish(state)
        plain.publish(trainer.state)
    sharded.close()
    plain.close()
    for version in range(1, 6):
        ours, theirs = (Run(open_store(tmp_path / s), "r").read_manifest(version).manifest for s in "ab")
        assert ours.tensors == theirs.tensors and (ours.keyframe is None) == (theirs.keyframe is None)
        # One step, one rank: the same objects, byte for byte (a keyframe's prefix names its writer).
        assert ours.patch == theirs.patch and (ours.patch is None) == (version == 1)
        files = [[(f.size, f.sha256) for f in m.keyframe.files] if m.keyframe else None for m in (ours, theirs)]
        assert files[0] == files[1]
    sub = Subscriber(tmp_path / "a", "r")
    assert sub.sync() == 5
    assert_bits_equal(sub.target.arrays, trainer.served())  # type: ignore[attr-defined]
    sub.close()


def test_model_files_go_with_a_version_as_the_publishers_do(tmp_path: Path) -> None:
    # Given with the first version, kept (sticky), given again with one changed: the same
    # manifests' files, uploads and notes as the Publisher's (config.json names BF16).
    trainer = ToyTrainer(seed=5)
    config = b'{"model_type": "llama", "torch_dtype": "float32"}'
    given: list[dict[str, bytes] | None] = [
        {"config.json": config, "tokenizer.json": b"{}"},
        None,
        {"config.json": config, "tokenizer.json": b'{"v": 2}'},
    ]
    results = []
    with (
        ShardedPublisher(tmp_path / "a", "r", keyframe_every=2) as sharded,
        Publisher(tmp_path / "b", "r", keyframe_every=2, codec="zstd") as plain,
    ):
        for files in given:
            trainer.step(lr=3e-3)
            sharded.publish(trainer.state, files=files)
            plain.publish(trainer.state, files=files)
        results = [sharded.results, plain.results]
    for version in range(1, 4):
        ours, theirs = (Run(open_store(tmp_path / s), "r").read_manifest(version).manifest for s in "ab")
        assert [(f.path, f.sha256, f.size) for f in manifest_files(ours)] == [
            (f.path, f.sha256, f.size) for f in manifest_files(theirs)
        ]
    assert [(r.files, r.files_uploaded, r.notes) for r in results[0]] == [
        (r.files, r.files_uploaded, r.notes) for r in results[1]
    ]
    assert results[0][0].notes and results[0][1].files_uploaded == 0 and results[0][2].files_uploaded == 8


def test_bad_input_fails_the_step_and_the_next_one_follows(tmp_path: Path) -> None:
    trainer = ToyTrainer(seed=4)
    with ShardedPublisher(tmp_path, "r") as pub:
        assert pub.publish(trainer.state) == 1
        with pytest.raises(InvalidInput):
            pub.publish({"x": "not a tensor"})
        trainer.step()
        assert pub.publish(trainer.state) == 2


def test_a_commit_whose_response_was_lost_is_settled_by_the_next_publish(tmp_path: Path) -> None:
    store = LostCommitResponse(open_store(tmp_path))
    trainer = ToyTrainer(seed=5)
    pub = ShardedPublisher(store, "r")
    pub.publish(trainer.state)
    trainer.step()
    store.arm(reads=1)  # the manifest lands; its response and the read-back are lost
    with pytest.raises(StorageUnavailable):
        pub.publish(trainer.state)
    v2 = trainer.served()
    trainer.step()
    assert pub.publish(trainer.state) == 3  # version 2 was settled as committed first
    pub.close()
    sub = Subscriber(tmp_path, "r")
    assert sub.sync(2) == 2
    assert_bits_equal(sub.target.arrays, v2)  # type: ignore[attr-defined]
    assert sub.sync() == 3
    assert_bits_equal(sub.target.arrays, trainer.served())  # type: ignore[attr-defined]
    sub.close()


def test_a_keyframe_that_failed_half_way_is_published_again_with_other_bits(tmp_path: Path) -> None:
    """Each attempt writes its keyframe under a folder of its own: the retry, with other
    bits, never meets the files the failed attempt left (a Conflict before)."""
    store = Watching(open_store(tmp_path), fail="model-00002")
    trainer = ToyTrainer(seed=6)
    with ShardedPublisher(store, "r", keyframe_file_bytes=1 << 12) as pub:
        with pytest.raises(StorageUnavailable, match="injected"):
            pub.publish(trainer.state)
        assert any(name.startswith("model-00001") for name, _ in store.seen), "nothing was left half-way"
        store.fail = None
        trainer.step()
        assert pub.publish(trainer.state) == 1
    with Subscriber(tmp_path, "r") as sub:
        assert sub.sync() == 1
        assert_bits_equal(sub.target.arrays, trainer.served())  # type: ignore[attr-defined]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 37), st.sampled_from(["<i8", "<u2", "<u1", "<u4"])), max_size=6))
def test_a_framed_message_arrives_whole_with_its_arrays_aligned(arrays: list[tuple[int, str]]) -> None:
    """Comm.exchange's framing: arrays of any length and width out of band, each padded so
    that every array is a view of the receive buffer at an aligned offset."""
    from bulletin.distributed.comm import _frame, _unframe

    item = [(f"t{i}", np.arange(n, dtype=dt), i) for i, (n, dt) in enumerate(arrays)]
    data = np.frombuffer(b"".join(bytes(piece) for piece in _frame(item)), dtype=np.uint8).copy()
    got = _unframe(data)
    assert [(name, i) for name, _, i in got] == [(name, i) for name, _, i in item]
    for (_, ours, _), (_, sent, _) in zip(got, item, strict=True):
        assert ours.dtype == sent.dtype and ours.tobytes() == sent.tobytes()
        assert ours.flags.aligned


@pytest.fixture
def sharded_device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulated GPU (tests/run/test_device_recovery.py) for the sharded publisher too."""
    request.getfixturevalue("emulated_device")
    monkeypatch.setattr(bulletin.distributed.publisher, "on_gpu", lambda value: isinstance(value, OnDevice))


def test_gpu_blocks_are_diffed_on_their_device(
    tmp_path: Path, sharded_device: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Synchronous steps diff a GPU block where it lives and bring back only the change;
    # an asynchronous step (its blocks copied to the host) and a failed one make the
    # device's bits stale: the step after them diffs on the host and keeps them again.
    found = found_on_device(monkeypatch, PublishedBase, "device_changes")
    trainer = ToyTrainer(seed=7)
    names = sorted(trainer.state)
    with (
        ShardedPublisher(tmp_path / "a", "r", keyframe_every=5) as sharded,
        Publisher(tmp_path / "b", "r", keyframe_every=5, codec="zstd") as plain,
    ):
        for step in range(8):
            trainer.step(lr=3e-3)
            state: dict[str, Any] = _on_device(trainer.state)
            state.update({n: LocalShard(state[n], state[n].shape, (0,) * state[n].ndim) for n in names[::2]})
            if step == 3:
                sharded.publish_async(state).result()
            elif step == 5:
                with pytest.raises(InvalidInput):
                    sharded.publish({**state, "bad": "not a tensor"})
                sharded.publish(state)
            else:
                sharded.publish(state)
            plain.publish(_on_device(trainer.state))  # 0-d tensors made 1-d on both
            if step in (2, 4, 5, 6):  # on the device, but after the async step and the failure
                assert found[-len(names) :] == [step in {2, 6}] * len(names), (step, found)
    for version in range(1, 9):
        ours, theirs = (Run(open_store(tmp_path / s), "r").read_manifest(version).manifest for s in "ab")
        assert ours.tensors == theirs.tensors
    with Subscriber(tmp_path / "a", "r") as sub:
        assert sub.sync() == 8
        assert_bits_equal(sub.target.arrays, trainer.served())  # type: ignore[attr-defined]


def test_the_plan_finds_the_tensors_whose_blocks_are_runs() -> None:
    rows = [
        _rank(r, {"rows": Block((8, 4), (4 * r, 0), (4, 4)), "cols": Block((8, 4), (0, 2 * r), (8, 2))})
        for r in range(2)
    ]
    layout = plan_layout([*rows, _rank(2, {"whole": Block.whole((3, 2))})])
    assert layout.runs == {"rows": ((0, 0, 16), (1, 16, 32)), "whole": ((2, 0, 6),)}  # "cols" interleaves
    assert layout.run_slots == {("rows", 0): 0, ("rows", 1): 1, ("whole", 2): 2}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_owners_parts_of_their_runs_are_one_patch(data: st.DataObject) -> None:
    """Each owner encodes its run's changes (run_parts, encode_parts), whichever runs
    have none; the shards of every rank, renumbered, decode to the whole tensors' patch."""
    world = data.draw(st.integers(1, 4), label="world")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    shapes = {"a": (12, 5), "b": (9, 1), "c": (4, 3), "d": (6, 2)}
    specs = {n: TensorSpec(n, "BF16", s) for n, s in shapes.items()}
    held: list[dict[str, Block]] = [{} for _ in range(world)]
    for name, (rows, cols) in shapes.items():
        pieces = data.draw(st.integers(1, min(world, rows)), label=f"{name} pieces")
        cuts = sorted(data.draw(st.sets(st.integers(1, rows - 1), min_size=pieces - 1, max_size=pieces - 1)))
        owners = data.draw(st.permutations(range(world)), label=f"{name} owners")[:pieces]
        for owner, lo, hi in zip(owners, [0, *cuts], [*cuts, rows], strict=True):
            held[owner][name] = Block((rows, cols), (lo, 0), (hi - lo, cols))
    layout = plan_layout([_rank(r, blocks) for r, blocks in enumerate(held)])
    assert set(layout.runs) == set(specs)
    old = {n: rng.integers(0, 2**16, size=s, dtype=np.uint16) for n, s in shapes.items()}
    new = {n: v.copy() for n, v in old.items()}
    for name, v in new.items():  # nothing, a few elements (often in one block alone), or many
        flat = v.reshape(-1)
        k = data.draw(st.sampled_from([0, 1, 2, flat.size // 2]), label=f"{name} changes")
        flat[rng.choice(flat.size, k, replace=False)] += 1
    whole = diff(specs, old, new)
    # Each rank's share of the sum, as the step makes it: its blocks' parts and counts.
    changes: list[dict[str, TensorDelta]] = []
    shares = []
    for rank in range(world):
        mine, said = {}, {}
        for name, block in layout.owned(rank).items():
            first = contiguous_start(block)
            assert first is not None
            td = whole.tensors[name]
            inside = (td.indices >= first) & (td.indices < first + block.numel)
            was = old[name].reshape(-1)[td.indices[inside]]
            part = fingerprint_change(td.indices[inside], was, was + td.delta[inside])
            mine[name] = TensorDelta(td.spec, td.indices[inside], td.delta[inside], 0, 0)
            said[name] = (part, int(inside.sum()))
        changes.append(mine)
        shares.append(tally(layout, rank, said))
    summed, busy = totals(layout, np.sum(shares, axis=0))
    infos = {}
    for name, td in whole.tensors.items():  # the parts add up to every tensor's whole change
        part, changed = summed[name]
        assert ((td.base_fingerprint + part) & (2**64 - 1), changed) == (td.target_fingerprint, td.changed)
        infos[name] = TensorInfo(td.spec, td.base_fingerprint, td.target_fingerprint, td.changed)
    patch_id = compute_patch_id(infos)
    written = [
        encode_parts(run_parts(layout, rank, infos, busy, mine), patch_id, max_shard_bytes=600)
        for rank, mine in enumerate(changes)
    ]
    total = sum(map(len, written))
    shards = [renumber(s, patch_id, i, total) for i, s in enumerate(s for part in written for s in part)]
    got = decode(shards, specs=specs)
    for name, td in whole.tensors.items():
        assert got.tensors[name].target_fingerprint == td.target_fingerprint
        assert (got.tensors[name].indices == td.indices).all() and (got.tensors[name].delta == td.delta).all()
