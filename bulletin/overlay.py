"""The log layout's bits in memory: a read-only base under overlays of changed elements.

An :class:`Overlay` holds, per tensor, the sorted flat indices of the elements changed
over what lies below it and the bits they hold now: 4-byte indices wherever they fit (a
tensor under 2**32 elements, every one in practice), so about 6 bytes per changed BF16
element. :class:`Layered` reads a version as a base's map with overlays over it, and
:func:`advance` verifies a patch against that and returns its changes as an overlay of
their own: an apply holds only its changes until it is activated, and the activation
merges them into the live overlay one tensor at a time (:meth:`Overlay.absorb`), so
that the overlays are never held twice.

Arrays are never changed once made. The live overlay's entries are replaced by an
activation, under the writer's lock; a :class:`Layered` copies each layer's entries when
it is made, so bits handed out keep the version they were made for.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from bulletin.checkpoint import Checkpoint
from bulletin.errors import VerificationFailed
from patcher.apply import check_bases
from patcher.context import Overlay as ContextOverlay
from patcher.fingerprint_update import fingerprint_change
from patcher.patch import Patch, TensorDelta, TensorSpec

__all__ = ["Layered", "Overlay", "advance"]

Bits = NDArray[np.unsignedinteger]
#: One tensor's changes: sorted flat indices (uint32 where they fit, else int64), bits.
Changes = tuple[NDArray[np.integer], Bits]

_U32_END = 1 << 32


def _index_dtype(indices: NDArray[np.integer]) -> type[np.integer]:
    return np.uint32 if not indices.size or int(indices[-1]) < _U32_END else np.int64


def _own_indices(indices: NDArray[np.integer]) -> NDArray[np.integer]:
    """A copy of sorted ``indices`` in the narrowest index type that holds them."""
    return np.array(indices, dtype=_index_dtype(indices))


def _aligned(held: NDArray[np.integer], query: NDArray[np.integer]) -> tuple[NDArray[np.integer], NDArray[np.integer]]:
    """``held`` and ``query`` in one index type, converting the smaller side: numpy would
    otherwise widen a uint32 overlay to int64 on every lookup."""
    if held.dtype == query.dtype:
        return held, query
    if held.dtype == np.uint32 and (not query.size or int(query[-1]) < _U32_END):
        return held, query.astype(np.uint32)
    return held.astype(np.int64), query.astype(np.int64)


def _lookup(held: Changes | None, below: Bits, indices: NDArray[np.integer]) -> Bits:
    """``below`` (the bits under ``held`` at sorted ``indices``) with ``held``'s values
    where it has some; ``below`` is changed and returned."""
    if held is None or not held[0].size:
        return below
    idx, query = _aligned(held[0], indices)
    pos = np.minimum(np.searchsorted(idx, query), idx.size - 1)
    hit = idx[pos] == query
    below[hit] = held[1][pos[hit]]
    return below


def _merge(held: Changes | None, indices: NDArray[np.integer], values: Bits) -> Changes:
    """``held`` with ``values`` now at sorted, distinct ``indices``: new arrays, in one
    pass over ``held`` (an insert, then the values already there overwritten)."""
    if held is None or not held[0].size:
        return _own_indices(indices), np.array(values, copy=True)
    idx, new = _aligned(held[0], indices)
    pos = np.searchsorted(idx, new)
    hit = np.zeros(new.size, dtype=bool)
    inside = pos < idx.size
    hit[inside] = idx[pos[inside]] == new[inside]
    miss = ~hit
    at = pos[miss]
    out_idx = np.insert(idx, at, new[miss])
    out_vals = np.insert(held[1], at, values[miss])
    if hit.any():
        # An old element at p moved right by the new ones inserted at or before p.
        old = pos[hit]
        out_vals[old + np.searchsorted(at, old, side="right")] = values[hit]
    return out_idx, out_vals


class Overlay:
    """Elements changed over what lies below (a base, or a base and overlays), per tensor.
    Only :meth:`absorb` changes one, replacing entries (module docstring)."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: dict[str, Changes] | None = None) -> None:
        self.tensors: dict[str, Changes] = tensors if tensors is not None else {}

    @property
    def elements(self) -> int:
        return sum(int(idx.size) for idx, _ in self.tensors.values())

    def absorb(self, top: Overlay) -> None:
        """Lay ``top`` over this overlay, in place, one tensor at a time."""
        for name, (idx, vals) in top.tensors.items():
            self.tensors[name] = _merge(self.tensors.get(name), idx, vals)

    def under(self, top: Overlay) -> Overlay:
        """A new overlay: this one with ``top`` over it (this one stays as it is)."""
        out = Overlay(dict(self.tensors))
        out.absorb(top)
        return out


