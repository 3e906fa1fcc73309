"""Golden shards: today's encoder writes them byte for byte, and every reader reads them."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from patcher.decode import decode, read_shard_header
from patcher.encode import encode
from patcher.fingerprint import format_fingerprint
from patcher.format import FORMAT_MAJOR
from tests.golden.cases import CASES, build, build_base, library_versions, summarise

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
CURRENT = GOLDEN / f"v{FORMAT_MAJOR}"
VERSIONS = sorted(p for p in GOLDEN.iterdir() if p.is_dir() and p.name.startswith("v"))


def _expected(folder: Path) -> dict[str, Any]:
    expected: dict[str, Any] = json.loads((folder / "expected.json").read_text())
    return expected


def _shards(folder: Path, case: dict[str, Any]) -> list[bytes]:
    return [(folder / f["name"]).read_bytes() for f in case["files"]]


def _base(folder: Path, case: dict[str, Any]) -> dict[str, Any] | None:
    """The base bits stored beside a context-coded case (its decoder's context), checked."""
    if "base" not in case:
        return None
    path = folder / case["base"]["name"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == case["base"]["sha256"], path.name
    with np.load(path) as stored:
        return {name: stored[name] for name in stored.files}


def test_every_version_folder_is_complete() -> None:
    assert CURRENT in VERSIONS
    for folder in VERSIONS:
        listed = {f["name"] for case in _expected(folder)["cases"].values() for f in case["files"]}
        assert {p.name for p in folder.glob("*.shard")} == listed, folder
        for case in _expected(folder)["cases"].values():
            for f in case["files"]:
                data = (folder / f["name"]).read_bytes()
                assert (len(data), hashlib.sha256(data).hexdigest()) == (f["size"], f["sha256"]), f["name"]


@pytest.mark.parametrize("folder", VERSIONS, ids=lambda p: p.name)
def test_can_read_old(folder: Path) -> None:
    """Every committed shard, of every format version, still decodes to what it held."""
    for name, case in _expected(folder)["cases"].items():
        shards = _shards(folder, case)
        patch = decode(shards, base=_base(folder, case))
        assert summarise(patch) == case["patch"], name
        for data in shards:
            assert read_shard_header(data).codec == case["codec"], name


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_encode_reproduces_golden_bytes(case: Any) -> None:
    expected = _expected(CURRENT)
    if expected["libraries"] != library_versions():
        # Compressors may emit other (equally valid) bytes in other versions; the
        # can-read-old test still runs. Regenerate with tests/golden/make.py --force.
        pytest.skip(f"golden bytes were written by {expected['libraries']}, not {library_versions()}")
    recorded = expected["cases"][case.name]
    patch = build(case)
    assert summarise(patch) == recorded["patch"]
    shards = encode(
        patch, codec=case.codec, level=case.level, max_shard_bytes=case.max_shard_bytes, base=build_base(case)
    )
    assert shards == _shards(CURRENT, recorded)


def test_golden_cases_cover_the_format() -> None:
    """The committed files exercise what the spec promises readers can meet."""
    cases = _expected(CURRENT)["cases"]
    assert {c["codec"] for c in cases.values()} == {"zstd", "lz4", "context"}
    assert cases["mixed-context"]["patch"] == cases["mixed-zstd"]["patch"]  # the same patch, coded on its base
    assert len(cases["split-context"]["files"]) > 1
    mixed = cases["mixed-zstd"]["patch"]
    assert {t["dtype"] for t in mixed.values()} >= {"BF16", "F32", "F16", "U8", "I64", "BOOL", "F8_E4M3", "F64"}
    assert any(t["shape"] == [] and t["changed"] for t in mixed.values())  # 0-d
    assert any(0 in t["shape"] for t in mixed.values())  # empty
    assert any(t["changed"] == 0 and 0 not in t["shape"] for t in mixed.values())  # unchanged
    assert len(cases["split-zstd"]["files"]) > 1
    split = [read_shard_header(d) for d in _shards(CURRENT, cases["split-zstd"])]
    assert sum(len(h.entries) for h in split) > 1  # one tensor, cut across shards
    huge = read_shard_header(_shards(CURRENT, cases["sparse-huge-zstd19"])[0])
    assert huge.entries[0].gap_escape_width == 4  # gaps past 2**33
    assert format_fingerprint(0x0123456789ABCDEF) == cases["sparse-huge-zstd19"]["patch"]["huge.table"]["base"]


def test_make_golden_refuses_to_overwrite(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "golden" / "make.py"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, check=False)

    out = tmp_path / "v1"
    assert run("--out", str(out)).returncode == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    refused = run("--out", str(out))
    assert refused.returncode == 1 and "--force" in refused.stderr
    assert run("--out", str(out), "--force").returncode == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first  # deterministic
