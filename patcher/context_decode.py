"""Shards of the context codec -> changes (docs/FORMAT.md 3.15). Pure: bytes in, no I/O.

Decoding has two stages. The **entropy stage** needs only the shard: it range-decodes
every entry into its changes' classes, ranks and deltas, in class-major order
(:func:`decode_changes`). The **resolve stage** needs the base: one pass over each
entry's range of the base tensor turns (class, rank) into indices
(patcher.context.select_ranks; a kernel on a GPU). Before the base is used at all, its
fingerprint must be the one the shard was coded against (:func:`check_base`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from patcher import native
from patcher.context import ClassWindow, Overlay, select_ranks
from patcher.context_model import decode_entry, entry_meta, new_decoder
from patcher.errors import ContextUnavailable, CorruptData, FormatError, InvalidInput, WrongBase
from patcher.fingerprint import fingerprint, format_fingerprint
from patcher.format import ContextEntry, ShardHeader, TensorInfo
from patcher.patch import Patch, TensorDelta

__all__ = [
    "CodedChanges",
    "ResolveEntry",
    "check_base",
    "coded_payload",
    "decode_changes",
    "needs_base",
    "resolve",
    "resolve_transition",
]


@dataclass(frozen=True, slots=True)
class CodedChanges:
    """One entry's changes as the entropy stage gives them: class-major, not yet indexed."""

    entry: ContextEntry
    classes: NDArray[np.uint8]
    ranks: NDArray[np.int64]
    delta: NDArray[np.unsignedinteger]

    @property
    def window(self) -> ClassWindow:
        return self.entry.window

    @property
    def what(self) -> str:
        return f"{self.entry.tensor}[{self.entry.start}:{self.entry.stop}]"


def needs_base(entry: ContextEntry) -> bool:
    """Whether decoding ``entry`` reads the base: only ranks of several classes do."""
    return entry.count > 0 and entry.classes > 1


def coded_payload(view: memoryview, header: ShardHeader) -> memoryview:
    """The payload of a shard whose ``header`` was read from ``view`` (for the context
    codec, its coded stream), after the size and payload checksum checks (every codec's:
    ``FormatError`` / ``CorruptData``)."""
    if len(view) != header.size:
        kind = "truncated" if len(view) < header.size else "trailing bytes"
        raise FormatError(f"{kind}: shard is {len(view)} bytes, its header says {header.size}")
    payload = view[header.payload_offset :]
    if zlib.crc32(payload) != header.payload_crc32:
        raise CorruptData(f"payload checksum mismatch in shard {header.shard_index}")
    return payload


def decode_changes(view: memoryview, header: ShardHeader) -> list[CodedChanges]:
    """The entropy stage of one shard: every entry's changes, in entry order."""
    if header.codec != "context":
        raise InvalidInput(f"a {header.codec} shard is not context coded")
    payload = coded_payload(view, header)
    entries = [e for e in header.entries if isinstance(e, ContextEntry)]
    if not any(e.count for e in entries):
        return [_empty(e, header) for e in entries]
    if native.active():
        return _decode_native(payload, header, entries)
    return _decode_python(payload, header, entries)


def _decode_python(payload: memoryview, header: ShardHeader, entries: Sequence[ContextEntry]) -> list[CodedChanges]:
    """The entropy stage in Python (patcher.context_model): the definition."""
    out: list[CodedChanges] = []
    dec = new_decoder(payload, f"shard {header.shard_index}")
    for e in entries:
        spec = header.tensors[e.tensor].spec
        dec.what = f"{e.tensor}[{e.start}:{e.stop}]"
        classes, ranks, delta = decode_entry(
            dec, spec.dtype, ClassWindow(e.lo, e.classes), e.count, e.stop - e.start, spec.bits_dtype
        )
        out.append(CodedChanges(e, classes, ranks, delta))
    dec.what = f"shard {header.shard_index}"
    dec.finish()
    return out