class Layered(Mapping[str, Bits]):
    """The bits of a version as a base under overlays (lowest first), one tensor at a
    time (a copy each where an overlay changes it, made when asked for)."""

    def __init__(self, base: Checkpoint, overlays: Sequence[Overlay]) -> None:
        self._base = base
        # The entries as they are now: an activation replaces the live overlay's.
        self._layers = tuple(dict(layer.tensors) for layer in overlays)

    @property
    def specs(self) -> dict[str, TensorSpec]:
        return self._base.specs

    def base_bits(self, name: str) -> Bits:
        """The base's bits of ``name``, flat (its map: read only)."""
        return self._base.bits(name).reshape(-1)

    def values_at(self, name: str, indices: NDArray[np.integer]) -> Bits:
        """A copy of the bits at ``indices`` (sorted) of ``name``."""
        values: Bits = self._base.bits(name).reshape(-1)[indices]
        for layer in self._layers:
            values = _lookup(layer.get(name), values, indices)
        return values

    def overlay(self, name: str, step: TensorDelta | None) -> ContextOverlay | None:
        """The overlays' changes of ``name`` as one overlay of the base (int64 indices,
        bits), with ``step`` (changes not applied yet) over them; None where none."""
        sources = [top for layer in self._layers if (top := layer.get(name)) is not None and top[0].size]
        if step is not None and step.changed:
            sources.append((step.indices, self.values_at(name, step.indices) + step.delta))
        if not sources:
            return None
        held = sources[0]
        for top in sources[1:]:  # lowest first: each one's values win over those below
            held = _merge(held, *top)
        return held[0].astype(np.int64, copy=False), held[1]

    def __getitem__(self, name: str) -> Bits:
        if name not in self._base.specs:
            raise KeyError(name)
        base = self._base.bits(name)
        changed = [layer[name] for layer in self._layers if name in layer]
        if not changed:
            return base
        out = np.array(base, copy=True)
        flat = out.reshape(-1)
        for idx, vals in changed:
            flat[idx] = vals
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self._base.specs)

    def __len__(self) -> int:
        return len(self._base.specs)


def advance(below: Layered, patch: Patch, fingerprints: Mapping[str, int]) -> tuple[Overlay, dict[str, int]]:
    """``patch`` applied onto ``below``, reading only: its changes as an overlay of their
    own (to lay over ``below``'s) and the new fingerprints. ``WrongBase`` unless
    ``fingerprints`` are its bases; a changed tensor whose result misses its target is
    ``VerificationFailed``."""
    patch.check_layout(below.specs)
    check_bases({td.spec.name: td.base_fingerprint for td in patch}, fingerprints)
    new_fps = dict(fingerprints)
    step = Overlay()
    wrong: list[str] = []
    for td in patch:
        name = td.spec.name
        if not td.changed:
            continue
        old = below.values_at(name, td.indices)
        new = old + td.delta  # wraps mod 2**bits, as the deltas do
        got = (td.base_fingerprint + fingerprint_change(td.indices, old, new)) & 0xFFFFFFFFFFFFFFFF
        if got != td.target_fingerprint:
            wrong.append(name)
            continue
        step.tensors[name] = (_own_indices(td.indices), new)
        new_fps[name] = got
    if wrong:
        raise VerificationFailed(
            f"{len(wrong)} tensors miss their target after the patch (first {wrong[0]}): "
            "the bits held are not the ones their fingerprints record"
        )
    return step, new_fps
