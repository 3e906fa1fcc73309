"""Fold consecutive patches into one, without the versions between them.

Deltas are ``(new - old) mod 2**bits``, so the deltas of one element across k patches
sum (mod 2**bits) to its net change, and an element that returns to its starting bits
drops out. A node that is k versions behind downloads k patches but applies once.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np

from patcher.errors import InvalidInput, WrongBase
from patcher.patch import Patch, TensorDelta

__all__ = ["fold"]


def _fold_tensor(tds: list[TensorDelta]) -> TensorDelta:
    first, last = tds[0], tds[-1]
    touched = [td for td in tds if td.changed]
    if len(touched) <= 1:
        # Nothing to merge: reuse the arrays (never written to) or an empty pair.
        src = touched[0] if touched else first
        indices, delta = src.indices, src.delta
    else:
        indices_all = np.concatenate([td.indices for td in touched])
        delta_all = np.concatenate([td.delta for td in touched])
        # Each input is sorted: the stable sort (timsort for int64) merges k runs in O(n log k).
        order = np.argsort(indices_all, kind="stable")
        indices_all = indices_all[order]
        delta_all = delta_all[order]
        heads = np.empty(indices_all.size, dtype=np.bool_)
        heads[0] = True
        np.not_equal(indices_all[1:], indices_all[:-1], out=heads[1:])
        starts = np.flatnonzero(heads)
        # dtype pinned to the bits dtype so the sum wraps mod 2**bits like the deltas.
        sums = np.add.reduceat(delta_all, starts, dtype=delta_all.dtype)
        keep = sums != 0
        indices = indices_all[starts[keep]]
        delta = sums[keep]
    return TensorDelta(first.spec, indices, delta, first.base_fingerprint, last.target_fingerprint)


def fold(patches: Sequence[Patch]) -> Patch:
    """One patch equivalent to applying ``patches`` in order.

    Consecutive patches must chain: the same tensors (``IncompatibleTensors``) and each
    target fingerprint equal to the next base fingerprint (``WrongBase``). Base
    fingerprints come from the first patch, targets from the last. O(total changed).
    The result may share (read-only) arrays with the inputs.
    """
    if isinstance(patches, Patch) or not isinstance(patches, Sequence) or not patches:
        raise InvalidInput("fold takes a non-empty sequence of patches")
    for p in patches:
        if not isinstance(p, Patch):
            raise InvalidInput(f"fold: expected Patch objects, got {type(p)}")
    for k, (p, q) in enumerate(pairwise(patches)):
        q.check_layout(p.specs)
        broken = sorted(
            name for name, td in p.tensors.items() if td.target_fingerprint != q.tensors[name].base_fingerprint
        )
        if broken:
            raise WrongBase(
                f"patch {k + 1} does not start where patch {k} ends: {broken[:5]}"
                + (f" and {len(broken) - 5} more" if len(broken) > 5 else "")
            )
    for p in patches:
        for td in p:
            td.validate()
    names = sorted(patches[0].tensors)
    return Patch({name: _fold_tensor([p.tensors[name] for p in patches]) for name in names})
