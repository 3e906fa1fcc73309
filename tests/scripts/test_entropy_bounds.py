"""scripts/entropy_bounds.py against entropies known in closed form."""

from __future__ import annotations

import math

import numpy as np
import pytest

from scripts import entropy_bounds as eb


def stream(symbols: list[int] | np.ndarray, contexts: list[int] | np.ndarray, alphabet: int) -> eb.Stream:
    return eb.Stream("s", np.asarray(symbols, np.int64), np.asarray(contexts, np.int64), alphabet)


def test_conditional_and_iid_bits() -> None:
    # Four symbols equally often: 2 bits each i.i.d.; each context fixes the symbol: 0 bits.
    t = eb.table(stream([0, 1, 2, 3] * 50, [0, 1, 2, 3] * 50, 4))
    assert eb.iid_bits(t) == pytest.approx(400)
    assert eb.conditional_bits(t) == pytest.approx(0)
    # A context independent of a fair coin saves nothing.
    t = eb.table(stream([0, 1, 0, 1] * 25, [0, 0, 1, 1] * 25, 2))
    assert eb.conditional_bits(t) == pytest.approx(100)
    # p = 1/4 in context 0, 1/2 in context 1.
    t = eb.table(stream([1, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1], 2))
    h = -(0.25 * math.log2(0.25) + 0.75 * math.log2(0.75))
    assert eb.conditional_bits(t) == pytest.approx(4 * h + 2)


def test_large_keys_are_counted_by_sorting() -> None:
    rng = np.random.default_rng(0)
    symbols = rng.integers(0, 65536, 5000)
    contexts = rng.integers(0, 1 << 20, 5000)  # keys past the bincount limit
    small = eb.table(stream(symbols, contexts % 2, 65536))
    large = eb.table(stream(symbols, contexts, 65536))
    assert eb.conditional_bits(large) <= eb.conditional_bits(small) <= eb.iid_bits(small)
    assert large.total == small.total == 5000


def test_held_out_codes_a_like_stream_near_its_entropy_and_an_unlike_one_worse() -> None:
    rng = np.random.default_rng(1)
    contexts = rng.integers(0, 4, 200_000)
    symbols = (rng.random(200_000) < np.array([0.01, 0.1, 0.3, 0.5])[contexts]).astype(np.int64)
    train, test = stream(symbols[:100_000], contexts[:100_000], 2), stream(symbols[100_000:], contexts[100_000:], 2)
    model = eb.HeldOut()
    assert model.bits("s", eb.table(test)) is None
    model.fit("s", eb.table(train))
    held = model.bits("s", eb.table(test))
    assert held is not None
    in_sample = eb.conditional_bits(eb.table(test))
    assert in_sample <= held <= 1.01 * in_sample
    flipped = model.bits("s", eb.table(stream(1 - test.symbols, test.contexts, 2)))
    assert flipped is not None and flipped > 2 * held
    # Contexts and symbols never seen cost a finite amount.
    unseen = model.bits("s", eb.table(stream([0, 1], [9, 9], 2)))
    assert unseen is not None and 0 < unseen < 10


def test_streams_refuse_symbols_outside_their_alphabet() -> None:
    with pytest.raises(ValueError, match="outside"):
        stream([2], [0], 2)
    with pytest.raises(ValueError, match="negative"):
        stream([1], [-1], 2)


def test_flag_table_is_the_table_of_the_flags() -> None:
    rng = np.random.default_rng(2)
    contexts = rng.integers(0, 7, 10_000)
    changed = np.sort(rng.choice(10_000, 300, replace=False))
    flags = np.zeros(10_000, np.int64)
    flags[changed] = 1
    direct = eb.table(stream(flags, contexts, 2))
    fast = eb.flag_table(contexts, changed)
    np.testing.assert_array_equal(fast.keys, direct.keys)
    np.testing.assert_array_equal(fast.counts, direct.counts)
    # Shifting one part's contexts keeps it apart from another's in a merge.
    both = eb.merge([fast, eb.shifted(fast, 7)])
    assert eb.conditional_bits(both) == pytest.approx(2 * eb.conditional_bits(fast))
    assert both.total == 20_000
