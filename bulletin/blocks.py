"""A block of a tensor, and its index arithmetic: what one process holds of a tensor.

A block is the tensor's global shape, the block's offset along every dimension, and the
block's own shape: a DTensor's ``Shard(d)`` is one, Megatron's column and row splits too,
and a whole tensor is the block at offset 0. Indices inside a block are flat (C order)
over the block; the tensor's (global) flat indices are what patches and fingerprints
use. :func:`block_diff` is the one diff of a publisher's base (whole tensors or
blocks), in those coordinates. Everything here is pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from bulletin.errors import IncompatibleLayout, InternalError
from patcher.cast import cast_bits
from patcher.context_diff import ranked_delta
from patcher.diff import cast_changes
from patcher.fingerprint import fingerprint, fingerprint_rows
from patcher.fingerprint_update import fingerprint_change
from patcher.patch import TensorDelta, TensorSpec

__all__ = [
    "Block",
    "BlockChanges",
    "block_changes",
    "block_diff",
    "block_runs",
    "block_slices",
    "block_span",
    "contiguous_start",
    "global_indices",
    "local_indices",
    "part_fingerprint",
]


@dataclass(frozen=True, slots=True)
class Block:
    """A block of a tensor of ``shape`` (global): ``offsets`` and ``sizes`` per dimension."""

    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (len(self.shape) == len(self.offsets) == len(self.sizes)):
            raise IncompatibleLayout(f"a block of shape {list(self.shape)} needs one offset and size per dimension")
        for dim, (n, o, s) in enumerate(zip(self.shape, self.offsets, self.sizes, strict=True)):
            if o < 0 or s < 0 or o + s > n:
                raise IncompatibleLayout(f"block [{o}, {o + s}) leaves dimension {dim} of size {n}")

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> Block:
        return cls(shape, (0,) * len(shape), shape)

    @property
    def numel(self) -> int:
        return prod(self.sizes)

    @property
    def is_whole(self) -> bool:
        return self.sizes == self.shape

    @property
    def cut_dims(self) -> list[int]:
        """The dimensions the block does not span whole, outermost first."""
        return [d for d in range(len(self.shape)) if self.sizes[d] != self.shape[d]]

    def overlaps(self, other: Block) -> bool:
        return all(
            a < b + m and b < a + n
            for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True)
        ) and bool(self.numel and other.numel)


def _flat_index(shape: tuple[int, ...], coords: tuple[int, ...]) -> int:
    """The flat (C order) index of element ``coords`` of a tensor of ``shape``."""
    return sum(c * prod(shape[d + 1 :]) for d, c in enumerate(coords))


def contiguous_start(block: Block) -> int | None:
    """The whole tensor's flat index of the block's first element when the block is one
    contiguous run of the tensor's elements (a whole tensor, FSDP2's ``Shard(0)``), else None."""
    cut = block.cut_dims
    if cut and any(block.sizes[d] != 1 for d in range(cut[-1])):
        return None
    return _flat_index(block.shape, block.offsets)


def block_span(block: Block) -> tuple[int, int]:
    """The whole tensor's flat indices ``[first, last + 1)`` the block's elements lie
    within (every one of them, and for a block that is not one run, others between)."""
    if block.numel == 0:
        return 0, 0
    last = tuple(o + n - 1 for o, n in zip(block.offsets, block.sizes, strict=True))
    return _flat_index(block.shape, block.offsets), _flat_index(block.shape, last) + 1


def global_indices(block: Block, local: NDArray[np.int64]) -> NDArray[np.int64]:
    """Flat indices in the whole tensor of the block's flat (C order) ``local`` indices."""
    if block.is_whole or not block.shape:
        return local
    start = contiguous_start(block)
    if start is not None:  # a run of the tensor: one addition, no coordinates
        return local + start
    coords = np.unravel_index(local, block.sizes)
    shifted = tuple(c + o for c, o in zip(coords, block.offsets, strict=True))
    return np.ravel_multi_index(shifted, block.shape).astype(np.int64, copy=False)


def local_indices(block: Block, flat: NDArray[np.int64]) -> tuple[NDArray[np.bool_], NDArray[np.int64]]:
    """Which of the whole tensor's flat indices ``flat`` fall in the block, and their flat
    indices within it (for those that do)."""
    if block.is_whole or not block.shape:
        return np.ones(flat.size, dtype=np.bool_), flat
    coords = np.unravel_index(flat, block.shape)
    inside = np.ones(flat.size, dtype=np.bool_)
    for c, o, s in zip(coords, block.offsets, block.sizes, strict=True):
        inside &= (c >= o) & (c < o + s)
    moved = tuple((c[inside] - o) for c, o in zip(coords, block.offsets, strict=True))
    return inside, np.ravel_multi_index(moved, block.sizes).astype(np.int64, copy=False)


