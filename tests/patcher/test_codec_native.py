"""The compiled fast path against the NumPy codec, and apply straight from shards.

Every other test of this folder runs on both paths (conftest.py); these compare the
two paths' results within one test, and cover what only the fast path has:
``apply_shards`` and the extension's own argument checks.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from bulletin.errors import FormatError, IncompatibleTensors, InvalidInput, VerificationFailed, WrongBase
from patcher import native
from patcher.apply import PARALLEL_MIN, apply
from patcher.apply_shards import apply_shards
from patcher.decode import decode
from patcher.diff import diff
from patcher.encode import encode
from patcher.fingerprint import fingerprint
from patcher.patch import Patch, TensorSpec
from tests.patcher.helpers import assert_patches_equal, fingerprints, model_cases, mutate, random_bits

#: Compares the compiled path with NumPy itself: runs once (tests/conftest.py).
compiled = pytest.mark.compiled_vs_numpy


def _copy(tensors: dict[str, Any]) -> dict[str, Any]:
    return {n: t.copy() for n, t in tensors.items()}


def _bytes(tensors: dict[str, Any]) -> dict[str, bytes]:
    return {n: t.tobytes() for n, t in tensors.items()}


def test_the_extension_is_built_where_required() -> None:
    # scripts/test.sh (and so CI) installs with BULLETIN_REQUIRE_NATIVE=1: a compile
    # failure fails the install, and a missing module fails here.
    if os.environ.get("BULLETIN_REQUIRE_NATIVE") == "1":
        assert native.BUILT


@compiled
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=model_cases())
def test_both_paths_make_the_same_patch_and_bytes(case: tuple[dict[str, Any], dict[str, Any], dict[str, Any]]) -> None:
    specs, old, new = case
    fps = fingerprints(old)
    with native.disabled():
        reference = diff(specs, old, new)
        reference_shards = encode(reference, max_shard_bytes=4096)
        assert fingerprints(new) == {n: td.target_fingerprint for n, td in reference.tensors.items()}
    fast = diff(specs, old, new, base_fingerprints=fps)
    assert_patches_equal(fast, reference)
    assert fingerprints(old) == fps
    assert encode(fast, max_shard_bytes=4096) == reference_shards
    assert_patches_equal(decode(reference_shards), reference)


@compiled
@pytest.mark.parametrize("dtype", ["U8", "BF16", "F32", "F64"])
@pytest.mark.parametrize("size", [0, 1, 7, 63, 64, 65, 1000, 4099])
def test_diff_at_every_alignment_and_tail(dtype: str, size: int) -> None:
    # Blocks are 64 bytes: sizes around a block and offsets into the buffer hit every
    # path (whole blocks, the tail, a change in the last element).
    rng = np.random.default_rng(size)
    spec = TensorSpec("t", dtype, (size,))
    for offset in (0, 1, 3):
        backing_old = random_bits(rng, dtype, (size + offset,))
        backing_new = mutate(rng, backing_old, 0.05, dtype)
        if size:
            backing_new[-1] ^= 1
        old, new = backing_old[offset:], backing_new[offset:]  # unaligned starts
        with native.disabled():
            reference = diff({"t": spec}, {"t": old}, {"t": new})
        assert_patches_equal(diff({"t": spec}, {"t": old}, {"t": new}), reference)


@compiled
def test_diff_outputs_grow_past_their_first_guess() -> None:
    # Denser than the first output buffer (1/256 of the elements) holds.
    rng = np.random.default_rng(1)
    spec = TensorSpec("t", "BF16", (1 << 17,))
    old = random_bits(rng, "BF16", spec.shape)
    new = mutate(rng, old, 0.3, "BF16")
    with native.disabled():
        reference = diff({"t": spec}, {"t": old}, {"t": new})
    assert_patches_equal(diff({"t": spec}, {"t": old}, {"t": new}), reference)


@compiled
@pytest.mark.parametrize("dtype", ["U8", "F16", "F32", "U64"])
def test_fingerprints_agree(dtype: str) -> None:
    rng = np.random.default_rng(2)
    bits = random_bits(rng, dtype, (1001,))
    fast = fingerprint(bits)
    with native.disabled():
        assert fingerprint(bits) == fast
    # A non-contiguous view takes the NumPy path and still agrees.
    with native.disabled():
        strided = fingerprint(np.ascontiguousarray(bits[::2]))
    assert fingerprint(bits[::2]) == strided


@compiled
@pytest.mark.parametrize("dtype", ["U8", "F16", "F32", "U64"])
@pytest.mark.parametrize("first", [0, 13, 1 << 61])
def test_fingerprint_loops_agree_with_the_definition(dtype: str, first: int) -> None:
    # The vector loop (AVX-512, where the CPU has it) and the portable one, on lengths
    # around its 16-element step and from any first index, both equal NumPy's sum.
    from patcher.fingerprint import fingerprint_rows

    rng = np.random.default_rng(3)
    for n in (0, 1, 15, 16, 17, 31, 33, 1000):
        bits = random_bits(rng, dtype, (n,))
        with native.disabled():
            want = fingerprint_rows(bits, first, n) if n else 0
        for vector in (True, False):
            assert native.speedups.fingerprint(bits, bits.dtype.itemsize, first, vector) == want, (n, vector)


@compiled
@pytest.mark.parametrize("target", ["BF16", "F16"])
def test_casts_agree(target: str) -> None:
    # Every BF16 kept pattern with low halves at and around each rounding point, every
    # F32 exponent with mantissas at F16's rounding points (both signs), and random bits.
    from patcher.cast import cast_bits

    rng = np.random.default_rng(4)
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    lows = np.array([0, 1, 0xFFF, 0x1000, 0x1FFF, 0x2000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    exponents = np.arange(256, dtype=np.uint32) << np.uint32(23)
    mantissas = np.array([0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3FFFFF, 0x400000, 0x7FFFFF], dtype=np.uint32)
    edges = (exponents[:, None] | mantissas[None, :]).reshape(-1)
    bits = np.concatenate(
        [
            (high[:, None] | lows[None, :]).reshape(-1),
            edges,
            edges | np.uint32(0x80000000),
            rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint32),
        ]
    )
    fast = cast_bits(bits, "F32", target)
    with native.disabled():
        np.testing.assert_array_equal(fast, cast_bits(bits, "F32", target))


# -- apply_shards --------------------------------------------------------------------------


def _transition(seed: int = 0) -> tuple[dict[str, Any], dict[str, Any], Patch]:
    """Old and new bits of five tensors (one unchanged) and the patch between them."""
    rng = np.random.default_rng(seed)
    shapes = {"a.weight": (300, 40), "b.bias": (40,), "c.weight": (5000,), "d.scale": (), "e.idle": (64,)}
    dtypes = {"a.weight": "BF16", "b.bias": "F32", "c.weight": "U8", "d.scale": "F64", "e.idle": "F16"}
    specs = {n: TensorSpec(n, dtypes[n], shapes[n]) for n in shapes}
    old = {n: random_bits(rng, dtypes[n], shapes[n]) for n in shapes}
    new = {n: (mutate(rng, old[n], 0.05, dtypes[n]) if n != "e.idle" else old[n].copy()) for n in shapes}
    return old, new, diff(specs, old, new)


@pytest.mark.parametrize("max_shard_bytes", [1 << 26, 700])
@pytest.mark.parametrize("threads", [1, 3])
def test_apply_shards_is_decode_then_apply(max_shard_bytes: int, threads: int) -> None:
    old, new, patch = _transition()
    shards = encode(patch, max_shard_bytes=max_shard_bytes)  # small shards cut tensors into entries
    held = _copy(old)
    fps = apply_shards(list(reversed(shards)), held, fingerprints(old), threads=threads)
    assert fps == fingerprints(new) == {n: td.target_fingerprint for n, td in patch.tensors.items()}
    assert _bytes(held) == _bytes(new)


def test_apply_shards_in_parallel_on_a_large_patch() -> None:
    # Enough changes for the thread pool (PARALLEL_MIN), in entries of several tensors.
    rng = np.random.default_rng(3)
    specs = {f"w{i}": TensorSpec(f"w{i}", "BF16", (1 << 19,)) for i in range(4)}
    old = {n: random_bits(rng, "BF16", s.shape) for n, s in specs.items()}
    new = {n: mutate(rng, old[n], 0.2, "BF16") for n in specs}
    patch = diff(specs, old, new)
    assert patch.changed_elements > PARALLEL_MIN
    for threads in (1, 4):
        held = _copy(old)
        apply_shards(encode(patch, max_shard_bytes=1 << 16), held, fingerprints(old), threads=threads)
        assert _bytes(held) == _bytes(new)
        held = _copy(old)
        apply(patch, held, fingerprints(old), threads=threads)
        assert _bytes(held) == _bytes(new)


def test_apply_shards_checks_before_touching() -> None:
    old, _new, patch = _transition()
    shards = encode(patch)
    held = _copy(old)
    before = _bytes(held)
    fps = fingerprints(old)
    wrong = dict(fps, **{"c.weight": fps["c.weight"] ^ 1})
    with pytest.raises(WrongBase, match=r"c\.weight"):
        apply_shards(shards, held, wrong)
    with pytest.raises(IncompatibleTensors):
        apply_shards(shards, {n: t for n, t in held.items() if n != "b.bias"}, fps)
    with pytest.raises(IncompatibleTensors):
        apply_shards(shards, dict(held, **{"b.bias": np.zeros(41, np.uint32)}), fps)
    with pytest.raises(InvalidInput):
        apply_shards(shards, dict(held, **{"b.bias": held["b.bias"].copy()[::-1]}), fps)  # not contiguous
    with pytest.raises(InvalidInput):
        apply_shards(shards, held, fps, threads=0)
    with pytest.raises(FormatError):
        apply_shards([shards[0][:-1]], held, fps)  # truncated
    assert _bytes(held) == before


def test_apply_shards_undoes_everything_for_a_lying_holder() -> None:
    old, _new, patch = _transition()
    held = _copy(old)
    held["a.weight"].reshape(-1)[patch.tensors["a.weight"].indices[-1]] ^= 1  # bits differ from the claim
    before = _bytes(held)
    with pytest.raises(VerificationFailed, match=r"a\.weight"):
        apply_shards(encode(patch), held, fingerprints(old), threads=2)
    assert _bytes(held) == before


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=model_cases(), small=st.booleans())
def test_apply_shards_round_trips(case: tuple[dict[str, Any], dict[str, Any], dict[str, Any]], small: bool) -> None:
    specs, old, new = case
    patch = diff(specs, old, new)
    held: dict[str, NDArray[Any]] = _copy(old)
    apply_shards(encode(patch, max_shard_bytes=4096 if small else 1 << 26), held, fingerprints(old))
    assert _bytes(held) == _bytes(new)


# -- the extension's own guards (its callers never trip them) ------------------------------


@compiled
def test_the_extension_refuses_buffers_that_do_not_fit() -> None:
    s = native.speedups
    a = np.zeros(100, np.uint16)
    idx, was, delta = np.empty(64, np.int64), np.empty(64, np.uint16), np.empty(64, np.uint16)
    with pytest.raises(ValueError, match="new"):
        s.diff(a, np.zeros(99, np.uint16), 2, 0, idx, was, delta)
    with pytest.raises(ValueError, match="width"):
        s.diff(a, a, 3, 0, idx, was, delta)
    with pytest.raises(ValueError, match="pos"):
        s.diff(a, a, 2, 101, idx, was, delta)
    with pytest.raises(ValueError, match="at least"):
        s.diff(a, a, 1, 0, idx[:10], was[:5], delta[:5])
    src = np.zeros(100, np.uint32)
    with pytest.raises(ValueError, match="src"):
        s.cast_diff(a, src[:99], 0, 0, 0, idx, was, delta)
    with pytest.raises(ValueError, match="kind"):
        s.cast_diff(a, src, 2, 0, 0, idx, was, delta)
    with pytest.raises(ValueError, match="pos"):
        s.cast_diff(a, src, 0, 101, 0, idx, was, delta)
    with pytest.raises(ValueError, match="at least"):
        s.cast_diff(a, src, 0, 0, 0, idx[:10], was[:10], delta[:10])
    with pytest.raises(ValueError, match="was_out"):
        s.cast_diff(a, src, 0, 0, 0, idx, was[:10], delta)
    with pytest.raises(ValueError, match="old_out"):
        s.scatter_add(a, 2, np.array([1], np.int64), np.array([1], np.uint16), np.empty(2, np.uint16), -1)
    with pytest.raises(ValueError, match="out of range"):
        s.scatter(a, 2, np.array([100], np.int64), np.array([1], np.uint16))
    with pytest.raises(TypeError):  # not contiguous
        s.scatter_add(np.zeros(4, np.uint16)[::2], 2, np.empty(0, np.int64), b"", np.empty(0, np.uint16), -1)
    with pytest.raises(TypeError):  # read-only target
        s.scatter(b"\0\0", 2, np.array([0], np.int64), np.array([1], np.uint16))
    with pytest.raises(ValueError, match="target"):
        s.apply_entry(a, 2, b"\1", b"\0", b"", 0, 0, b"\0", b"", 0, 0, 1, 0, 101, False, 1)
    with pytest.raises(ValueError, match="escapes"):
        s.apply_entry(a, 2, b"\1", b"\0", b"", 1, 0, b"\0", b"", 0, 0, 1, 0, 100, False, 1)


@compiled
def test_scatter_add_stops_at_the_first_bad_change() -> None:
    s = native.speedups
    t = np.arange(10, dtype=np.uint8)
    old = np.empty(4, np.uint8)
    done, _ = s.scatter_add(t, 1, np.array([1, 3, 3, 5], np.int64), np.array([1, 1, 1, 1], np.uint8), old, -1)
    assert done == 2 and t.tolist() == [0, 2, 2, 4, 4, 5, 6, 7, 8, 9]
    done, _ = s.scatter_add(t, 1, np.array([4], np.int64), np.array([1], np.uint8), old[:1], 4)  # not after 4
    assert done == 0
    done, _ = s.scatter_add(t, 1, np.array([6, 7], np.int64), np.array([1, 0], np.uint8), old[:2], -1)  # zero
    assert done == 1
