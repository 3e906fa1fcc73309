"""Parallel bulk reads and create-only writes over any :class:`Store`.

Shards are uploaded and downloaded many at a time: one object per request, a
bounded pool of threads, as many requests in flight as workers. The first error
cancels what has not started yet and is raised once the running requests end;
progress callbacks run on the calling thread, so they need no locking.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Final, TypeVar

from bulletin.errors import InvalidInput
from bulletin.storage.base import Store, WriteResult
from bulletin.storage.keys import check_data, check_key, check_max_bytes

__all__ = ["DEFAULT_WORKERS", "get_many", "put_many_if_absent"]

#: Requests in flight by default; S3 stores size their connection pools to match.
DEFAULT_WORKERS: Final = 8

_T = TypeVar("_T")


def _check_workers(max_workers: object) -> int:
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        raise InvalidInput(f"max_workers must be a positive int, got {max_workers!r}")
    return max_workers


def _run(
    tasks: Iterable[tuple[str, Callable[[], _T]]],
    max_workers: int,
    on_done: Callable[[str, _T], None],
) -> None:
    """Run ``tasks`` on a bounded pool; ``on_done`` on this thread as each one ends."""
    with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="bulletin-io") as pool:
        pending: dict[Future[_T], str] = {pool.submit(fn): key for key, fn in tasks}
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_EXCEPTION)
                for future in done:
                    key = pending.pop(future)
                    on_done(key, future.result())  # raises the task's own exception
        finally:
            for future in pending:
                future.cancel()


def get_many(
    store: Store,
    keys: Sequence[str],
    *,
    max_workers: int = DEFAULT_WORKERS,
    on_bytes: Callable[[int], None] | None = None,
    max_bytes: int | Mapping[str, int] | None = None,
) -> dict[str, bytes]:
    """Read every key in parallel: ``{key: bytes}``.

    Duplicate keys are read once. ``max_bytes`` bounds each read (one bound for all,
    or one per key: every key then needs one), so an object larger than its bound is
    ``ObjectTooLarge`` without being read. The first error (``NotFound`` for a missing
    key, ``ObjectTooLarge``, ``StorageUnavailable``, ...) is raised after in-flight reads
    end; reads not yet started are cancelled. ``on_bytes(n)`` is called on this thread
    after each read.
    """
    workers = _check_workers(max_workers)
    if isinstance(keys, str):  # a str is a Sequence[str] of characters: surely a mistake
        raise InvalidInput("keys must be a sequence of keys, not a single str")
    unique = list(dict.fromkeys(check_key(k) for k in keys))
    bounds = _bounds(unique, max_bytes)
    if not unique:
        return {}
    result: dict[str, bytes] = {}

    def done(key: str, data: bytes) -> None:
        result[key] = data
        if on_bytes is not None:
            on_bytes(len(data))

    def reader(key: str) -> Callable[[], bytes]:
        bound = bounds[key]
        if bound is None:
            return lambda: store.get(key).data
        return lambda: store.get(key, max_bytes=bound).data

    _run(((k, reader(k)) for k in unique), min(workers, len(unique)), done)
    return {k: result[k] for k in unique}


def _bounds(keys: Sequence[str], max_bytes: int | Mapping[str, int] | None) -> dict[str, int | None]:
    """Each key's read bound, checked before anything is read."""
    if max_bytes is None or isinstance(max_bytes, int):
        bound = check_max_bytes(max_bytes)
        return dict.fromkeys(keys, bound)
    if not isinstance(max_bytes, Mapping):
        raise InvalidInput(f"max_bytes must be None, an int or a mapping of keys to ints, got {max_bytes!r}")
    missing = [k for k in keys if k not in max_bytes]
    if missing:
        raise InvalidInput(f"max_bytes has no bound for {missing[0]!r}")
    return {k: check_max_bytes(max_bytes[k]) for k in keys}


def put_many_if_absent(
    store: Store,
    items: Mapping[str, bytes],
    *,
    max_workers: int = DEFAULT_WORKERS,
    on_bytes: Callable[[int], None] | None = None,
) -> dict[str, WriteResult]:
    """Create every object in parallel with ``put_if_absent``: ``{key: Updated | Conflicted}``.

    A key that already exists is a ``Conflicted`` result, not an error (for
    content-addressed shards it usually means the same bytes are already there).
    The first error is raised after in-flight writes end; writes not yet started
    are cancelled, and objects already created stay. ``on_bytes(n)`` is called on
    this thread after each write with the size of the object sent.
    """
    workers = _check_workers(max_workers)
    checked = {check_key(k): check_data(v) for k, v in items.items()}
    if not checked:
        return {}
    result: dict[str, WriteResult] = {}

    def done(key: str, outcome: WriteResult) -> None:
        result[key] = outcome
        if on_bytes is not None:
            on_bytes(len(checked[key]))

    def writer(key: str, data: bytes) -> Callable[[], WriteResult]:
        return lambda: store.put_if_absent(key, data)

    _run(((k, writer(k, v)) for k, v in checked.items()), min(workers, len(checked)), done)
    return {k: result[k] for k in checked}
