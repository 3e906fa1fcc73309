"""Test data shared by the kernel tests (no hypothesis here: the GPU machine may lack it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from patcher.cast import cast_bits
from patcher.decode import decode
from patcher.diff import diff
from patcher.dtypes import bits_dtype
from patcher.patch import Patch, TensorSpec

#: F32 bit patterns where casts go wrong if anything does: zeros, infinities, NaNs with
#: payloads, subnormals, rounding ties of both parities, overflow edges.
SPECIALS = np.array(
    [
        0x00000000, 0x80000000,  # +-0
        0x7F800000, 0xFF800000,  # +-Inf
        0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0xFF800001, 0xFFC00000, 0xFFFFFFFF,  # NaNs
        0x7FA00000, 0x7F80FFFF, 0x7F812345, 0xFFBFFFFF,  # NaN payloads, signalling too
        0x00000001, 0x007FFFFF, 0x80000001, 0x807FFFFF, 0x00400000,  # F32 subnormals
        0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000, 0xBF800000,  # normal edges, +-1
        0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,  # BF16 ties (even/odd) and neighbours
        0x7F7F8000, 0x7F7F7FFF, 0x7F7FFFFF,  # BF16 overflow to Inf at the top
        0x33000000, 0x33000001, 0x32FFFFFF, 0x33C00000, 0x33400000,  # F16 subnormal ties
        0x387FC000, 0x387FE000, 0x38800000, 0x38801000, 0x38803000,  # F16 subnormal/normal edge
        0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000,  # F16 overflow edge
        0x3F801000, 0x3F803000, 0x3F800FFF, 0x3F801001,  # F16 ties and neighbours
    ],
    dtype=np.uint32,
)  # fmt: skip

#: (current dtype, served dtype): every cast kind and every width.
CASTS = [("U8", "U8"), ("BF16", "BF16"), ("F32", "F32"), ("F64", "F64"), ("F32", "BF16"), ("F32", "F16")]


def random_bits(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> NDArray[Any]:
    """Uniformly random bits of ``dtype`` (every pattern, NaNs included)."""
    info = np.iinfo(bits_dtype(dtype))
    return rng.integers(0, info.max, shape, dtype=info.dtype, endpoint=True)


def pair(
    rng: np.random.Generator, source: str, served: str, shape: tuple[int, ...], density: float
) -> tuple[NDArray[Any], NDArray[Any]]:
    """Current bits and kept bits that differ from their cast at about ``density``."""
    current = random_bits(rng, source, shape)
    kept = cast_bits(current, source, served)
    flip = rng.random(shape) < density
    kept[flip] ^= rng.integers(1, 256, int(flip.sum())).astype(kept.dtype)
    return current, kept


def sorted_unique(rng: np.random.Generator, n: int, m: int) -> NDArray[np.int64]:
    """``min(m, n)`` distinct indices below ``n``, ascending."""
    return np.sort(rng.choice(n, size=min(m, n), replace=False)).astype(np.int64)


def model_patch(rng: np.random.Generator) -> tuple[Patch, dict[str, NDArray[Any]], dict[str, NDArray[Any]]]:
    """A small model, its next version, and the patch between them."""
    specs = {
        "embed.weight": TensorSpec("embed.weight", "BF16", (64, 16)),
        "norm.weight": TensorSpec("norm.weight", "F32", (16,)),
        "head.bias": TensorSpec("head.bias", "I8", (5,)),
    }
    old = {name: random_bits(rng, spec.dtype, spec.shape) for name, spec in specs.items()}
    new = {name: bits.copy() for name, bits in old.items()}
    new["embed.weight"][::7, ::3] += 1
    new["head.bias"][2] ^= 0x40
    return diff(specs, old, new), old, new


GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def golden_cases() -> dict[str, list[Path]]:
    """The codec's committed golden patches: ``v<major>/<case>`` -> its shard files in order."""
    cases: dict[str, list[tuple[int, Path]]] = {}
    for path in GOLDEN.glob("v*/*.shard"):
        case, _, index = path.stem.rpartition(".")
        cases.setdefault(f"{path.parent.name}/{case}", []).append((int(index), path))
    return {name: [p for _, p in sorted(shards)] for name, shards in sorted(cases.items())}


def golden_base(case: str) -> dict[str, NDArray[Any]] | None:
    """The base bits a context-coded golden case decodes against (its ``.base.npz``)."""
    folder, _, name = case.partition("/")
    path = GOLDEN / folder / f"{name}.base.npz"
    if not path.is_file():
        return None
    with np.load(path) as stored:
        return {key: stored[key] for key in stored.files}


def golden_patch(case: str) -> Patch:
    """A golden case decoded with the codec (against its base, for the context codec)."""
    return decode([path.read_bytes() for path in golden_cases()[case]], base=golden_base(case))


#: (dtype, exponent shift, exponent width) for select_ranks: every field width the
#: context codec classes by (patcher.context.EXPONENT_FIELDS), and a dtype without one.
SELECT_FIELDS = [("BF16", 7, 8), ("F16", 10, 5), ("F32", 23, 8), ("F64", 52, 11), ("F8_E4M3", 3, 4), ("I32", 0, 0)]


@dataclass(frozen=True)
class SelectCase:
    """select_ranks queries over ``base`` and the flat indices they must give."""

    dtype: str
    base: NDArray[Any]
    shift: int
    width: int
    lo: int
    classes: int
    start: int
    stop: int
    query_classes: NDArray[np.uint8]
    ranks: NDArray[np.int64]
    expected: NDArray[np.int64]

    @property
    def mask(self) -> int:
        return (1 << self.width) - 1


def select_case(
    rng: np.random.Generator, dtype: str, shift: int, width: int, n: int, classes: int, density: float
) -> SelectCase:
    """A base whose exponents straddle a window of ``classes`` (so the edge classes
    collect the clipped ones), a random element range, and about ``density`` of its
    elements queried, as the context codec's decoder would: class-major, by rank."""
    base = random_bits(rng, dtype, (n,))
    lo = 0
    if width:
        top = (1 << width) - 1
        lo = int(rng.integers(0, max(1, top - classes)))
        exps = np.clip(lo + rng.integers(-2, classes + 2, n), 0, top).astype(base.dtype)
        field = base.dtype.type(top << shift)
        base = (base & ~field) | (exps << base.dtype.type(shift))
    start = int(rng.integers(0, max(1, n // 4)))
    stop = int(rng.integers(max(start, n - n // 4), n + 1))
    exponent = (base.astype(np.uint64) >> np.uint64(shift)) & np.uint64((1 << width) - 1)
    cls = np.clip(exponent.astype(np.int64) - lo, 0, classes - 1)
    # rank of an element = elements of its class in [start, element).
    rank_all = np.zeros(n, np.int64)
    for c in range(classes):
        members = np.flatnonzero(cls[start:stop] == c) + start
        rank_all[members] = np.arange(members.size)
    picked = np.flatnonzero(rng.random(stop - start) < density) + start
    rank = rank_all[picked]
    order = np.lexsort((rank, cls[picked]))
    return SelectCase(
        dtype,
        base,
        shift,
        width,
        lo,
        classes,
        start,
        stop,
        cls[picked][order].astype(np.uint8),
        rank[order],
        picked[order].astype(np.int64),
    )
