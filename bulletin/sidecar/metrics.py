"""Prometheus text exposition (format 0.0.4), hand-written to add no dependency.

Only what the sidecar needs: counters, gauges and histograms, each with an optional
fixed set of label names. Metric objects are safe to update from any thread (the sync
worker runs outside the event loop); ``render`` takes a consistent snapshot per metric.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Final, TypeVar

from bulletin.errors import InvalidInput

__all__ = [
    "CONTENT_TYPE",
    "Counter",
    "Gauge",
    "Histogram",
    "Registry",
    "SidecarMetrics",
]

#: What ``GET /metrics`` answers with; Prometheus' text format version 0.0.4.
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

_NAME_RE: Final = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_RE: Final = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

#: Seconds; spans sub-millisecond applies to multi-second keyframe loads and waits.
DEFAULT_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def _format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1 << 53:
        return str(int(value))
    return repr(value)


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels_text(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape_label(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind: str = ""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        if not _NAME_RE.match(name):
            raise InvalidInput(f"invalid metric name {name!r}")
        for label in labels:
            if not _LABEL_RE.match(label) or label.startswith("__") or label == "le":
                raise InvalidInput(f"invalid label name {label!r} for {name}")
        self.name = name
        self.help = help_text
        self.label_names = tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: Sequence[str]) -> tuple[str, ...]:
        if len(labels) != len(self.label_names):
            raise InvalidInput(f"{self.name} takes labels {list(self.label_names)}, got {len(labels)} values")
        return tuple(str(v) for v in labels)

    def _header(self) -> list[str]:
        return [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


_M = TypeVar("_M", bound=_Metric)


class _Scalar(_Metric):
    """A metric with one number per label set (counters and gauges)."""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[tuple[str, ...], float] = {}

    def _add(self, amount: float, labels: Sequence[str]) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        lines = self._header()
        lines += [f"{self.name}{_labels_text(self.label_names, k)} {_format_value(v)}" for k, v in items]
        return lines


class Counter(_Scalar):
    """A value that only goes up (resets only with the process)."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        if not self.label_names:
            self._values[()] = 0.0

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        """Add ``amount`` (>= 0) to the series named by ``labels``."""
        if amount < 0:
            raise InvalidInput(f"{self.name}: a counter cannot decrease")
        self._add(amount, labels)

    def value(self, *labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)


