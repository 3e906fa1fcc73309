"""Prometheus text exposition written by hand: format, escaping, histograms."""

from __future__ import annotations

import math
import re

import pytest

from bulletin.errors import InvalidInput
from bulletin.sidecar.metrics import Counter, Gauge, Histogram, Registry, SidecarMetrics

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def _samples(text: str) -> dict[str, float]:
    """Parse an exposition strictly: every non-comment line must be a valid sample."""
    assert text.endswith("\n")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        match = _SAMPLE.match(line)
        assert match is not None, line
        value = match.group(3)
        out[match.group(1) + (match.group(2) or "")] = math.inf if value == "+Inf" else float(value)
    return out


def test_counter_gauge_and_labels_with_escaping() -> None:
    registry = Registry()
    requests = registry.register(Counter("t_requests_total", "Requests.", ["status"]))
    lag = registry.register(Gauge("t_lag", 'Lag with "quotes"\nand a newline.'))
    requests.inc(1, "200")
    requests.inc(2, "200")
    requests.inc(1, 'we"ird\\')
    lag.set(3)
    text = registry.render()
    assert "# TYPE t_requests_total counter" in text
    assert '# HELP t_lag Lag with "quotes"\\nand a newline.' in text
    samples = _samples(text)
    assert samples['t_requests_total{status="200"}'] == 3
    assert samples['t_requests_total{status="we\\"ird\\\\"}'] == 1
    assert samples["t_lag"] == 3


def test_unset_gauge_is_absent_not_zero() -> None:
    registry = Registry()
    head = registry.register(Gauge("t_head", "Head."))
    assert "t_head" not in _samples(registry.render())
    head.set(5)
    assert _samples(registry.render())["t_head"] == 5
    head.clear()
    assert "t_head" not in _samples(registry.render())


def test_histogram_buckets_are_cumulative_with_inf_sum_and_count() -> None:
    registry = Registry()
    h = registry.register(Histogram("t_seconds", "Time.", buckets=(0.1, 1.0)))
    for value in (0.05, 0.5, 0.5, 7.0):
        h.observe(value)
    samples = _samples(registry.render())
    assert samples['t_seconds_bucket{le="0.1"}'] == 1
    assert samples['t_seconds_bucket{le="1"}'] == 3
    assert samples['t_seconds_bucket{le="+Inf"}'] == 4
    assert samples["t_seconds_count"] == 4
    assert samples["t_seconds_sum"] == pytest.approx(8.05)


@pytest.mark.parametrize("name", ["1bad", "has-dash", ""])
def test_bad_metric_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidInput):
        Counter(name, "x")


def test_bad_labels_and_counter_decrease_are_refused() -> None:
    with pytest.raises(InvalidInput):
        Counter("t_x", "x", ["le"])
    c = Counter("t_y", "y", ["a"])
    with pytest.raises(InvalidInput):
        c.inc(1)  # label value missing
    with pytest.raises(InvalidInput):
        c.inc(-1, "v")
    registry = Registry()
    registry.register(Counter("t_z", "z"))
    with pytest.raises(InvalidInput):
        registry.register(Gauge("t_z", "again"))


def test_sidecar_metrics_render_as_valid_exposition() -> None:
    m = SidecarMetrics()
    m.requests.inc(1, "409")
    m.sync_failures.inc(1, "digest_mismatch")
    m.pause_seconds.observe(0.002)
    samples = _samples(m.registry.render())
    assert samples['bulletin_requests_total{status="409"}'] == 1
    assert samples['bulletin_sync_failures_total{code="digest_mismatch"}'] == 1
    assert samples["bulletin_activation_pause_seconds_count"] == 1
    assert samples["bulletin_ready"] == 0
