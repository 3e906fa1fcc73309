"""encode_parts: one writer's entries of a patch that several write (FORMAT.md 3.4), and
the parts it refuses. That the parts of every writer make one patch is tested where the
writers are ranks (tests/distributed/test_one_rank.py)."""

from __future__ import annotations

import numpy as np
import pytest

from patcher.decode import decode
from patcher.diff import diff
from patcher.encode import TensorPart, encode, encode_parts
from patcher.errors import FormatError, InvalidInput
from patcher.format import TensorInfo, compute_patch_id
from patcher.patch import TensorSpec

SPEC = TensorSpec("w", "BF16", (10, 10))


def _part(start: int, stop: int, indices: list[int], changed: int = 4, base: int = 1, target: int = 2) -> TensorPart:
    idx = np.array(indices, dtype=np.int64)
    return TensorPart(TensorInfo(SPEC, base, target, changed), start, stop, idx, np.ones(idx.size, np.uint16))


def test_parts_of_the_whole_range_are_the_encoders_bytes() -> None:
    rng = np.random.default_rng(0)
    old = rng.integers(0, 2**16, size=(10, 10), dtype=np.uint16)
    new = old.copy()
    new.reshape(-1)[[3, 40, 41, 99]] += 7
    patch = diff({"w": SPEC}, {"w": old}, {"w": new})
    td = patch.tensors["w"]
    info = TensorInfo(SPEC, td.base_fingerprint, td.target_fingerprint, td.changed)
    whole = encode_parts([TensorPart(info, 0, 100, td.indices, td.delta)], compute_patch_id({"w": info}))
    assert whole == encode(patch)
    # Two writers' shards (each numbered alone) hold entries that tile the tensor.
    halves = [
        encode_parts([TensorPart(info, 0, 40, td.indices[:1], td.delta[:1])], compute_patch_id({"w": info})),
        encode_parts([TensorPart(info, 40, 100, td.indices[1:], td.delta[1:])], compute_patch_id({"w": info})),
    ]
    assert [len(h) for h in halves] == [1, 1]
    for shards in halves:
        with pytest.raises(FormatError, match=r"hole or overlap|entries end at 40"):
            decode(shards)  # each alone misses the other's range


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ([_part(0, 50, [60])], "outside the part's range"),
        ([_part(10, 50, [5])], "outside the part's range"),
        ([_part(0, 101, [5])], "outside the part's range"),
        ([_part(0, 50, [5], changed=0, target=1)], "holds 1 changes of 0"),
        ([_part(0, 50, [])], "whole of an unchanged tensor"),
        ([_part(0, 100, [], changed=0)], "different base and target"),
        ([_part(0, 50, [5, 5])], "strictly increasing"),
        ([_part(50, 100, [60]), _part(0, 50, [5])], "sorted"),
        ([_part(0, 60, [5]), _part(50, 100, [70])], "overlap"),
    ],
)
def test_parts_a_reader_would_refuse_are_refused(parts: list[TensorPart], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        encode_parts(parts, "0" * 64)


def test_the_context_codec_codes_whole_tensors_only() -> None:
    with pytest.raises(InvalidInput, match="context"):
        encode_parts([_part(0, 100, [5], changed=1)], "0" * 64, codec="context")
    with pytest.raises(InvalidInput, match="max_shard_bytes"):
        encode_parts([_part(0, 100, [5], changed=1)], "0" * 64, max_shard_bytes=8)
