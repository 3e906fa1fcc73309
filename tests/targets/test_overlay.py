"""The log layout's in-memory overlays (bulletin.overlay) against a plain reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bulletin.checkpoint import Checkpoint, write_checkpoint
from bulletin.overlay import Layered, Overlay, _merge, advance
from patcher.diff import diff
from patcher.fingerprint import fingerprint
from patcher.patch import TensorSpec


def _reference(pairs: list[tuple[np.ndarray, np.ndarray]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for idx, vals in pairs:
        out.update(zip(idx.tolist(), vals.tolist(), strict=True))
    return out


@pytest.mark.parametrize("offset", [0, 1 << 32, (1 << 32) - 500])
def test_merges_agree_with_a_dictionary(offset: int) -> None:
    """Each merge holds the newest value of every index, sorted, distinct; indices that
    fit in 4 bytes are held in 4 bytes, those past 2**32 (and a mix) in 8."""
    rng = np.random.default_rng(offset % 97)
    held = None
    pairs = []
    for _ in range(12):
        idx = np.unique(rng.integers(0, 1000, size=rng.integers(0, 300))).astype(np.int64) + offset
        vals = rng.integers(0, 1 << 16, size=idx.size).astype(np.uint16)
        held = _merge(held, idx, vals)
        pairs.append((idx, vals))
        want = _reference(pairs)
        assert held[0].tolist() == sorted(want)
        assert held[1].tolist() == [want[i] for i in sorted(want)]
        assert held[1].dtype == np.uint16
        fits = not held[0].size or int(held[0][-1]) < 1 << 32
        assert held[0].dtype == (np.uint32 if fits else np.int64)


def _specs(bits: dict[str, np.ndarray]) -> dict[str, TensorSpec]:
    return {name: TensorSpec(name, "BF16", b.shape) for name, b in bits.items()}


def _folder(tmp_path: Path, bits: dict[str, np.ndarray]) -> Checkpoint:
    write_checkpoint(tmp_path / "base", _specs(bits), bits)
    return Checkpoint(tmp_path / "base")


def test_an_activation_leaves_bits_handed_out_before_it_as_they_were(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    v0 = {
        "a": rng.integers(0, 1 << 16, size=(64, 33)).astype(np.uint16),
        "b": rng.integers(0, 99, 50).astype(np.uint16),
    }
    with _folder(tmp_path, v0) as base:
        live = Overlay()
        fps = {name: fingerprint(bits) for name, bits in v0.items()}
        held = {name: bits.copy() for name, bits in v0.items()}
        for _ in range(4):
            new = {name: bits.copy() for name, bits in held.items()}
            flat = new["a"].reshape(-1)
            flat[rng.choice(flat.size, 40, replace=False)] += np.uint16(1)
            patch = diff(_specs(held), held, new, base_fingerprints=fps)
            before = Layered(base, (live,))
            step, fps = advance(before, patch, fps)
            live.absorb(step)
            after = Layered(base, (live,))
            for name, bits in held.items():
                assert np.array_equal(before[name], bits)  # made before: the old version
                assert np.array_equal(after[name], new[name])
            held = new
        assert fps == {name: fingerprint(bits) for name, bits in held.items()}
        assert live.tensors["a"][0].dtype == np.uint32
        assert "b" not in live.tensors  # unchanged tensors hold nothing
