"""The diff that ranks as it goes (patcher.context_diff), for the context codec's encoder.

It must give exactly :func:`patcher.diff.diff`'s patch, each big-enough float tensor's
delta carrying a valid window with the classes and ranks ``class_ranks`` gives for it,
the same on the compiled path and on NumPy; the encoder must code with them and the
shards must decode to the new bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from patcher import native
from patcher.apply_shards import apply_shards
from patcher.context import (
    EXPONENT_FIELDS,
    MAX_CLASSES,
    WINDOW_RUN,
    class_ranks,
    exponents,
    sampled_histograms,
    window_bits,
    window_of,
)
from patcher.context_diff import (
    GUESS_SLACK,
    SMALLEST,
    RankedDelta,
    _guess,
    _sample_runs,
    diff_ranked,
)
from patcher.context_encode import entries_of
from patcher.decode import read_shard_header
from patcher.diff import diff
from patcher.dtypes import bits_dtype
from patcher.encode import encode
from patcher.format import ContextEntry, TensorInfo
from patcher.patch import Patch, TensorSpec

needs_native = pytest.mark.skipif(not native.BUILT, reason="the compiled fast path is not built")

_FLOATS = {"BF16": None, "F16": np.float16, "F32": np.float32, "F64": np.float64}


def weights(rng: np.random.Generator, dtype: str, n: int, scale: float) -> NDArray[Any]:
    """Bits of N(0, scale) weights in ``dtype`` (BF16: truncated F32), or random integers."""
    if dtype == "BF16":
        f = (rng.standard_normal(n) * scale).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16)
    if dtype in _FLOATS:
        return (rng.standard_normal(n) * scale).astype(_FLOATS[dtype]).view(bits_dtype(dtype))
    return rng.integers(0, 1 << 30, size=n).astype(bits_dtype(dtype))


def stepped(rng: np.random.Generator, old: NDArray[Any], share: float) -> NDArray[Any]:
    """``old`` with about ``share`` of its elements moved by 1-3 ULPs."""
    new = old.copy()
    where = rng.random(old.size) < share
    new[where] += rng.integers(1, 4, int(where.sum())).astype(old.dtype)
    return new


def both_paths(specs: dict[str, TensorSpec], old: dict[str, Any], new: dict[str, Any]) -> tuple[Patch, Patch]:
    compiled = diff_ranked(specs, old, new)
    with native.disabled():
        plain = diff_ranked(specs, old, new)
    return compiled, plain


CASES = [
    # (dtype, elements, share changed, weight scale)
    ("BF16", SMALLEST, 0.004, 0.02),
    ("BF16", SMALLEST - 1, 0.004, 0.02),
    ("BF16", SMALLEST + 1, 0.004, 0.02),
    ("BF16", 300_003, 0.004, 0.02),
    ("BF16", 280_000, 0.5, 0.02),  # dense: the outputs fill and the scan resumes
    ("BF16", 300_000, 1.0, 1e-3),
    ("BF16", 270_000, 0.0, 0.02),
    ("F16", 270_001, 0.01, 1.0),
    ("F32", 262_144, 0.02, 0.02),
    ("F64", 263_000, 0.05, 100.0),
    ("I32", 100_000, 0.01, 1.0),
    ("BF16", 5_000, 0.01, 0.02),  # below SMALLEST: diffed plainly
]


@needs_native
@pytest.mark.parametrize(("dtype", "n", "share", "scale"), CASES)
def test_the_patch_is_diffs_and_both_paths_rank_it_alike(dtype: str, n: int, share: float, scale: float) -> None:
    rng = np.random.default_rng(n)
    old = weights(rng, dtype, n, scale)
    new = stepped(rng, old, share)
    specs = {"t": TensorSpec("t", dtype, (n,))}
    compiled, plain = both_paths(specs, {"t": old}, {"t": new})
    reference = diff(specs, {"t": old}, {"t": new}).tensors["t"]
    for td in (compiled.tensors["t"], plain.tensors["t"]):
        np.testing.assert_array_equal(td.indices, reference.indices)
        np.testing.assert_array_equal(td.delta, reference.delta)
        assert (td.base_fingerprint, td.target_fingerprint) == (
            reference.base_fingerprint,
            reference.target_fingerprint,
        )
    a, b = compiled.tensors["t"], plain.tensors["t"]
    ranked = dtype in EXPONENT_FIELDS and n >= SMALLEST and reference.changed > 0
    assert isinstance(a, RankedDelta) is ranked and isinstance(b, RankedDelta) is ranked
    if isinstance(a, RankedDelta) and isinstance(b, RankedDelta):
        assert a.window == b.window
        np.testing.assert_array_equal(a.classes, b.classes)
        np.testing.assert_array_equal(a.ranks, b.ranks)
        classes, ranks = class_ranks(old, dtype, a.window, 0, reference.indices)
        np.testing.assert_array_equal(a.classes, classes)
        np.testing.assert_array_equal(a.ranks, ranks)


def histograms(old: NDArray[Any], new: NDArray[Any], dtype: str) -> tuple[NDArray[np.int64], NDArray[np.int64], int]:
    stride, run = _sample_runs(old.size)
    sampled, _ = sampled_histograms(old, dtype, 0, old.size, new, stride, run)
    changed = np.bincount(exponents(old[old != new], dtype), minlength=sampled.size)
    return sampled, changed, stride // run


@pytest.mark.parametrize("seed", range(6))
def test_the_window_is_the_best_for_the_sample_or_within_the_slack(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 1 << 20
    old = weights(rng, "BF16", n, 0.02)
    new = stepped(rng, old, 0.0035)
    td = diff_ranked({"t": TensorSpec("t", "BF16", (n,))}, {"t": old}, {"t": new}).tensors["t"]
    assert isinstance(td, RankedDelta)
    sampled, changed, scale = histograms(old, new, "BF16")
    best = window_of(sampled, changed, scale)
    limit = window_bits(sampled, changed, best, scale)
    assert td.window == best or window_bits(sampled, changed, td.window, scale) <= limit * (1 + 1 / GUESS_SLACK)


def test_a_guess_the_changes_refute_is_replaced_and_ranked_again() -> None:
    """Changes only outside the sample, all at large exponents, while the sample sees
    none: the guess (from the sample's members) is far from the best window."""
    rng = np.random.default_rng(7)
    n = 1 << 20
    e = rng.integers(100, 130, size=n)  # thirty exponents: windows of 16 must choose
    old = ((e << 7) | rng.integers(0, 128, size=n)).astype(np.uint16)
    stride, run = _sample_runs(n)
    outside = np.flatnonzero((np.arange(n) % stride >= run) & (e >= 126))[::40]
    new = old.copy()
    new[outside] += np.uint16(1)
    sampled, sampled_changed = sampled_histograms(old, "BF16", 0, n, new, stride, run)
    assert not sampled_changed.any()
    guess = _guess(sampled, sampled_changed, stride // run)
    specs = {"t": TensorSpec("t", "BF16", (n,))}
    patches = (
        both_paths(specs, {"t": old}, {"t": new}) if native.BUILT else (diff_ranked(specs, {"t": old}, {"t": new}),)
    )
    for patch in patches:
        td = patch.tensors["t"]
        assert isinstance(td, RankedDelta)
        sampled, changed, scale = histograms(old, new, "BF16")
        assert td.window == window_of(sampled, changed, scale) != guess
        classes, ranks = class_ranks(old, "BF16", td.window, 0, td.indices)
        np.testing.assert_array_equal(td.classes, classes)
        np.testing.assert_array_equal(td.ranks, ranks)


def model(rng: np.random.Generator) -> tuple[dict[str, TensorSpec], dict[str, Any], dict[str, Any]]:
    shapes = {"a.weight": (1024, 384), "b.weight": (1000, 300), "norm": (384,), "ids": (70_000,)}
    dtypes = {"a.weight": "BF16", "b.weight": "F16", "norm": "BF16", "ids": "I32"}
    specs = {k: TensorSpec(k, dtypes[k], s) for k, s in shapes.items()}
    old = {k: weights(rng, dtypes[k], int(np.prod(s)), 0.02).reshape(s) for k, s in shapes.items()}
    new = {k: stepped(rng, v.reshape(-1), 0.004).reshape(v.shape) for k, v in old.items()}
    return specs, old, new


def test_the_encoder_codes_with_the_ranked_window_and_the_shards_decode_exactly() -> None:
    specs, old, new = model(np.random.default_rng(3))
    patch = diff_ranked(specs, old, new)
    ranked = {k: td for k, td in patch.tensors.items() if isinstance(td, RankedDelta)}
    assert set(ranked) == {"a.weight", "b.weight"}
    shards = encode(patch, codec="context", base=old, max_shard_bytes=1 << 20)
    windows = {}
    for shard in shards:
        for entry in read_shard_header(shard).entries:
            assert isinstance(entry, ContextEntry)
            windows[entry.tensor] = entry.window
    for name, td in ranked.items():
        assert windows[name] == td.window
    held = {k: v.copy() for k, v in old.items()}
    apply_shards(shards, held, {k: td.base_fingerprint for k, td in patch.tensors.items()})
    for k in specs:
        np.testing.assert_array_equal(held[k], new[k])


def test_a_ranked_tensor_cut_into_several_entries_is_ranked_by_the_encoder_again() -> None:
    rng = np.random.default_rng(5)
    n = 1 << 18
    old = weights(rng, "BF16", n, 0.02)
    new = stepped(rng, old, 0.01)
    specs = {"t": TensorSpec("t", "BF16", (n,))}
    patch = diff_ranked(specs, {"t": old}, {"t": new})
    td = patch.tensors["t"]
    assert isinstance(td, RankedDelta)
    info = TensorInfo(td.spec, td.base_fingerprint, td.target_fingerprint, td.changed)
    most = td.changed // 3 + 1
    entries = entries_of(info, old, td, most)
    assert len(entries) == 3
    for ce in entries:
        e = ce.entry
        classes, ranks = class_ranks(old, "BF16", ce.window, e.start, ce.indices)
        np.testing.assert_array_equal(ce.classes, classes)
        np.testing.assert_array_equal(ce.ranks, ranks)


@needs_native
def test_the_compiled_sample_is_numpys() -> None:
    rng = np.random.default_rng(11)
    for n in (1, 63, 4096, 70_001, 1 << 20):
        old = weights(rng, "BF16", n, 0.02)
        new = stepped(rng, old, 0.01)
        for stride, run in ((4096, WINDOW_RUN), (8192, 128), (65536, 1024), (100, 100)):
            got = np.zeros(256, np.int64), np.zeros(256, np.int64)
            native.speedups.ctx_sample(old, new, 2, 7, 8, 0, n, stride, run, *got)
            want = sampled_histograms(old, "BF16", 0, n, new, stride, run)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])