def _empty(e: ContextEntry, header: ShardHeader) -> CodedChanges:
    spec = header.tensors[e.tensor].spec
    return CodedChanges(e, np.empty(0, np.uint8), np.empty(0, np.int64), np.empty(0, spec.bits_dtype))


def _decode_native(payload: memoryview, header: ShardHeader, entries: Sequence[ContextEntry]) -> list[CodedChanges]:
    specs = [header.tensors[e.tensor].spec for e in entries]
    total = sum(e.count for e in entries)
    meta = entry_meta(entries, [s.dtype for s in specs], [e.stop - e.start for e in entries])
    classes = np.empty(total, dtype=np.uint8)
    ranks = np.empty(total, dtype=np.int64)
    offsets = [0]
    for e, spec in zip(entries, specs, strict=True):
        offsets.append(offsets[-1] + e.count * spec.width)
    deltas = np.empty(offsets[-1], dtype=np.uint8)
    if not native.speedups.ctx_decode(payload, meta, classes, ranks, deltas):
        _decode_python(payload, header, entries)  # says what is wrong
        raise FormatError(f"shard {header.shard_index}: coded stream does not decode")  # pragma: no cover
    out, at = [], 0
    for i, (e, spec) in enumerate(zip(entries, specs, strict=True)):
        delta = deltas[offsets[i] : offsets[i + 1]].view(spec.bits_dtype)
        out.append(CodedChanges(e, classes[at : at + e.count], ranks[at : at + e.count], delta))
        at += e.count
    return out


def check_base(
    infos: Mapping[str, TensorInfo],
    entries: Sequence[ContextEntry],
    base: Mapping[str, NDArray[Any]] | None,
    base_fingerprints: Mapping[str, int] | None,
    pending: Mapping[str, TensorDelta] | None = None,
) -> dict[str, NDArray[np.unsignedinteger]]:
    """The flat base bits of every tensor whose entries need them, once proven to be the
    patch's base; nothing is decoded before this.

    ``base`` holds each tensor's bits; ``pending``, changes not yet applied to them (a
    fold of earlier patches, when several are decoded before one apply), which then
    count as applied. The proof is ``base_fingerprints`` (the holder's verified record
    of the bits in ``base``) or, without it, the fingerprints computed from the bits;
    with ``pending``, its base fingerprints must be that record and its targets the
    patch's bases. ``ContextUnavailable`` without a base, ``WrongBase`` for another one.
    """
    names = sorted({e.tensor for e in entries if needs_base(e)})
    if not names:
        return {}
    if base is None:
        raise ContextUnavailable(
            f"{names[0]}: the patch is context coded and needs the base tensors' bits to decode; none were given"
        )
    out: dict[str, NDArray[np.unsignedinteger]] = {}
    wrong: list[str] = []
    for name in names:
        info = infos[name]
        array = base.get(name)
        if not isinstance(array, np.ndarray):
            raise ContextUnavailable(f"{name}: the patch is context coded; its base bits were not given")
        if array.dtype.itemsize != info.spec.width or array.size != info.spec.numel or not array.flags.c_contiguous:
            raise InvalidInput(f"{name}: base must be a C-contiguous array of {info.spec.numel} x {info.spec.dtype}")
        flat = array.reshape(-1).view(info.spec.bits_dtype)
        step = pending.get(name) if pending is not None else None
        want = info.base_fingerprint
        if step is not None:
            if step.target_fingerprint != want:
                wrong.append(name)
                continue
            want = step.base_fingerprint
        have = base_fingerprints.get(name) if base_fingerprints is not None else fingerprint(flat)
        if have != want:
            wrong.append(name)
            continue
        out[name] = flat
    if wrong:
        raise WrongBase(
            f"{wrong[0]}: the bits given as context are not the patch's base "
            f"(patch expects {format_fingerprint(infos[wrong[0]].base_fingerprint)})"
            + (f"; {len(wrong)} tensors differ" if len(wrong) > 1 else "")
        )
    return out


