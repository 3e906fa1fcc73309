"""Rollout side: keep a local copy (or a live engine) at a verified version of a run.

>>> sub = Subscriber("s3://bucket/runs", "llama-grpo", "/var/lib/bulletin/llama")
>>> sub.sync()            # newest version; returns it once verified and active
>>> for version in sub.follow(interval=2.0):
...     print("serving", version)
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from bulletin.errors import ConfigError, VersionNotFound
from bulletin.run import Run, StoredManifest
from bulletin.storage import Store, open_store
from bulletin.sync import SyncReport, execute, plan
from bulletin.target import ArrayTarget, Held, LocalDirTarget, WeightTarget

__all__ = ["Subscriber", "SubscriberStats"]


@dataclass(slots=True)
class SubscriberStats:
    """Running totals, for metrics."""

    syncs: int = 0
    failures: int = 0
    bytes_downloaded: int = 0
    polls: int = 0
    last_report: SyncReport | None = None
    last_error: str | None = None


def _as_store(store: str | os.PathLike[str] | Store) -> Store:
    if isinstance(store, str | os.PathLike):
        return open_store(store)
    return store


class Subscriber:
    """Follows one run of a store.

    ``local_dir`` keeps the current version as plain safetensors that survive
    restarts (a :class:`LocalDirTarget`); ``target`` instead applies versions to
    something else, such as a live engine. With neither, versions are held in host
    memory (:class:`ArrayTarget`).
    """

    def __init__(
        self,
        store: str | os.PathLike[str] | Store,
        run: str,
        local_dir: str | os.PathLike[str] | None = None,
        *,
        target: WeightTarget | None = None,
        max_workers: int = 8,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        if local_dir is not None and target is not None:
            raise ConfigError("give either local_dir or target, not both")
        self._run = Run(_as_store(store), run, max_workers=max_workers)
        if target is None:
            target = LocalDirTarget(Path(local_dir), run=run) if local_dir is not None else ArrayTarget()
        self.target: WeightTarget = target
        self._held: Held | None = target.restored()
        self._head_etag: str | None = None
        self._head_version: int | None = None
        self._lock = threading.Lock()
        self._on_bytes = on_bytes
        self.stats = SubscriberStats()

    @property
    def run(self) -> str:
        return self._run.name

    @property
    def source(self) -> Run:
        """The run this subscriber reads, in its store."""
        return self._run

    @property
    def current_version(self) -> int | None:
        """The verified, active version (None before the first sync)."""
        held = self._held
        return held.version if held else None

    def head_version(self) -> int | None:
        """The run's newest version per its head: one conditional GET, tiny when unchanged."""
        self.stats.polls += 1
        polled = self._run.poll_head(self._head_etag)
        if polled is not None:
            self._head_etag = polled.etag
            self._head_version = polled.head.version
        return self._head_version

    def _target_manifest(self, version: int | None) -> StoredManifest:
        if version is None:
            tip = self._run.tip()
            if tip is None:
                raise VersionNotFound(f"{self.run}: the run has no version yet")
            return tip
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ConfigError(f"version must be a positive integer, not {version!r}")
        return self._run.read_manifest(version)

    def _activated(self, stored: StoredManifest) -> None:
        self._held = Held(stored.version, dict(stored.manifest.fingerprints))

    def sync(self, version: int | None = None) -> int:
        """Bring the target to ``version`` (default: the newest) and return it.

        On failure a typed error is raised and the node keeps a verified version:
        the one it had, or a newer keyframe it reached on the way.
        """
        with self._lock:
            try:
                stored = self._target_manifest(version)
                route = plan(self._run, stored, self._held)
                report = execute(
                    self._run,
                    route,
                    self.target,
                    self._held,
                    on_bytes=self._on_bytes,
                    on_activate=self._activated,
                )
            except Exception as exc:
                self.stats.failures += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                raise
            self.stats.syncs += 1
            self.stats.bytes_downloaded += report.bytes_downloaded
            self.stats.last_report = report
            self.stats.last_error = None
            if self._head_version is None or stored.version > self._head_version:
                self._head_version = stored.version
            return stored.version

    def follow(
        self,
        *,
        interval: float = 1.0,
        stop: threading.Event | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> Iterator[int]:
        """Poll the head every ``interval`` seconds and yield each newly active version.

        Failures (storage hiccups, a corrupt shard) are reported to ``on_error`` (or
        re-raised without one) and the loop goes on from the verified version it holds.
        """
        stop = stop or threading.Event()
        while not stop.is_set():
            started = time.monotonic()
            try:
                head = self.head_version()
                if head is not None and (self.current_version is None or head > self.current_version):
                    yield self.sync(head)
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(exc)
            stop.wait(max(0.0, interval - (time.monotonic() - started)))

    def close(self) -> None:
        self.target.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
