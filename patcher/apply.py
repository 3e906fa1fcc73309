"""Apply a patch in place to NumPy arrays (the CPU twin of the GPU scatter kernel).

Order of an apply: check every layout, every patch and every base fingerprint before a
single byte changes; then gather the old bits at the changed indices, scatter ``old +
delta`` and update the fingerprint from the old and new bits in O(changed), in slices
spread over threads (the compiled fast path, patcher.native, does a slice in one pass
and prefetches ahead; NumPy does it in cache-sized blocks). If any result disagrees
with the patch's target, every overwritten element of every tensor is put back and
``VerificationFailed`` raised, so a failed apply leaves the holder exactly as it was.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import numpy as np
from numpy.typing import NDArray

from patcher import native
from patcher.errors import IncompatibleTensors, InvalidInput, VerificationFailed, WrongBase
from patcher.fingerprint import format_fingerprint
from patcher.fingerprint_update import fingerprint_change
from patcher.patch import Patch, TensorDelta, TensorSpec, check_names

__all__ = [
    "BLOCK",
    "PARALLEL_MIN",
    "PIECE",
    "apply",
    "check_bases",
    "check_targets",
    "check_threads",
    "default_threads",
    "put_bits",
    "run_parallel",
    "verification_failed",
]

_MASK64 = (1 << 64) - 1
_T = TypeVar("_T")
_R = TypeVar("_R")


def _flat_target(bits: object, spec: TensorSpec) -> NDArray[np.unsignedinteger]:
    """A writable flat view of ``bits`` as the tensor's bits dtype, or ``InvalidInput``."""
    name = spec.name
    if not isinstance(bits, np.ndarray):
        raise InvalidInput(f"{name}: expected a NumPy array, got {type(bits)}")
    dt = bits.dtype
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None:
        raise InvalidInput(f"{name}: dtype {dt} does not hold plain bits")
    if dt.itemsize != spec.width:
        raise IncompatibleTensors(f"{name}: array has {dt.itemsize}-byte elements, {spec.dtype} needs {spec.width}")
    if bits.size != spec.numel:
        raise IncompatibleTensors(f"{name}: array has {bits.size} elements, patch {spec.numel}")
    if not bits.flags.c_contiguous or not bits.flags.writeable:
        raise InvalidInput(f"{name}: array must be C-contiguous and writable")
    return bits.view(spec.bits_dtype).reshape(-1)


def check_targets(
    specs: Mapping[str, TensorSpec], tensors: Mapping[str, NDArray[Any]]
) -> dict[str, NDArray[np.unsignedinteger]]:
    """Writable flat bits views of ``tensors``, which must be exactly the tensors of ``specs``
    (``IncompatibleTensors`` / ``InvalidInput`` otherwise)."""
    check_names(specs, tensors, "tensor sets differ")
    targets: dict[str, NDArray[np.unsignedinteger]] = {}
    for name, spec in specs.items():
        array = tensors[name]
        if isinstance(array, np.ndarray) and array.shape != spec.shape:
            raise IncompatibleTensors(f"{name}: array shape {list(array.shape)}, patch has {list(spec.shape)}")
        targets[name] = _flat_target(array, spec)
    return targets


def check_bases(bases: Mapping[str, int], fingerprints: Mapping[str, int]) -> None:
    """``WrongBase`` unless the holder's ``fingerprints`` are the patch's ``bases``."""
    wrong = sorted(name for name, base in bases.items() if fingerprints.get(name) != base)
    if wrong:
        name = wrong[0]
        have = fingerprints.get(name)
        shown = "none" if not isinstance(have, int) else format_fingerprint(have & _MASK64)
        raise WrongBase(
            f"patch does not apply to these tensors: {name} is {shown}, patch expects "
            f"{format_fingerprint(bases[name])}" + (f" ({len(wrong)} tensors differ)" if len(wrong) > 1 else "")
        )


def check_threads(threads: int | None) -> int:
    """The thread count to use: ``threads``, or :func:`default_threads` for None."""
    if threads is None:
        return default_threads()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise InvalidInput(f"threads must be a positive int, got {threads!r}")
    return threads


def verification_failed(wrong: list[str], got: Mapping[str, int], targets: Mapping[str, int]) -> VerificationFailed:
    """The error for tensors (sorted) whose results missed their targets, all changes undone."""
    name = wrong[0]
    return VerificationFailed(
        f"{name}: bits after apply fingerprint to {format_fingerprint(got[name])}, patch "
        f"promises {format_fingerprint(targets[name])}; nothing was changed"
        + (f" ({len(wrong)} tensors fail)" if len(wrong) > 1 else "")
    )


#: Changed elements applied per NumPy step: the cache lines a block's gather pulls in
#: are still cached when its scatter writes them back (measured 1.6x over one big pass).
BLOCK: Final = 1 << 14
#: Changed elements per unit of parallel work.
PIECE: Final = 1 << 16
#: The fewest changes worth a thread pool: below, starting threads costs more than
#: they save (measured: a 85 K-change patch applies faster on one thread).
PARALLEL_MIN: Final = 1 << 18