def block_runs(block: Block) -> tuple[NDArray[np.int64], int]:
    """The block as contiguous runs of the whole tensor's flat elements, in the block's C
    order: each run's first flat index, and the runs' one length (every dimension inside
    the innermost one the block cuts is whole, so a run spans it and all below)."""
    cut_dims = block.cut_dims
    if not cut_dims or block.numel == 0:
        return np.zeros(1 if block.numel else 0, dtype=np.int64), block.numel
    cut = cut_dims[-1]
    strides = [prod(block.shape[d + 1 :]) for d in range(len(block.shape))]
    starts = np.full((), block.offsets[cut] * strides[cut], dtype=np.int64)
    for d in range(cut):  # every combination of the outer coordinates, in C order
        coords = (np.arange(block.sizes[d], dtype=np.int64) + block.offsets[d]) * strides[d]
        starts = np.add.outer(starts, coords)
    return starts.reshape(-1), block.sizes[cut] * strides[cut]


def part_fingerprint(block: Block, bits: NDArray[np.unsignedinteger]) -> int:
    """The part of the whole tensor's fingerprint that the block's ``bits`` contribute
    (fingerprints are sums over elements of a hash of the global index and the bits)."""
    if block.numel == 0:
        return 0
    if block.is_whole:  # the tensor's own fingerprint (the threaded kernel)
        return fingerprint(bits)
    flat = np.ascontiguousarray(bits).reshape(-1)
    cut_dims = block.cut_dims
    if not cut_dims:
        return fingerprint_rows(flat, 0, flat.size)
    cut = cut_dims[-1]  # the innermost dimension cut: below it a block row is one contiguous run
    strides = [prod(block.shape[d + 1 :]) for d in range(len(block.shape))]
    start = block.offsets[cut] * strides[cut]
    run = block.sizes[cut] * strides[cut]
    if cut == 0:
        return fingerprint_rows(flat, start, run)
    outer = block.sizes[: cut - 1]
    slabs = flat.reshape(prod(outer), block.sizes[cut - 1], run)
    total = 0
    for k in range(slabs.shape[0]):
        coord = np.unravel_index(k, outer) if outer else ()
        first = start + sum((int(c) + o) * s for c, o, s in zip(coord, block.offsets, strides, strict=False))
        first += block.offsets[cut - 1] * strides[cut - 1]
        total += fingerprint_rows(slabs[k], first, strides[cut - 1])
    return total & 0xFFFFFFFFFFFFFFFF


def block_slices(block: Block) -> tuple[slice, ...]:
    """The block's place in the whole tensor, as slices (one per dimension)."""
    return tuple(slice(o, o + s) for o, s in zip(block.offsets, block.sizes, strict=True))


_MASK64: Final = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class BlockChanges:
    """The change of a block: ``delta`` in the tensor's coordinates (its global flat
    indices; as fingerprints, the block's parts before and after, which for a whole
    block are the tensor's own: ``delta`` is then the patch's entry), the same indices
    in the block (``local``), and the bits there now."""

    delta: TensorDelta
    local: NDArray[np.int64]
    now: NDArray[np.unsignedinteger]

    @property
    def part(self) -> int:
        """The block's part of the tensor's fingerprint change."""
        return (self.delta.target_fingerprint - self.delta.base_fingerprint) & _MASK64


def block_diff(
    spec: TensorSpec,
    block: Block,
    old: NDArray[np.unsignedinteger],
    src: NDArray[Any],
    source: str,
    base_part: int,
    *,
    ranked: bool = False,
) -> BlockChanges:
    """The change of ``block`` of tensor ``spec`` from ``old`` (its served bits, C order,
    whose part of the fingerprint is ``base_part``) to ``src`` (its elements' bits in
    dtype ``source``): cast to the served dtype inside the compiled diff
    (:func:`~patcher.diff.cast_changes`: no full-size copy), or, ``ranked`` (a whole
    tensor, for the context codec), after the cast, by the diff that ranks its changes
    as it goes (:func:`~patcher.context_diff.ranked_delta`)."""
    old = old.reshape(-1)
    src = np.ascontiguousarray(src).reshape(-1)
    if ranked:
        if not block.is_whole:
            raise InternalError(f"{spec.name}: a ranked diff of a block that is not the whole tensor")
        new = src if source == spec.dtype else cast_bits(src, source, spec.dtype)
        entry = ranked_delta(spec, old, new, base_part)
        return BlockChanges(entry, entry.indices, old[entry.indices] + entry.delta)  # deltas wrap, as bits do
    start = contiguous_start(block)
    # A run of the tensor (a whole tensor, a Shard(0) block): the diff hashes each index
    # at its place in the tensor as it goes. Else from the global indices.
    (local, was, delta), part = cast_changes(old, src, source, spec.dtype, first=start or 0)
    return block_changes(spec, block, local, was, delta, base_part, part=None if start is None else part)


def block_changes(
    spec: TensorSpec,
    block: Block,
    local: NDArray[np.int64],
    was: NDArray[np.unsignedinteger],
    delta: NDArray[np.unsignedinteger],
    base_part: int,
    *,
    part: int | None = None,
) -> BlockChanges:
    """The change of ``block`` from its changed indices in the block (``local``), the old
    bits there and the deltas: ``part``, its part of the fingerprint change, where the diff
    hashed it already, else hashed here with the tensor's indices (O(changed))."""
    indices = global_indices(block, local)
    now = was + delta  # deltas wrap, as the bits do: what the base takes once committed
    if part is None:
        part = fingerprint_change(indices, was, now)
    return BlockChanges(TensorDelta(spec, indices, delta, base_part, (base_part + part) & _MASK64), local, now)
