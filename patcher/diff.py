"""Bit-level diff of two versions of a set of tensors.

Two forms with the same results: the compiled one (patcher.native) compares 64-byte
blocks and handles only the blocks that differ, fingerprinting the changes as it finds
them; the NumPy one compares fixed-size chunks into one reused mask buffer. Either way
the only allocations that grow with the tensor are the outputs, which grow with the
number of *changed* elements (a few per mille of a one-step transition).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final, cast

import numpy as np
from numpy.typing import NDArray

from patcher import native
from patcher.cast import cast_bits, cast_kind
from patcher.dtypes import bits_dtype
from patcher.errors import IncompatibleTensors, InvalidInput
from patcher.fingerprint import fingerprint
from patcher.fingerprint_update import fingerprint_change
from patcher.patch import Patch, TensorDelta, TensorSpec, check_names

__all__ = [
    "CAST_CHUNK",
    "CHUNK_WORDS",
    "Changes",
    "cast_changes",
    "checked_bits_view",
    "checked_pairs",
    "diff",
    "diff_bits",
    "diff_cast_bits",
    "native_scan",
    "tensor_changes",
]

#: 64-bit words compared per step (1 Mi BF16 elements): the mask (256 KiB) and both
#: input chunks stay in L2. Measured fastest among 64 Ki .. 1 Mi words.
CHUNK_WORDS: Final = 1 << 18

_MASK64: Final = (1 << 64) - 1
_I64: Final = np.dtype(np.int64)
#: Outputs of the compiled diff are first sized for this share of the elements (1/128:
#: a one-step transition changes a few per mille, 4 in the benchmarks, which 1/256 missed,
#: costing a second scan call and a copy per tensor), then grown from the density seen.
_FIRST_CAPACITY_SHIFT: Final = 7
#: The smallest first guess: a second call costs more than this much spare room.
_MIN_CAPACITY: Final = 1 << 12
#: Elements cast_changes' NumPy path casts at a time: its buffer (2 MiB of BF16) stays in the
#: CPU's cache between the cast that writes it and the diff that reads it.
CAST_CHUNK: Final = 1 << 20


def checked_bits_view(array: object, spec: TensorSpec, role: str) -> NDArray[np.unsignedinteger]:
    """A view of NumPy ``array`` as the spec's bits dtype, checked against ``spec``.

    What it adds to a plain bits view (``bulletin_kernels.as_bits``, the one zero-copy view of
    any tensor): the element width and shape must be the spec's (``IncompatibleTensors``),
    and the dtype must hold plain native-order bits in C order (``InvalidInput``);
    ``role`` names the array in the messages.
    """
    if not isinstance(array, np.ndarray):
        raise InvalidInput(f"{spec.name} ({role}): expected a NumPy array, got {type(array)}")
    dt = array.dtype
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None or not dt.isnative:
        raise InvalidInput(f"{spec.name} ({role}): dtype {dt} does not hold plain native-order bits")
    if dt.itemsize != spec.width:
        raise IncompatibleTensors(
            f"{spec.name} ({role}): {dt} has {dt.itemsize}-byte elements, {spec.dtype} needs {spec.width}"
        )
    if array.shape != spec.shape:
        raise IncompatibleTensors(f"{spec.name} ({role}): shape {list(array.shape)}, expected {list(spec.shape)}")
    if not array.flags.c_contiguous:
        raise InvalidInput(f"{spec.name} ({role}): array must be C-contiguous")
    return array.view(spec.bits_dtype)


def _check_pair(old: NDArray[np.unsignedinteger], new: NDArray[np.unsignedinteger]) -> None:
    for role, a in (("old", old), ("new", new)):
        # Typed callers cannot get this wrong; untyped ones can.
        if not isinstance(a, np.ndarray) or a.dtype.kind != "u" or not a.dtype.isnative:
            raise InvalidInput(f"diff_bits: {role} must be an unsigned native-order NumPy array")
        if not a.flags.c_contiguous:
            raise InvalidInput(f"diff_bits: {role} must be C-contiguous")
    if old.dtype != new.dtype or old.shape != new.shape:
        raise IncompatibleTensors(f"diff_bits: {old.dtype}{list(old.shape)} vs {new.dtype}{list(new.shape)}")


#: A diff's changes: flat indices, the old bits there, and the wrapping deltas.
Changes = tuple[NDArray[np.int64], NDArray[np.unsignedinteger], NDArray[np.unsignedinteger]]


def _changes_in(a: NDArray[np.unsignedinteger], b: NDArray[np.unsignedinteger], base: int) -> Changes | None:
    """Changes between two short flat arrays, indices offset by ``base``."""
    local = np.flatnonzero(a != b)
    if local.size == 0:
        return None
    was = a[local]
    delta = b[local]
    delta -= was
    local += base
    return local, was, delta


def _concat(parts: Sequence[tuple[NDArray[Any], ...]], dtypes: Sequence[np.dtype[Any]]) -> tuple[NDArray[Any], ...]:
    if not parts:
        return tuple(np.empty(0, dtype=dt) for dt in dtypes)
    if len(parts) == 1:
        return parts[0]
    return tuple(np.concatenate([p[k] for p in parts]) for k in range(len(dtypes)))


def _changes_range(a: NDArray[np.unsignedinteger], b: NDArray[np.unsignedinteger], start: int, stop: int) -> Changes:
    """Changes of flat ``a`` -> ``b`` within ``[start, stop)``; ``start`` is word-aligned.

    Compares 64-bit words (several elements each): the mask and its scan shrink by the
    number of elements per word, and only changed words are split into elements.
    """
    dtype = a.dtype
    lanes = 8 // dtype.itemsize
    shift = lanes.bit_length() - 1  # lanes is 1, 2, 4 or 8
    body = stop - (stop - start) % lanes
    parts: list[Changes] = []
    if body > start:
        aw, bw = a[start:body].view(np.uint64), b[start:body].view(np.uint64)
        mask = np.empty(min(aw.size, CHUNK_WORDS), dtype=np.bool_)
        for lo in range(0, aw.size, CHUNK_WORDS):
            hi = min(lo + CHUNK_WORDS, aw.size)
            m, ac, bc = mask[: hi - lo], aw[lo:hi], bw[lo:hi]
            np.not_equal(ac, bc, out=m)
            words = np.flatnonzero(m)
            if words.size == 0:
                continue
            # The changed words, seen again as elements (same memory, so the same order).
            found = _changes_in(ac[words].view(dtype), bc[words].view(dtype), 0)
            if found is None:  # pragma: no cover - a changed word has a changed element
                continue
            lane, was, delta = found
            words += lo
            index = words[lane >> shift]
            index <<= shift
            index += lane & (lanes - 1)
            index += start
            parts.append((index, was, delta))
    if body < stop:
        tail = _changes_in(a[body:stop], b[body:stop], body)
        if tail is not None:
            parts.append(tail)
    return cast(Changes, _concat(parts, (_I64, dtype, dtype)))


def _trimmed(array: NDArray[Any], count: int) -> NDArray[Any]:
    # A slice keeps its whole buffer alive: copy when most of it would be wasted.
    return array[:count] if 2 * count >= array.size else array[:count].copy()


#: A compiled scan: from element ``pos``, fills the outputs with changes until the end or
#: until they are full; returns (changes written, where it stopped, fingerprint change).
NativeScan = Callable[[int, tuple[NDArray[Any], ...]], tuple[int, int, int]]


def native_scan(
    n: int, dtypes: Sequence[np.dtype[Any]], scan: NativeScan, keep: Sequence[int] | None = None
) -> tuple[tuple[NDArray[Any], ...], int]:
    """Drive ``scan`` over ``n`` elements with outputs of ``dtypes``, sized from the
    density seen so far: every output's (or those at the places ``keep`` names) changes
    in order, and the fingerprint change."""
    kept = range(len(dtypes)) if keep is None else keep
    parts: list[tuple[NDArray[Any], ...]] = []
    pos, found, fp = 0, 0, 0
    capacity = max(_MIN_CAPACITY, n >> _FIRST_CAPACITY_SHIFT)
    while True:
        # Never more than what is left, never less than one block (64 elements).
        capacity = max(64, min(capacity, n - pos))
        outputs = tuple(np.empty(capacity, dtype=dt) for dt in dtypes)
        count, pos, change = scan(pos, outputs)
        fp += change
        found += count
        if count:
            parts.append(tuple(_trimmed(outputs[k], count) for k in kept))
        if pos >= n:
            break
        # The outputs filled up: size the next ones for the density seen so far.
        capacity = max(_MIN_CAPACITY, int(found / pos * (n - pos) * 1.1))
    return _concat(parts, [dtypes[k] for k in kept]), fp & _MASK64


def _native_changes(a: NDArray[np.unsignedinteger], b: NDArray[np.unsignedinteger], first: int) -> tuple[Changes, int]:
    """The compiled diff of flat ``a`` -> ``b``, and its fingerprint change."""
    width = a.dtype.itemsize
    found, fp = native_scan(
        int(a.size),
        (_I64, a.dtype, a.dtype),
        lambda pos, out: native.speedups.diff(a, b, width, pos, out[0], out[1], out[2], first),
    )
    return cast(Changes, found), fp


def _fingerprinted(found: Changes, first: int) -> tuple[Changes, int]:
    indices, was, delta = found
    at = indices + first if first else indices
    return found, fingerprint_change(at, was, was + delta)  # deltas wrap, as the bits do


def tensor_changes(
    old: NDArray[np.unsignedinteger], new: NDArray[np.unsignedinteger], *, fingerprinted: bool = True, first: int = 0
) -> tuple[Changes, int]:
    """Changed flat indices, old bits there, and wrapping deltas, with the fingerprint
    change (0 unless ``fingerprinted``), each index hashed as ``first`` + itself (a block
    that is one run of its tensor, from flat index ``first``); inputs already checked."""
    a, b = old.reshape(-1), new.reshape(-1)
    if native.active():
        return _native_changes(a, b, first)
    found = _changes_range(a, b, 0, a.size)
    return _fingerprinted(found, first) if fingerprinted else (found, 0)


def cast_changes(
    old: NDArray[np.unsignedinteger],
    src: NDArray[np.unsignedinteger],
    source: str,
    served: str,
    *,
    first: int = 0,
    chunk: int = CAST_CHUNK,
) -> tuple[Changes, int]:
    """``tensor_changes(old, cast_bits(src, source, served), first=first)`` without the
    cast's whole copy: the source is cast a chunk at a time into a buffer that stays in
    the CPU's cache and each chunk diffed there, in one read of each input and no
    full-size write (the copy, its page faults and its reading back were most of a patch
    step's time with F32 masters: docs/SHARDED.md). The compiled path casts and diffs in
    one loop (``chunk`` is the NumPy path's)."""
    if not isinstance(src, np.ndarray) or not src.flags.c_contiguous:
        raise InvalidInput("a diff that casts needs a C-contiguous source")
    if not isinstance(old, np.ndarray) or not old.flags.c_contiguous or old.dtype.kind != "u":
        raise InvalidInput("a diff that casts needs C-contiguous unsigned old bits")
    a, b = old.reshape(-1), src.reshape(-1)
    if a.size != b.size:
        raise IncompatibleTensors(f"old has {a.size} elements, the source {b.size}")
    if not isinstance(chunk, int) or chunk < 64:
        raise InvalidInput("chunk must be an int >= 64")
    kind = cast_kind(source, served)
    if b.dtype != bits_dtype(source) or a.dtype != bits_dtype(served):
        raise InvalidInput(
            f"a diff that casts {source} to {served} needs {bits_dtype(source)} and {bits_dtype(served)} bits"
        )
    if kind == "identity":
        return tensor_changes(a, b, first=first)
    if native.active():
        code = 0 if kind == "f32_bf16" else 1
        found, fp = native_scan(
            int(a.size),
            (_I64, a.dtype, a.dtype),
            lambda pos, out: native.speedups.cast_diff(a, b, code, pos, first, out[0], out[1], out[2]),
        )
        return cast(Changes, found), fp
    buffer = np.empty(min(chunk, a.size), dtype=a.dtype)
    parts: list[tuple[NDArray[Any], ...]] = []
    for start in range(0, a.size, chunk):
        stop = min(start + chunk, a.size)
        part = cast_bits(b[start:stop], source, served, out=buffer[: stop - start])
        found = _changes_range(a[start:stop], part, 0, stop - start)
        if found[0].size:
            parts.append((found[0] + start, found[1], found[2]))
    return _fingerprinted(cast(Changes, _concat(parts, (_I64, a.dtype, a.dtype))), first)


def diff_bits(
    old: NDArray[np.unsignedinteger], new: NDArray[np.unsignedinteger]
) -> tuple[NDArray[np.int64], NDArray[np.unsignedinteger]]:
    """Sorted flat indices where ``old`` and ``new`` differ, and ``(new - old) mod 2**bits``.

    Both arrays must have the same unsigned dtype and shape and be C-contiguous; they
    are compared in chunks of :data:`CHUNK_WORDS` 64-bit words without full-size
    temporaries.
    """
    _check_pair(old, new)
    (indices, _, delta), _ = tensor_changes(old, new, fingerprinted=False)
    return indices, delta


def diff_cast_bits(
    old: NDArray[np.unsignedinteger],
    src: NDArray[np.unsignedinteger],
    source: str,
    served: str,
    *,
    chunk: int = CAST_CHUNK,
) -> tuple[NDArray[np.int64], NDArray[np.unsignedinteger]]:
    """``diff_bits(old, cast_bits(src, source, served))``, without the cast's whole copy:
    :func:`cast_changes`' indices and deltas."""
    (indices, _, delta), _ = cast_changes(old, src, source, served, chunk=chunk)
    return indices, delta


def _check_fingerprints(specs: Mapping[str, TensorSpec], base_fingerprints: Mapping[str, int]) -> None:
    check_names(specs, base_fingerprints, "base fingerprints do not match the tensors")
    for name, fp in base_fingerprints.items():
        if not isinstance(fp, int) or isinstance(fp, bool) or not 0 <= fp < 1 << 64:
            raise InvalidInput(f"{name}: base fingerprint must be an int in [0, 2**64)")


def diff(
    specs: Mapping[str, TensorSpec],
    old: Mapping[str, NDArray[Any]],
    new: Mapping[str, NDArray[Any]],
    *,
    base_fingerprints: Mapping[str, int] | None = None,
) -> Patch:
    """The patch that turns ``old`` into ``new``, for every tensor of ``specs``.

    Arrays may have any dtype of the spec's width (they are compared as bits) and must
    have the spec's shape and be C-contiguous. Unchanged tensors get empty deltas.
    Target fingerprints are computed in O(changed) from the base ones; pass
    ``base_fingerprints`` (the fingerprints of ``old``, which the publisher already
    holds) to skip hashing every base tensor in full. They are trusted: a wrong base
    fingerprint yields a patch that no holder of ``old`` will accept.
    """
    out: dict[str, TensorDelta] = {}
    for name, a, b, base in checked_pairs(specs, old, new, base_fingerprints):
        (indices, _, delta), change = tensor_changes(a, b)
        out[name] = TensorDelta(specs[name], indices, delta, base, (base + change) & _MASK64)
    return Patch(out)


def checked_pairs(
    specs: Mapping[str, TensorSpec],
    old: Mapping[str, NDArray[Any]],
    new: Mapping[str, NDArray[Any]],
    base_fingerprints: Mapping[str, int] | None,
) -> Iterator[tuple[str, NDArray[np.unsignedinteger], NDArray[np.unsignedinteger], int]]:
    """:func:`diff`'s inputs, every one checked before the first is given: in name order,
    each tensor's name, old and new bits views, and base fingerprint (hashed here when
    ``base_fingerprints`` is None)."""
    for name, spec in specs.items():
        if not isinstance(spec, TensorSpec) or spec.name != name:
            raise InvalidInput(f"specs[{name!r}] must be the TensorSpec named {name!r}")
    for role, tensors in (("old", old), ("new", new)):
        check_names(specs, tensors, f"{role} tensors")
    if base_fingerprints is not None:
        _check_fingerprints(specs, base_fingerprints)
    # Validate every array before the expensive work so bad input fails fast.
    pairs = {
        name: (checked_bits_view(old[name], spec, "old"), checked_bits_view(new[name], spec, "new"))
        for name, spec in specs.items()
    }
    for name in sorted(specs):
        a, b = pairs[name]
        yield name, a, b, fingerprint(a) if base_fingerprints is None else base_fingerprints[name]
