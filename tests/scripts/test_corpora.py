"""scripts/corpora.py: deterministic, cached, laid out as documented, and real training."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest

from scripts import corpora
from tests.scripts.conftest import tiny_spec

pytestmark = pytest.mark.slow


def test_a_run_is_deterministic(tiny_cache: Path, tmp_path: Path) -> None:
    first = corpora.build(tiny_spec(), tiny_cache)
    again = corpora.build(tiny_spec(), tmp_path, log=lambda _: None)  # from nothing: pretraining too
    files = sorted(p.name for p in first.glob("step-*.safetensors"))
    assert files == sorted(f"step-{k}.safetensors" for k in range(1, 7))
    for name in files:
        assert (first / name).read_bytes() == (again / name).read_bytes(), name


def test_each_step_changes_a_plausible_share_of_the_served_bits(tiny_cache: Path) -> None:
    folder = corpora.build(tiny_spec(), tiny_cache)
    meta = json.loads((folder / "meta.json").read_text())
    steps = list(corpora.load_steps(folder))
    assert [k for k, _ in steps] == list(range(1, 7))
    names = set(steps[0][1])
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied: served once
    for (_, old), (k, new) in itertools.pairwise(steps):
        changed = sum(int(np.count_nonzero(old[n] != new[n])) for n in names)
        pct = 100 * changed / sum(a.size for a in old.values())
        assert 0.01 < pct < 20, (k, pct)  # an Adam step at lr 1e-6 crosses few BF16 rounding steps
        assert meta["changed_pct"][str(k)] == pct
    assert meta["measured_steps"] == 5 and meta["first_step"] == 1
    assert set(meta["train_log"]) == {str(k) for k in range(1, 7)}


def test_a_shorter_request_reuses_the_cache_and_materialize_links_it(tiny_cache: Path, tmp_path: Path) -> None:
    folder = corpora.build(tiny_spec(), tiny_cache)
    stamp = (folder / "meta.json").stat().st_mtime_ns
    assert corpora.build(tiny_spec(steps=3), tiny_cache) == folder
    assert (folder / "meta.json").stat().st_mtime_ns == stamp  # not rebuilt
    (out,) = corpora.materialize([tiny_spec(steps=3)], tmp_path / "out", tiny_cache)
    assert out == tmp_path / "out" / "llama-rl-lr1e-6"
    assert os.path.samefile(out / "step-1.safetensors", folder / "step-1.safetensors")
    assert len(list(out.glob("step-*.safetensors"))) == 6  # all the cache holds
    assert [k for k, _ in corpora.load_steps(out, limit=3)] == [1, 2, 3, 4]
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "`llama-rl-lr1e-6`" in readme and "LlamaForCausalLM" in readme
    # Laying it out again leaves the folder as it is.
    corpora.materialize([tiny_spec()], tmp_path / "out", tiny_cache)
    assert os.path.samefile(out / "step-1.safetensors", folder / "step-1.safetensors")