@needs_native
def test_the_compiled_scan_refuses_what_does_not_fit_its_buffers() -> None:
    old = np.zeros(1000, np.uint16)
    new = old.copy()
    totals, changed = np.zeros(MAX_CLASSES, np.uint64), np.zeros(256, np.int64)

    def outputs(cap: int) -> list[NDArray[Any]]:
        return [np.empty(cap, t) for t in (np.int64, np.uint16, np.uint16, np.uint8, np.int64)]

    scan = native.speedups.ctx_diff
    with pytest.raises(ValueError, match="at least 64"):
        scan(old, new, 2, 7, 8, 100, 16, 0, totals, changed, *outputs(10))
    with pytest.raises(ValueError, match="pos"):
        scan(old, new, 2, 7, 8, 100, 16, 1001, totals, changed, *outputs(64))
    with pytest.raises(ValueError, match="window"):
        scan(old, new, 2, 7, 8, 250, 16, 0, totals, changed, *outputs(64))
    with pytest.raises(ValueError):
        scan(old, new[:999], 2, 7, 8, 100, 16, 0, totals, changed, *outputs(64))
    with pytest.raises(ValueError):
        scan(old, new, 2, 7, 8, 100, 16, 0, totals[:15], changed, *outputs(64))
    with pytest.raises(ValueError):
        scan(old, new, 2, 7, 8, 100, 16, 0, totals, changed[:255], *outputs(64))
    short = outputs(64)
    short[4] = short[4][:63]
    with pytest.raises(ValueError):
        scan(old, new, 2, 7, 8, 100, 16, 0, totals, changed, *short)


@needs_native
def test_the_compiled_coder_refuses_a_class_outside_its_entry() -> None:
    """ctx_encode orders each entry's changes by class itself (a counting sort): a class
    past the entry's count would index past its counts, so it is refused."""
    meta = np.array([[2, 120, 4, 0, 2, 8, 0]], dtype=np.int64)  # 2 changes, 4 classes, BF16
    ranks = np.array([0, 1], dtype=np.int64)
    deltas = np.array([1, 1], dtype=np.uint16).tobytes()
    fit, stream = native.speedups.ctx_encode(meta, np.array([3, 1], np.uint8), ranks, deltas, 1 << 20)
    assert (fit, stream is not None) == (1, True)
    with pytest.raises(ValueError, match="class"):
        native.speedups.ctx_encode(meta, np.array([4, 1], np.uint8), ranks, deltas, 1 << 20)