def default_threads() -> int:
    """Threads an apply uses by default: the CPUs this process may run on, at most 8.

    The scatter is bound by memory latency, not compute: each thread keeps its own
    misses in flight, so threads help up to about the memory system's parallelism.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


def _scatter(
    flat: NDArray[np.unsignedinteger], td: TensorDelta, lo: int, hi: int, old: NDArray[np.unsignedinteger]
) -> tuple[int, int]:
    """Apply changes ``lo:hi`` of ``td`` to ``flat``, saving the overwritten bits in
    ``old[lo:hi]``; returns how many were applied (all, unless an index was bad) and
    their fingerprint change."""
    idx, delta, was = td.indices[lo:hi], td.delta[lo:hi], old[lo:hi]
    if native.active():
        # It checks each change as it applies it; the first must follow the last before it.
        after = int(td.indices[lo - 1]) if lo else -1
        return native.speedups.scatter_add(flat, flat.dtype.itemsize, idx, delta, was, after)
    change = 0
    for a in range(0, hi - lo, BLOCK):
        b = min(a + BLOCK, hi - lo)
        np.take(flat, idx[a:b], out=was[a:b])
        now = was[a:b] + delta[a:b]  # wraps mod 2**bits: the inverse of diff's subtraction
        np.put(flat, idx[a:b], now)
        change += fingerprint_change(idx[a:b], was[a:b], now)
    return hi - lo, change


def put_bits(
    flat: NDArray[np.unsignedinteger], indices: NDArray[np.int64], values: NDArray[np.unsignedinteger]
) -> None:
    """``flat[indices] = values`` (compiled where built), for indices known to be in range
    (a diff of ``flat`` found them, or a scatter into it applied them)."""
    if native.active():
        native.speedups.scatter(flat, flat.dtype.itemsize, indices, values)
    else:
        np.put(flat, indices, values)


@dataclass(frozen=True, slots=True)
class _Piece:
    name: str
    lo: int
    hi: int


def run_parallel(work: Callable[[_T], _R], items: Sequence[_T], threads: int, changes: int) -> list[_R]:
    """``[work(item) for item in items]``, on up to ``threads`` threads when the items hold
    enough ``changes`` to be worth it. The items must write disjoint elements."""
    if threads <= 1 or len(items) <= 1 or changes < PARALLEL_MIN:
        return [work(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(threads, len(items)), thread_name_prefix="bulletin-apply") as pool:
        return list(pool.map(work, items))


def apply(
    patch: Patch,
    tensors: MutableMapping[str, NDArray[Any]],
    fingerprints: Mapping[str, int],
    *,
    threads: int | None = None,
) -> dict[str, int]:
    """Apply ``patch`` in place to ``tensors``; returns the new fingerprint of every tensor.

    ``fingerprints`` are the holder's known fingerprints of ``tensors``. Before anything
    changes: the tensor sets and shapes must match the patch (``IncompatibleTensors``),
    the patch must be well formed (``InvalidInput``) and every base fingerprint must
    equal the holder's (``WrongBase``). If a tensor's result then misses its target
    (the holder's bits were not what its fingerprint claimed), all changes are undone
    and ``VerificationFailed`` raised.

    Large patches are applied by ``threads`` threads (default :func:`default_threads`),
    each on its own slices of changes: the elements they write are disjoint.
    """
    if not isinstance(patch, Patch):
        raise InvalidInput(f"expected a Patch, got {type(patch)}")
    workers = check_threads(threads)
    targets = check_targets(patch.specs, tensors)
    for td in patch:
        if native.active():
            td.validate_layout()  # the compiled scatter checks each change as it goes
        else:
            td.validate()
    check_bases({name: td.base_fingerprint for name, td in patch.tensors.items()}, fingerprints)
    saved = {name: np.empty(td.changed, dtype=targets[name].dtype) for name, td in patch.tensors.items()}
    pieces = [
        _Piece(name, lo, min(lo + PIECE, td.changed))
        for name, td in patch.tensors.items()
        for lo in range(0, td.changed, PIECE)
    ]

    def work(p: _Piece) -> tuple[int, int]:
        return _scatter(targets[p.name], patch.tensors[p.name], p.lo, p.hi, saved[p.name])

    # Pieces write disjoint elements (indices are strictly increasing), so they need no lock.
    outcomes = run_parallel(work, pieces, workers, patch.changed_elements)
    change = dict.fromkeys(patch.tensors, 0)
    broken = False
    for p, (done, fp) in zip(pieces, outcomes, strict=True):
        change[p.name] += fp
        broken = broken or done != p.hi - p.lo
    result = {name: (td.base_fingerprint + change[name]) & _MASK64 for name, td in patch.tensors.items()}
    wrong = sorted(name for name, td in patch.tensors.items() if result[name] != td.target_fingerprint)
    if broken or wrong:
        # Put back every element overwritten, in every tensor: the holder is as it was.
        for p, (done, _) in zip(pieces, outcomes, strict=True):
            idx = patch.tensors[p.name].indices[p.lo : p.lo + done]
            put_bits(targets[p.name], idx, saved[p.name][p.lo : p.lo + done])
        if broken:
            bad = sorted({p.name for p, (done, _) in zip(pieces, outcomes, strict=True) if done != p.hi - p.lo})
            for name in bad:
                patch.tensors[name].validate()  # says what is wrong, in its words
            raise InvalidInput(f"{bad[0]}: a change is out of range, out of order or zero")  # pragma: no cover
        raise verification_failed(wrong, result, {name: td.target_fingerprint for name, td in patch.tensors.items()})
    return result
