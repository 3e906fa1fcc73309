"""Apply a patch straight from its shards: decode and scatter in one pass (CPU).

:func:`patcher.apply.apply` takes a decoded :class:`~patcher.patch.Patch`, whose int64
indices and deltas (about 10 bytes per change) are written out and read back. Here the
compiled fast path (patcher.native) decodes each entry's streams a few hundred changes
at a time into a buffer that stays in L1, and scatters them with prefetching: nothing
the size of the patch is materialised, and entries run in parallel. Results, checks
and errors are those of ``apply(decode(shards), ...)``, which is also what runs
without the compiled path.

Order, as decode then apply: every shard header is read and the set checked (one
patch, exact coverage), every payload checksummed and decompressed, then the targets
and base fingerprints checked, all before a byte changes. A stream found invalid while
applying, or a result that misses its target fingerprint, gets every change undone
(each delta subtracted again, re-decoded from the same streams) before the error.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from patcher import native
from patcher.apply import apply, check_bases, check_targets, check_threads, run_parallel, verification_failed
from patcher.context_apply import ContextTask, apply_changes, refuse, undo_changes
from patcher.context_decode import decode_changes
from patcher.decode import EntryStreams, decode_views, entry_streams, shard_views
from patcher.errors import FormatError
from patcher.format import DEFAULT_LIMITS, DecodeLimits
from patcher.patch import TensorSpec, check_layout
from patcher.streams import decode_deltas_numpy, decode_gaps_numpy, join_planes

__all__ = ["apply_shards"]

_MASK64 = (1 << 64) - 1


def _run(es: EntryStreams, target: NDArray[np.unsignedinteger], subtract: bool, limit: int) -> tuple[int, int, bool]:
    e = es.info
    return native.speedups.apply_entry(
        target, es.spec.width,
        es.low, es.gap_codes, join_planes(es.gap_escapes), e.gap_escape_width, e.gap_escapes,
        es.delta_codes, join_planes(es.delta_escapes), e.delta_escape_width, e.delta_escapes,
        e.count, e.start, e.stop, subtract, limit,
    )  # fmt: skip


def _refuse(es: EntryStreams) -> FormatError:
    """The NumPy decoders' own error for an entry the compiled loop found invalid."""
    e = es.info
    decode_gaps_numpy(es.low, es.gap_codes, es.gap_escapes, e.count, e.gap_escapes, e.start, e.stop, es.what)
    decode_deltas_numpy(es.delta_codes, es.delta_escapes, e.count, e.delta_escapes, es.spec.bits_dtype, es.what)
    return FormatError(f"{es.what}: streams do not decode")  # pragma: no cover - both decoders agree


def apply_shards(
    shards: Sequence[bytes | bytearray | memoryview],
    tensors: MutableMapping[str, NDArray[Any]],
    fingerprints: Mapping[str, int],
    *,
    limits: DecodeLimits = DEFAULT_LIMITS,
    threads: int | None = None,
    specs: Mapping[str, TensorSpec] | None = None,
) -> dict[str, int]:
    """``apply(decode(shards, limits=limits), tensors, fingerprints, threads=threads)``
    without materialising the patch; returns the new fingerprint of every tensor.

    ``specs``, if given, is the holder's layout (names, dtypes, shapes), which the
    patch's must equal (``IncompatibleTensors``): arrays alone show only widths.
    Context-coded shards (docs/FORMAT.md 3.15) take ``tensors`` as their base, proven by
    ``fingerprints`` (the holder's record of them) before anything is decoded.

    Raises what decode and apply raise, before any change for everything but a stream
    that turns out invalid mid-entry, whose changes (and every other) are undone first.
    """
    workers = check_threads(threads)
    if not native.active():
        views, headers, infos = shard_views(shards, limits)
        if specs is not None:
            check_layout({name: info.spec for name, info in infos.items()}, specs)
        check_targets({name: info.spec for name, info in infos.items()}, tensors)
        check_bases({name: info.base_fingerprint for name, info in infos.items()}, fingerprints)
        patch = decode_views(views, headers, infos, base=tensors, base_fingerprints=fingerprints)
        return apply(patch, tensors, fingerprints, threads=workers)
    views, headers, infos = shard_views(shards, limits)
    if specs is not None:
        check_layout({name: info.spec for name, info in infos.items()}, specs)
    targets = check_targets({name: info.spec for name, info in infos.items()}, tensors)
    check_bases({name: info.base_fingerprint for name, info in infos.items()}, fingerprints)
    tasks: list[EntryStreams | ContextTask] = []
    for view, h in zip(views, headers, strict=True):
        if h.codec == "context":
            dtypes = {name: info.spec.dtype for name, info in h.tensors.items()}
            tasks += [ContextTask(ch, dtypes[ch.entry.tensor]) for ch in decode_changes(view, h) if ch.entry.count]
        else:
            tasks += [es for es in entry_streams(view, h) if es.info.count]

    def tensor_of(task: EntryStreams | ContextTask) -> str:
        return task.info.tensor if isinstance(task, EntryStreams) else task.changes.entry.tensor

    def run(task: EntryStreams | ContextTask) -> tuple[int, int, bool]:
        target = targets[tensor_of(task)]
        if isinstance(task, ContextTask):
            return apply_changes(task, target)
        return _run(task, target, False, task.info.count)

    # Entries cover disjoint element ranges, so they run in parallel without a lock.
    outcomes = run_parallel(run, tasks, workers, sum(info.changed for info in infos.values()))
    change = dict.fromkeys(infos, 0)
    for task, (_, fp, _) in zip(tasks, outcomes, strict=True):
        change[tensor_of(task)] += fp
    result = {name: (info.base_fingerprint + change[name]) & _MASK64 for name, info in infos.items()}
    refused = [task for task, (_, _, ok) in zip(tasks, outcomes, strict=True) if not ok]
    wrong = sorted(name for name, info in infos.items() if result[name] != info.target_fingerprint)
    if refused or wrong:
        for task, (done, _, _) in zip(tasks, outcomes, strict=True):
            if isinstance(task, ContextTask):
                undo_changes(task, targets[tensor_of(task)])
            elif done:
                _run(task, targets[task.info.tensor], True, done)
        if refused:
            first = refused[0]
            if isinstance(first, ContextTask):
                raise refuse(first, targets[tensor_of(first)])
            raise _refuse(first)
        raise verification_failed(wrong, result, {name: info.target_fingerprint for name, info in infos.items()})
    return result
