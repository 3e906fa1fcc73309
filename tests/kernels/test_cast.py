"""patcher.cast against torch's own casts, bit for bit (the CPU twin of the GPU cast)."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
from numpy.typing import NDArray

from bulletin.errors import InvalidInput, UnsupportedDtype
from patcher.cast import BF16_NAN, CAST_CHUNK_ELEMENTS, cast_bits, cast_kind
from tests.kernels.helpers import SPECIALS

# torch's contiguous CPU casts are vectorised on x86 (AVX2/AVX512); those are the NaN
# answers patcher.cast adopts. Elsewhere only the NaN-ness of torch's answer is compared.
X86_VECTORISED = platform.machine() in {"x86_64", "AMD64"} and torch.backends.cpu.get_cpu_capability() in {
    "AVX2",
    "AVX512",
}


def torch_cast(bits: NDArray[np.uint32], dtype: torch.dtype) -> NDArray[np.uint16]:
    """torch's cast of a contiguous CPU tensor, as bits."""
    t = torch.from_numpy(np.ascontiguousarray(bits).view(np.float32))
    out: NDArray[np.uint16] = t.to(dtype).view(torch.uint16).numpy()
    return out


def assert_matches_torch(bits: NDArray[np.uint32], target: str) -> None:
    dtype = torch.bfloat16 if target == "BF16" else torch.float16
    ours = cast_bits(bits, "F32", target)
    theirs = torch_cast(bits, dtype)
    nan_in = (bits & 0x7FFFFFFF) > 0x7F800000
    differs = ours != theirs
    bad = np.flatnonzero(differs if X86_VECTORISED else differs & ~nan_in)
    assert bad.size == 0, [(hex(bits[i]), hex(ours[i]), hex(theirs[i])) for i in bad[:8]]
    # Either way a NaN stays a NaN, and a number stays a number.
    exp_mask, mant_mask = (0x7F80, 0x007F) if target == "BF16" else (0x7C00, 0x03FF)
    nan_out = ((ours & exp_mask) == exp_mask) & ((ours & mant_mask) != 0)
    np.testing.assert_array_equal(nan_out, nan_in)


@pytest.mark.parametrize("target", ["BF16", "F16"])
def test_special_values_match_torch(target: str) -> None:
    assert_matches_torch(SPECIALS, target)


@pytest.mark.parametrize("target", ["BF16", "F16"])
def test_random_bit_patterns_match_torch(target: str) -> None:
    rng = np.random.default_rng(20261201)
    assert_matches_torch(rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32), target)


@pytest.mark.parametrize("target", ["BF16", "F16"])
def test_every_rounding_tie_matches_torch(target: str) -> None:
    # Every kept pattern with the dropped bits exactly at, just below and just above the
    # midpoint: every tie of every exponent, both signs, both parities.
    drop = 16 if target == "BF16" else 13
    top = np.arange(1 << (32 - drop), dtype=np.uint32) << np.uint32(drop)
    half = np.uint32(1 << (drop - 1))
    assert_matches_torch(np.concatenate([top | half, top | (half - 1), top | (half + 1)]), target)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["BF16", "F16"])
def test_whole_exponent_ranges_match_torch(target: str) -> None:
    # Every F32 pattern whose top byte sits at an interesting edge: F32 subnormals, the
    # F16 subnormal and overflow thresholds, around 1.0, Inf/NaN, and negatives.
    for top in (0x00, 0x33, 0x38, 0x3F, 0x47, 0x7F, 0x80, 0xB8, 0xFF):
        assert_matches_torch(np.arange(1 << 24, dtype=np.uint32) | np.uint32(top << 24), target)


@pytest.mark.skipif(not X86_VECTORISED, reason="documents torch's x86 CPU paths")
def test_torch_nan_answers_are_path_dependent() -> None:
    # Why patcher.cast picks one NaN answer itself (see its module doc): torch's
    # vectorised and scalar CPU paths disagree. If this starts failing, torch changed
    # and the documentation in patcher/cast.py needs another look.
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F812345] * 32, dtype=np.uint32)
    t = torch.from_numpy(nans.view(np.float32))
    vectorised = t.to(torch.bfloat16).view(torch.uint16).numpy()
    scalar = t[::2].to(torch.bfloat16).contiguous().view(torch.uint16).numpy()
    assert set(vectorised.tolist()) == {BF16_NAN}
    assert set(scalar.tolist()) == {0x7FC0}


def test_identity_cast_copies() -> None:
    bits = np.arange(10, dtype=np.uint16)
    out = cast_bits(bits, "BF16", "BF16")
    np.testing.assert_array_equal(out, bits)
    assert not np.shares_memory(out, bits)


def test_shapes_chunks_and_out() -> None:
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 1 << 32, (3, CAST_CHUNK_ELEMENTS // 2 + 5), dtype=np.uint32)
    out = np.empty(bits.shape, dtype=np.uint16)
    assert cast_bits(bits, "F32", "BF16", out=out) is out
    np.testing.assert_array_equal(out.reshape(-1), torch_cast(bits.reshape(-1), torch.bfloat16))
    empty = cast_bits(np.empty((0, 4), dtype=np.uint32), "F32", "F16")
    assert empty.shape == (0, 4) and empty.dtype == np.uint16


def test_cast_kinds() -> None:
    assert cast_kind("F32", "BF16") == "f32_bf16"
    assert cast_kind("F32", "F16") == "f32_f16"
    assert cast_kind("I64", "I64") == "identity"
    for source, target in (("BF16", "F32"), ("F16", "BF16"), ("F64", "BF16")):
        with pytest.raises(UnsupportedDtype):
            cast_kind(source, target)
    with pytest.raises(UnsupportedDtype):
        cast_kind("F33", "F33")


def test_bad_arguments() -> None:
    bits = np.zeros(8, dtype=np.uint32)
    with pytest.raises(InvalidInput, match="uint32"):
        cast_bits(bits.view(np.float32), "F32", "BF16")
    with pytest.raises(InvalidInput, match="contiguous"):
        cast_bits(np.zeros(16, dtype=np.uint32)[::2], "F32", "BF16")
    with pytest.raises(InvalidInput, match="out"):
        cast_bits(bits, "F32", "BF16", out=np.zeros(8, dtype=np.uint32))
    readonly = np.zeros(8, dtype=np.uint16)
    readonly.flags.writeable = False
    with pytest.raises(InvalidInput, match="out"):
        cast_bits(bits, "F32", "BF16", out=readonly)


@pytest.mark.parametrize("kind", [0, 1])
def test_every_vector_width_of_the_compiled_cast_writes_the_same_bits(kind: int) -> None:
    """The compiled cast runs the widest loop the CPU has (AVX-512, AVX2, the baseline):
    each one this CPU runs gives the baseline's bits, on random patterns and the specials,
    at lengths that leave every vector tail."""
    from patcher import native

    if not native.BUILT:
        pytest.skip("patcher._speedups was not built")
    rng = np.random.default_rng(kind)
    bits = np.concatenate([SPECIALS, rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint32)])
    for n in (1, 15, 31, 63, 65, bits.size):
        src = np.ascontiguousarray(bits[:n])
        outs = []
        for widest in (0, 1, 2):
            dst = np.zeros(n, dtype=np.uint16)
            native.speedups.cast(src, dst, kind, widest)
            outs.append(dst)
        np.testing.assert_array_equal(outs[1], outs[0])
        np.testing.assert_array_equal(outs[2], outs[0])
