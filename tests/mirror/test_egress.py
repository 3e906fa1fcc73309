"""The origin's egress with mirrors: each version's objects leave it once per region (R
times), not once per node (N times), measured by scripts/bench_mirror.py's own counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.bench_mirror import main, measure


def test_each_version_leaves_the_origin_once_per_region_not_once_per_node() -> None:
    nodes, regions = 6, 2
    # One keyframe (version 1), then patches: every node needs every object.
    result = measure(nodes=nodes, regions=regions, versions=4, params=3e5, keyframe_every=50)
    rows = result["rows"]
    assert [row["version"] for row in rows] == [1, 2, 3, 4]
    for row in rows:
        direct, mirrored = row["direct"], row["mirrored"]
        count = len(mirrored["reads_per_data_object"])
        assert count >= 1
        assert mirrored["reads_per_data_object"] == [regions] * count, row  # R copies of every object
        assert direct["reads_per_data_object"] == [nodes] * count, row  # N without mirrors
        assert mirrored["manifest_reads"] == regions and direct["manifest_reads"] == nodes, row
        assert mirrored["bytes_by_kind"]["data"] * nodes == direct["bytes_by_kind"]["data"] * regions, row
    assert result["mirrored_data_objects"] * nodes == result["direct_data_objects"] * regions


def test_a_keyframe_no_node_needs_is_still_mirrored() -> None:
    # Version 3 has a keyframe and a patch: nodes at version 2 take the patch, every mirror
    # copies both (a mirror shows a version only with all its objects, for fresh nodes).
    result = measure(nodes=4, regions=2, versions=3, params=3e5, keyframe_every=2)
    row = result["rows"][2]
    assert row["kind"] == "keyframe+patch"
    assert sorted(set(row["direct"]["reads_per_data_object"])) == [0, 4]
    assert set(row["mirrored"]["reads_per_data_object"]) == {2}


def test_the_script_prints_both_ways_and_writes_its_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    args = ["--nodes", "4", "--regions", "2", "--versions", "2", "--params", "2e5", "--store", "local"]
    assert main([*args, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (
        "4 nodes in 2 regions" in printed and "[4] time(s) direct" in printed and "[2] time(s) with mirrors" in printed
    )
    result = json.loads(out.read_text())
    assert result["mirrored_data_objects"] * 2 == result["direct_data_objects"]