def _overlay(step: TensorDelta | None, flat: NDArray[np.unsignedinteger]) -> Overlay | None:
    if step is None or step.changed == 0:
        return None
    values = flat[step.indices] + step.delta  # wraps mod 2**bits, as apply does
    return step.indices, values


def resolve(
    changes: CodedChanges,
    dtype: str,
    base: NDArray[np.unsignedinteger] | None,
    pending: TensorDelta | None = None,
) -> NDArray[np.int64]:
    """The indices of an entry's changes, in the (class-major) order of ``changes``."""
    e = changes.entry
    if not needs_base(e):
        return changes.ranks + e.start
    if base is None:
        raise ContextUnavailable(f"{changes.what}: needs its base to decode")
    overlay = _overlay(pending, base)
    return select_ranks(base, dtype, changes.window, e.start, e.stop, changes.classes, changes.ranks, overlay=overlay)


#: Resolves one entry's changes against bits held somewhere (a target's): its indices in
#: the order of ``changes`` (:func:`resolve`'s result), read through the earlier changes
#: not yet applied to those bits (a fold), where given.
ResolveEntry = Callable[[CodedChanges, "TensorDelta | None"], NDArray[np.int64]]


def resolve_transition(
    changes: Sequence[CodedChanges],
    tensors: Mapping[str, TensorInfo],
    fingerprints: Mapping[str, int],
    resolve_entry: ResolveEntry,
    *,
    pending: Patch | None = None,
    holder: str = "the target",
) -> Patch:
    """The patch of one context-coded transition resolved by a holder of its base bits
    (``WeightTarget.resolve_context``): ``fingerprints`` is the holder's verified record
    of the bits it holds, which must be the base of every entry that reads it (through
    ``pending``, earlier changes not applied yet, where a tensor has some): ``WrongBase``
    before ``resolve_entry`` reads anything. Reads only."""
    steps: Mapping[str, TensorDelta] = pending.tensors if pending is not None else {}
    strays = [ch.what for ch in changes if ch.entry.tensor not in tensors]
    if strays:
        raise InvalidInput(f"{strays[0]}: an entry of a tensor the transition does not describe")
    wrong: list[str] = []
    for name in sorted({ch.entry.tensor for ch in changes if needs_base(ch.entry)}):
        want = tensors[name].base_fingerprint
        step = steps.get(name)
        if step is not None:
            if step.target_fingerprint != want:
                wrong.append(name)
                continue
            want = step.base_fingerprint
        if fingerprints.get(name) != want:
            wrong.append(name)
    if wrong:
        held = fingerprints.get(wrong[0])
        raise WrongBase(
            f"{wrong[0]}: the patch was coded against base {format_fingerprint(tensors[wrong[0]].base_fingerprint)}, "
            f"{holder} holds {'nothing known' if held is None else format_fingerprint(held)}"
            + (f"; {len(wrong)} tensors differ" if len(wrong) > 1 else "")
        )
    found: dict[str, list[tuple[int, NDArray[np.int64], NDArray[np.unsignedinteger]]]] = {name: [] for name in tensors}
    for ch in changes:
        if ch.entry.count == 0:
            continue
        indices = resolve_entry(ch, steps.get(ch.entry.tensor))
        order = np.argsort(indices, kind="stable")
        found[ch.entry.tensor].append((ch.entry.start, indices[order], ch.delta[order]))
    out: dict[str, TensorDelta] = {}
    for name, info in tensors.items():
        parts = sorted(found[name], key=lambda part: part[0])
        n = sum(part[1].size for part in parts)
        if n != info.changed:
            raise FormatError(f"{name}: entries hold {n} changes, the tensor says {info.changed}")
        indices = np.concatenate([p[1] for p in parts]) if parts else np.empty(0, np.int64)
        delta = np.concatenate([p[2] for p in parts]) if parts else np.empty(0, info.spec.bits_dtype)
        out[name] = TensorDelta(info.spec, indices, delta, info.base_fingerprint, info.target_fingerprint)
    return Patch(out)
