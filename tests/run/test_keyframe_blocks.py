"""A rank's blocks of a keyframe read by byte ranges (bulletin.keyframe_blocks): a base
rebuilt for blocks holds exactly their bits and parts, reads O(its shard) of a row
split, and refuses a keyframe file whose header does not hold its manifest's tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bulletin import Publisher
from bulletin.base import PublishedBase
from bulletin.blocks import Block, block_slices, part_fingerprint
from bulletin.errors import FormatError
from bulletin.keyframe_blocks import GAP_BYTES, READ_BYTES, _reads
from bulletin.run import Run, StoredManifest
from bulletin.storage import open_store
from bulletin.storage.wrapper import CountingStore
from patcher.cast import cast_bits
from tests.run.test_publisher_base import ReadLog

SHAPES = {"a": (256, 96), "b": (5, 6, 40), "c": (1000,), "d": (3, 4)}


def _run(tmp_path: Path, versions: int, **options: Any) -> tuple[str, dict[str, np.ndarray]]:
    """A run of ``versions`` (a keyframe in several files and an index, then patches),
    and the served bits of its last version."""
    url = str(tmp_path / "store")
    rng = np.random.default_rng(0)
    values = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    served: dict[str, np.ndarray] = {}
    with Publisher(url, "run", keyframe_file_bytes=16 << 10, cache_dir=tmp_path / "writer", **options) as pub:
        for _ in range(versions):
            pub.publish(values)
            served = {n: cast_bits(v.view(np.uint32), "F32", "BF16").reshape(v.shape) for n, v in values.items()}
            for v in values.values():
                v.reshape(-1)[rng.random(v.size) < 0.05] *= np.float32(1.5)
    return url, served


def _blocks(rank: int) -> dict[str, Block]:
    """Rank ``rank`` of 2's blocks: rows of ``a``, the last dimension of ``b``, a run of ``c``,
    and nothing of ``d`` on rank 1 (an empty block)."""
    a, b, c, d = (SHAPES[n] for n in "abcd")
    half = a[0] // 2
    return {
        "a": Block(a, (rank * half, 0), (half, a[1])),
        "b": Block(b, (0, 0, rank * 15), (b[0], b[1], 15 + 10 * rank)),
        "c": Block(c, (rank * 300,), (300 + 400 * rank,)),
        "d": Block(d, (0, 0), (3 - 3 * rank, 4)),
    }


def _open(tmp_path: Path, url: str, blocks: dict[str, Block], rank: int) -> tuple[PublishedBase, CountingStore]:
    store = CountingStore(open_store(url))
    run = Run(store, "run")
    tip = run.tip()
    assert isinstance(tip, StoredManifest)
    store.reset()
    base = PublishedBase(run, "BF16", tmp_path / "ranks", subfolder=f"rank-{rank}")
    base.open(tip, blocks)
    return base, store


@pytest.mark.parametrize("versions", [1, 3])
def test_a_rebuilt_base_holds_its_blocks_bits_and_parts(tmp_path: Path, versions: int) -> None:
    url, served = _run(tmp_path, versions)
    total = {name: 0 for name in SHAPES}
    for rank in (0, 1):
        blocks = _blocks(rank)
        base, _ = _open(tmp_path, url, blocks, rank)
        try:
            assert base.version == versions and base.blocks == blocks
            for name, block in blocks.items():
                want = np.ascontiguousarray(served[name][block_slices(block)])
                np.testing.assert_array_equal(base.bits(name), want)
                assert base.parts[name] == part_fingerprint(block, want)
                total[name] += base.parts[name]
        finally:
            base.close()
    fps = Run(open_store(url), "run").read_manifest(versions).manifest.fingerprints
    assert {name: part % 2**64 for name, part in total.items()} == dict(fps)  # the parts add up


def test_a_row_split_reads_about_its_share_of_the_keyframe(tmp_path: Path) -> None:
    url, _ = _run(tmp_path, 1)
    keyframe = Run(open_store(url), "run").read_manifest(1).manifest.keyframe
    assert keyframe is not None and len(keyframe.files) > 2  # files and the index
    rows = {name: Block(shape, (0,) * len(shape), (shape[0] // 2, *shape[1:])) for name, shape in SHAPES.items()}
    base, store = _open(tmp_path, url, rows, 0)
    base.close()
    down = store.reset().down
    whole = sum(obj.size for obj in keyframe.files)
    assert 0.4 * whole < down < 0.6 * whole, (down, whole)


def test_runs_close_together_are_one_read_and_far_apart_their_own() -> None:
    # A column split: runs a row apart. Small rows are read as spans (cut apart here);
    # rows wider than GAP_BYTES each on their own; a run wider than READ_BYTES in pieces.
    near = list(_reads(100, Block((64, 32), (0, 8), (64, 8)), 2, 0))
    assert len(near) == 1 and len(near[0][2]) == 64
    start, stop, cuts = near[0]
    assert (start, stop) == (100 + 16, 100 + 16 + 63 * 64 + 16)
    assert cuts[1] == (64, 16, 16)
    wide = GAP_BYTES // 2 + 8
    far = list(_reads(0, Block((4, 4 * wide), (0, wide), (4, wide)), 2, 0))
    assert [len(cuts) for _, _, cuts in far] == [1, 1, 1, 1]
    long = list(_reads(0, Block((2, READ_BYTES), (1, 0), (1, READ_BYTES)), 1, 7))
    assert [(s, e) for s, e, _ in long] == [(READ_BYTES, 2 * READ_BYTES)]
    pieces = list(_reads(0, Block((3 * READ_BYTES // 2,), (0,), (3 * READ_BYTES // 2,)), 2, 0))
    assert [e - s for s, e, _ in pieces] == [READ_BYTES, READ_BYTES, READ_BYTES]
    assert [cuts[0][2] for _, _, cuts in pieces] == [0, READ_BYTES, 2 * READ_BYTES]


def test_a_keyframe_file_whose_header_lies_is_refused_and_nothing_is_kept(tmp_path: Path) -> None:
    url, _ = _run(tmp_path, 1)
    keyframe = Run(open_store(url), "run").read_manifest(1).manifest.keyframe
    assert keyframe is not None
    obj = next(o for o in keyframe.files if o.key.endswith(".safetensors"))
    path = Path(url) / "runs" / "run" / obj.key
    if not path.exists():
        path = next(Path(url).rglob(obj.key.rsplit("/", 1)[-1]))
    raw = bytearray(path.read_bytes())
    at = raw.index(b'"BF16"')
    raw[at : at + 6] = b'"F16" '  # the same size: only the header's word changes
    path.chmod(0o644)
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="otherwise than its manifest"):
        _open(tmp_path, url, _blocks(0), 0)
    assert not [p for p in (tmp_path / "ranks" / "rank-0").glob("base-*")]


def test_a_rebuilt_rank_downloads_only_the_patch_shards_that_change_its_blocks(tmp_path: Path) -> None:
    # Shards of 1 KiB: each patch is many, each holding a few tensors' entries (by name).
    url, served = _run(tmp_path, 3, codec="zstd", max_shard_bytes=1 << 10)
    store = ReadLog(open_store(url))
    run = Run(store, "run")
    tip = run.tip()
    assert isinstance(tip, StoredManifest)
    patches = [run.read_manifest(v).manifest.patch for v in (2, 3)]
    shards = {run.key(obj.key) for ref in patches if ref is not None for obj in ref.shards}
    # A pipeline stage's whole tensor and an FSDP rank's first rows of another.
    blocks = {"d": Block(SHAPES["d"], (0, 0), SHAPES["d"]), "a": Block(SHAPES["a"], (0, 0), (64, SHAPES["a"][1]))}
    base = PublishedBase(run, "BF16", tmp_path / "ranks", subfolder="rank-0")
    try:
        base.open(tip, blocks)
        for name, block in blocks.items():
            want = np.ascontiguousarray(served[name][block_slices(block)])
            np.testing.assert_array_equal(base.bits(name), want)
            assert base.parts[name] == part_fingerprint(block, want)
    finally:
        base.close()
    read = shards & set(store.read)
    assert len(shards) > 8 and 0 < len(read) < len(shards) / 2, (len(read), len(shards))
