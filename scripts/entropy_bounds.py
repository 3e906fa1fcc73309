"""Entropy bounds of patches: what any coder of given symbols in given contexts can reach.

A *stream* is a sequence of symbols, each coded in a context (both integers). Its
empirical conditional entropy ``H(S | C)`` (in-sample: the counts of the stream itself)
is the least a coder whose probabilities depend only on the context could spend on it,
had it known the counts; the *held-out* estimate codes a stream with counts fitted on
other streams (earlier transitions), which is closer to what a coder that adapts or
ships a model can reach. The i.i.d. (zeroth-order) bound is the case of one context.

Everything works on count tables (sorted ``context * alphabet + symbol`` keys and their
counts), so a stream of every element of a model (a changed/unchanged flag per
element) costs one ``bincount``.

The held-out model gives symbol ``s`` in context ``c`` the probability
``(n(c, s) + PRIOR_WEIGHT * q(s)) / (n(c) + PRIOR_WEIGHT)``: the context's training
counts, backed off to ``q``, the training marginal of the symbol with add-1/2
(Krichevsky-Trofimov) smoothing over the stream's alphabet, so unseen contexts and
symbols cost a finite, honest amount.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "PRIOR_WEIGHT",
    "CountTable",
    "HeldOut",
    "Stream",
    "conditional_bits",
    "flag_table",
    "iid_bits",
    "merge",
    "shifted",
    "table",
]

#: Weight of the backed-off marginal in the held-out model (in counts).
PRIOR_WEIGHT: Final = 1.0
#: Keys below this are counted with one bincount; larger ones by sorting.
_BINCOUNT_LIMIT: Final = 1 << 24


@dataclass(frozen=True)
class Stream:
    """Symbols in ``[0, alphabet)``, each with a context (non-negative), of one kind."""

    name: str
    symbols: NDArray[np.int64]
    contexts: NDArray[np.int64]
    alphabet: int

    def __post_init__(self) -> None:
        if self.symbols.shape != self.contexts.shape:
            raise ValueError(f"{self.name}: symbols and contexts differ in shape")
        if self.symbols.size and (int(self.symbols.min()) < 0 or int(self.symbols.max()) >= self.alphabet):
            raise ValueError(f"{self.name}: symbols outside [0, {self.alphabet})")
        if self.contexts.size and int(self.contexts.min()) < 0:
            raise ValueError(f"{self.name}: negative context")


@dataclass(frozen=True)
class CountTable:
    """Joint counts: sorted unique keys ``context * alphabet + symbol`` and their counts."""

    alphabet: int
    keys: NDArray[np.int64]
    counts: NDArray[np.int64]

    @property
    def contexts(self) -> NDArray[np.int64]:
        return self.keys // self.alphabet

    @property
    def symbols(self) -> NDArray[np.int64]:
        return self.keys % self.alphabet

    @property
    def total(self) -> int:
        return int(self.counts.sum())


def _aggregate(keys: NDArray[np.int64], weights: NDArray[np.int64] | None = None) -> tuple[NDArray[np.int64], ...]:
    if keys.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    top = int(keys.max())
    # A bincount is O(largest key): only where that is not much more than sorting costs.
    if top < _BINCOUNT_LIMIT and top < max(1 << 16, 8 * keys.size):
        counts = np.bincount(keys, weights=weights).astype(np.int64)
        present = np.flatnonzero(counts)
        return present.astype(np.int64), counts[present]
    unique, inverse = np.unique(keys, return_inverse=True)
    counts = np.bincount(inverse, weights=weights).astype(np.int64)
    return unique.astype(np.int64), counts


def table(stream: Stream) -> CountTable:
    """The joint count table of a stream."""
    keys, counts = _aggregate(stream.contexts * stream.alphabet + stream.symbols)
    return CountTable(stream.alphabet, keys, counts)


def shifted(t: CountTable, contexts: int) -> CountTable:
    """``t`` with ``contexts`` added to every context (to keep tables of parts apart)."""
    return CountTable(t.alphabet, t.keys + contexts * t.alphabet, t.counts)


def flag_table(contexts: NDArray[np.int64], changed: NDArray[np.int64]) -> CountTable:
    """The table of a changed flag per element (symbol 1 at the ``changed`` positions)
    in ``contexts`` (one per element), without building the flags."""
    if contexts.size == 0:
        return CountTable(2, np.zeros(0, np.int64), np.zeros(0, np.int64))
    size = int(contexts.max()) + 1
    members = np.bincount(contexts, minlength=size)
    ones = np.bincount(contexts[changed], minlength=size)
    counts = np.stack([members - ones, ones], axis=1).reshape(-1).astype(np.int64)
    keys = np.flatnonzero(counts).astype(np.int64)
    return CountTable(2, keys, counts[keys])


def merge(tables: Iterable[CountTable]) -> CountTable:
    """Sum of count tables of one alphabet."""
    parts = list(tables)
    if not parts:
        raise ValueError("nothing to merge")
    keys, counts = _aggregate(np.concatenate([t.keys for t in parts]), np.concatenate([t.counts for t in parts]))
    return CountTable(parts[0].alphabet, keys, counts)


def _xlogx(n: NDArray[np.int64]) -> float:
    x = n[n > 0].astype(np.float64)
    return float(np.sum(x * np.log2(x)))


def conditional_bits(t: CountTable) -> float:
    """``n * H(S | C)`` in bits: sum over contexts of ``n_c log n_c`` minus the joint's."""
    _, by_context = _aggregate(t.contexts, t.counts)
    return _xlogx(by_context) - _xlogx(t.counts)


def iid_bits(t: CountTable) -> float:
    """``n * H(S)`` in bits: the stream's zeroth-order bound, its contexts ignored."""
    _, by_symbol = _aggregate(t.symbols, t.counts)
    return _xlogx(np.array([t.total], np.int64)) - _xlogx(by_symbol)


@dataclass
class HeldOut:
    """Count tables fitted on earlier streams of each name; codes later ones with them."""

    fitted: dict[str, CountTable] = field(default_factory=dict)

    def fit(self, name: str, t: CountTable) -> None:
        self.fitted[name] = merge([self.fitted[name], t]) if name in self.fitted else t

    def bits(self, name: str, test: CountTable) -> float | None:
        """Bits to code ``test`` with the model fitted so far (None: nothing fitted)."""
        train = self.fitted.get(name)
        if train is None:
            return None
        k = test.alphabet
        # q(s): the training marginal, add-1/2 over the alphabet.
        sym_keys, sym_counts = _aggregate(train.symbols, train.counts)
        q = (_lookup(sym_keys, sym_counts, test.symbols) + 0.5) / (train.total + 0.5 * k)
        # n(c, s) and n(c) of the test's keys in the training table.
        n_cs = _lookup(train.keys, train.counts, test.keys)
        ctx_keys, ctx_counts = _aggregate(train.contexts, train.counts)
        n_c = _lookup(ctx_keys, ctx_counts, test.contexts)
        p = (n_cs + PRIOR_WEIGHT * q) / (n_c + PRIOR_WEIGHT)
        return float(-np.sum(test.counts * np.log2(p)))


def _lookup(keys: NDArray[np.int64], counts: NDArray[np.int64], wanted: NDArray[np.int64]) -> NDArray[np.float64]:
    """``counts`` of each of ``wanted`` in the sorted ``keys`` (0 where absent)."""
    if keys.size == 0:
        return np.zeros(wanted.size, np.float64)
    at = np.minimum(np.searchsorted(keys, wanted), keys.size - 1)
    return np.where(keys[at] == wanted, counts[at], 0).astype(np.float64)
