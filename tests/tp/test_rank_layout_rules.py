"""The rank layout's building blocks, without vLLM: what its rules refuse, how a piece
selects a patch's indices, and partial fingerprints on both codec paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from bulletin.engines.rank_layout import Piece, RankLayout
from bulletin.engines.torch_module import GlobalIndex
from bulletin.errors import IncompatibleLayout
from patcher.fingerprint import fingerprint, fingerprint_rows
from patcher.patch import TensorSpec

# -- Piece.select -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "where",
    [
        GlobalIndex(0, 1, 50, 50),  # a whole tensor
        GlobalIndex(30, 1, 20, 20),  # a column-parallel slice: contiguous
        GlobalIndex(5, 7, 3, 10),  # row-parallel: 7 runs of 3, 10 apart
        GlobalIndex(9, 4, 1, 16),  # runs of one element
        GlobalIndex(0, 6, 10, 10),  # rows that touch: contiguous after all
    ],
)
def test_piece_select_finds_exactly_the_held_indices(where: GlobalIndex) -> None:
    rng = np.random.default_rng(3)
    held = where.of(np.arange(where.numel, dtype=np.int64))
    for _ in range(20):
        indices = np.unique(rng.integers(0, where.stop + 20, size=rng.integers(0, 40))).astype(np.int64)
        positions, local = Piece("p", 0, where).select(indices)
        want = np.flatnonzero(np.isin(indices, held))
        assert positions.tolist() == want.tolist()
        # Local indices are where those elements sit in the piece, read flat.
        assert where.of(local).tolist() == indices[want].tolist()


def test_piece_take_and_partial_are_the_pieces_elements() -> None:
    full = np.arange(100, dtype=np.uint16).reshape(10, 10)
    piece = Piece("p", 0, GlobalIndex(3, 10, 4, 10))  # columns 3..6 of every row
    assert piece.take(full).tolist() == full[:, 3:7].reshape(-1).tolist()
    rest = [Piece("p", 0, GlobalIndex(0, 10, 3, 10)), Piece("p", 0, GlobalIndex(7, 10, 3, 10))]
    total = (piece.partial(full) + sum(p.partial(full) for p in rest)) & (2**64 - 1)
    assert total == fingerprint(full)  # disjoint pieces add up to the tensor's fingerprint


# -- fingerprint_rows: the NumPy path is the compiled one ----------------------------------------


@pytest.mark.compiled_vs_numpy
@pytest.mark.parametrize("shape,first,stride", [((1, 1000), 17, 1000), ((6, 300), 4, 1000), ((9, 7), 0, 11)])
def test_fingerprint_rows_numpy_equals_native(codec_path: str, shape: tuple[int, int], first: int, stride: int) -> None:
    from patcher import native

    bits = np.random.default_rng(1).integers(0, 2**16, size=shape, dtype=np.uint16)
    fast = fingerprint_rows(bits, first, stride)
    with native.disabled():
        slow = fingerprint_rows(bits, first, stride)
    assert fast == slow
    # And both are the sum over the elements at their global indices.
    big = np.zeros(first + (shape[0] - 1) * stride + shape[1], dtype=np.uint16)
    for r in range(shape[0]):
        big[first + r * stride : first + r * stride + shape[1]] = bits[r]
    others = np.ones(big.size, dtype=bool)
    for r in range(shape[0]):
        others[first + r * stride : first + r * stride + shape[1]] = False
    # The elements outside the rows are zeros, which still contribute: subtract them.
    zeros = sum(fingerprint_rows(np.zeros(1, np.uint16), int(i), 1) for i in np.flatnonzero(others))
    assert (slow + zeros) & (2**64 - 1) == fingerprint(big)


# -- the rules' refusals ---------------------------------------------------------------------------


class UnquantizedLinearMethod:
    pass


class Fp8LinearMethod:
    pass


def _param(*shape: int, **attrs: object) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(*shape, dtype=torch.bfloat16), requires_grad=False)
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


class ColumnParallelLinear(nn.Module):
    """vLLM's class name and metadata (``layers/linear.py``): rank 0 of 2, ``output_dim=0``."""

    def __init__(self, out: int = 8, inp: int = 4, *, tp_rank: int = 0, tp_size: int = 2) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.quant_method: object = UnquantizedLinearMethod()
        self.weight = _param(out // tp_size, inp, output_dim=0, input_dim=1)


class RowParallelLinear(ColumnParallelLinear):
    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.tp_rank, self.tp_size = 1, 2
        self.quant_method = UnquantizedLinearMethod()
        self.weight = _param(8, 2, output_dim=0, input_dim=1)


class MyColumnParallelLinear(ColumnParallelLinear):
    """A subclass that may shard otherwise."""


class FusedMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w13_weight = _param(2, 8, 4)


def _root(**children: nn.Module) -> nn.Module:
    root = nn.Module()
    for name, child in children.items():
        setattr(root, name, child)
    return root


def _specs(**shapes: tuple[int, ...]) -> dict[str, TensorSpec]:
    return {f"{n}.weight": TensorSpec(f"{n}.weight", "BF16", s) for n, s in shapes.items()}


def test_the_rules_map_column_and_row_parallel_slices() -> None:
    model = _root(a=ColumnParallelLinear(tp_rank=1), b=RowParallelLinear())
    layout = RankLayout.of_module(model, _specs(a=(8, 4), b=(8, 4)))
    # Rank 1 of 2 on output_dim: rows 4..7, one run.
    assert layout.pieces["a.weight"] == Piece("a.weight", 0, GlobalIndex(16, 1, 16, 16))
    # Rank 1 of 2 on input_dim: columns 2..3 of every row.
    assert layout.pieces["b.weight"] == Piece("b.weight", 0, GlobalIndex(2, 8, 2, 4))


def _quantized() -> nn.Module:
    layer = ColumnParallelLinear()
    layer.quant_method = Fp8LinearMethod()
    return _root(a=layer)


def _packed() -> nn.Module:
    layer = ColumnParallelLinear()
    layer.weight.packed_dim = 1  # type: ignore[attr-defined]
    return _root(a=layer)


def _unknown_sharded() -> nn.Module:
    plain = nn.Module()
    plain.weight = _param(4, 4, output_dim=0)
    return _root(a=plain)


def _disagreeing() -> nn.Module:
    return _root(a=ColumnParallelLinear(tp_rank=0), b=ColumnParallelLinear(tp_rank=1))


@pytest.mark.parametrize(
    "module,specs,match",
    [
        (lambda: _root(a=MyColumnParallelLinear()), _specs(a=(8, 4)), "subclass of vLLM's ColumnParallelLinear"),
        (
            lambda: _root(experts=FusedMoE()),
            {"experts.w13_weight": TensorSpec("experts.w13_weight", "BF16", (2, 8, 4))},
            "expert",
        ),
        (_quantized, _specs(a=(8, 4)), "quantized with Fp8LinearMethod"),
        (_packed, _specs(a=(8, 4)), "packed"),
        (_unknown_sharded, _specs(a=(8, 4)), "unknown layer"),
        (
            lambda: _root(a=ColumnParallelLinear()),
            {"a.weight": TensorSpec("a.weight", "F32", (8, 4))},
            "holds torch.bfloat16",
        ),
        (_disagreeing, _specs(a=(8, 4), b=(8, 4)), "disagree on their rank"),
    ],
)
def test_the_rules_refuse_what_they_cannot_map(module: object, specs: dict[str, TensorSpec], match: str) -> None:
    with pytest.raises(IncompatibleLayout, match=match):
        RankLayout.of_module(module(), specs)  # type: ignore[operator]