class Gauge(_Scalar):
    """A value that goes up and down; unset series are not exposed (absent, not zero)."""

    kind = "gauge"

    def set(self, value: float, *labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def add(self, amount: float, *labels: str) -> None:
        self._add(amount, labels)

    def clear(self, *labels: str) -> None:
        """Stop exposing the series (for example the head before it is first read)."""
        key = self._key(labels)
        with self._lock:
            self._values.pop(key, None)

    def value(self, *labels: str) -> float | None:
        with self._lock:
            return self._values.get(self._key(labels))


class Histogram(_Metric):
    """Cumulative buckets, sum and count, as Prometheus histograms are exposed."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        help_text: str,
        labels: Sequence[str] = (),
        buckets: Iterable[float] = DEFAULT_BUCKETS,
    ) -> None:
        super().__init__(name, help_text, labels)
        bounds = sorted(float(b) for b in buckets)
        if not bounds or any(math.isnan(b) for b in bounds) or len(set(bounds)) != len(bounds):
            raise InvalidInput(f"{name}: buckets must be distinct numbers")
        if not math.isinf(bounds[-1]):
            bounds.append(math.inf)
        self.bounds = tuple(bounds)
        # per series: (count per bucket, non-cumulative), sum, count
        self._series: dict[tuple[str, ...], tuple[list[int], float, int]] = {}

    def observe(self, value: float, *labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            counts, total, n = self._series.get(key) or ([0] * len(self.bounds), 0.0, 0)
            for i, bound in enumerate(self.bounds):
                if value <= bound:
                    counts[i] += 1
                    break
            self._series[key] = (counts, total + value, n + 1)

    def count(self, *labels: str) -> int:
        with self._lock:
            series = self._series.get(self._key(labels))
        return series[2] if series else 0

    def sum(self, *labels: str) -> float:
        with self._lock:
            series = self._series.get(self._key(labels))
        return series[1] if series else 0.0

    def render(self) -> list[str]:
        with self._lock:
            items = sorted((k, (list(c), s, n)) for k, (c, s, n) in self._series.items())
        lines = self._header()
        for key, (counts, total, n) in items:
            running = 0
            for bound, c in zip(self.bounds, counts, strict=True):
                running += c
                le = f'le="{_format_value(bound)}"'
                lines.append(f"{self.name}_bucket{_labels_text(self.label_names, key, le)} {running}")
            labels = _labels_text(self.label_names, key)
            lines.append(f"{self.name}_sum{labels} {_format_value(total)}")
            lines.append(f"{self.name}_count{labels} {n}")
        return lines


class Registry:
    """An ordered set of metrics rendered together."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def register(self, metric: _M) -> _M:
        if metric.name in self._metrics:
            raise InvalidInput(f"metric {metric.name!r} registered twice")
        self._metrics[metric.name] = metric
        return metric

    def render(self) -> str:
        """The whole exposition, newline-terminated as the format requires."""
        lines: list[str] = []
        for metric in self._metrics.values():
            lines += metric.render()
        return "\n".join(lines) + "\n"


class SidecarMetrics:
    """Every series the sidecar exposes; names are part of the contract (docs/SIDECAR.md)."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.current_version = r.register(Gauge("bulletin_current_version", "Verified version the engine is serving."))
        self.head_version = r.register(
            Gauge("bulletin_head_version", "Newest version the head pointed to when last polled.")
        )
        self.version_lag = r.register(Gauge("bulletin_version_lag", "Head version minus current version."))
        self.ready = r.register(Gauge("bulletin_ready", "1 while a verified version is active."))
        self.last_sync_ok = r.register(
            Gauge("bulletin_last_sync_success", "1 if the last sync attempt succeeded, else 0.")
        )
        self.syncs = r.register(Counter("bulletin_syncs_total", "Sync attempts that activated a new version."))
        self.sync_failures = r.register(
            Counter(
                "bulletin_sync_failures_total",
                "Failed sync or head polls, by stable error code.",
                ["code"],
            )
        )
        self.bytes_downloaded = r.register(Counter("bulletin_bytes_downloaded_total", "Bytes fetched from the store."))
        self.apply_seconds = r.register(
            Histogram("bulletin_apply_seconds", "Time to apply one patch or keyframe to the engine.")
        )
        self.sync_seconds = r.register(
            Histogram(
                "bulletin_sync_seconds",
                "Time of a whole sync (download, apply, verify, activate).",
                buckets=(0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
            )
        )
        self.pause_seconds = r.register(
            Histogram(
                "bulletin_activation_pause_seconds",
                "Time new requests were held back while a version was applied and activated.",
            )
        )
        self.drain_seconds = r.register(
            Histogram(
                "bulletin_drain_seconds",
                "Time an activation waited for in-flight requests to finish.",
            )
        )
        self.preempted = r.register(
            Counter(
                "bulletin_preempted_requests_total",
                "Requests still in flight when an activation stopped waiting for them.",
            )
        )
        self.requests = r.register(
            Counter(
                "bulletin_requests_total",
                "Proxied requests by final HTTP status (sidecar refusals included).",
                ["status"],
            )
        )
        self.in_flight = r.register(Gauge("bulletin_requests_in_flight", "Requests holding the activation lock."))
        self.wait_seconds = r.register(
            Histogram(
                "bulletin_request_wait_seconds",
                "Time requests waited for their version or for an activation to finish.",
            )
        )
        self.verifications = r.register(
            Counter(
                "bulletin_verifications_total",
                "Full re-hashes of the bits held against their version's fingerprints, by result "
                "(ok, damaged, failed).",
                ["result"],
            )
        )
        self.repairs = r.register(
            Counter("bulletin_repairs_total", "Damaged bits found by a verification and rebuilt from a keyframe.")
        )
        self.verify_seconds = r.register(
            Histogram(
                "bulletin_verify_seconds",
                "Time one verification spent re-hashing the bits held.",
                buckets=(0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0),
            )
        )
        self.replica_written = r.register(
            Counter(
                "bulletin_replica_written_bytes_total",
                "Bytes the node's folder wrote in the log layout, by what for: version (a log file and the "
                "state, per applied version), compaction (a new base, in the background), keyframe.",
                ["kind"],
            )
        )
        self.replica_compactions = r.register(
            Counter("bulletin_replica_compactions_total", "Compactions of the node's folder committed (log layout).")
        )
        self.not_ready = r.register(
            Gauge(
                "bulletin_not_ready",
                "1 for the reason the node serves no verified version or is out of service "
                "(not_synced, engine_unverified, or a permanent error's code); absent while ready.",
                ["code"],
            )
        )
        self.in_flight.set(0)
        self.ready.set(0)
        self._not_ready_code: str | None = None
        self._not_ready_lock = threading.Lock()

    def count_replica_write(self, kind: str, nbytes: int) -> None:
        """What a log-layout folder wrote (``LogDirTarget.on_written``; any thread)."""
        self.replica_written.inc(nbytes, kind)
        if kind == "compaction":
            self.replica_compactions.inc()

    def set_not_ready(self, code: str | None) -> None:
        """Expose ``code`` as the one reason the node is not ready (None: it is ready)."""
        with self._not_ready_lock:  # the worker thread and the event loop both set it
            previous, self._not_ready_code = self._not_ready_code, code
            if previous is not None and previous != code:
                self.not_ready.clear(previous)
            if code is not None:
                self.not_ready.set(1, code)
            self.ready.set(1 if code is None else 0)
