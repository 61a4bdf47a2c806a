"""Gauges in the Prometheus text exposition format (I/O free).

The recovery metrics are exported as gauges (:meth:`RecoveryMetrics.to_prometheus
<taskpilots_graph.metrics.RecoveryMetrics.to_prometheus>`, OpenTelemetry instruments). This
module knows the format only: what a gauge is, and how a list of them is written, by
``prometheus_client`` when the ``metrics`` extra is installed, else by hand.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Gauge", "exposition_text", "gauge", "prometheus_text"]


@dataclass(frozen=True, slots=True)
class Gauge:
    """One gauge: its name, help, label names and samples (label values, value)."""

    name: str
    help: str
    labels: tuple[str, ...]
    samples: tuple[tuple[tuple[str, ...], float], ...]


def gauge(name: str, help: str, samples: Mapping[str, float] | float | None) -> Gauge:
    """A gauge with one label (from ``name{label}``) or none; ``None`` becomes ``NaN``."""
    base, _, label = name.partition("{")
    if isinstance(samples, Mapping):
        values = tuple(((k,), float(v)) for k, v in samples.items())
        return Gauge(f"taskpilots_{base}", help, (label.rstrip("}"),), values)
    value = math.nan if samples is None else float(samples)
    return Gauge(f"taskpilots_{base}", help, (), (((), value),))


def prometheus_text(gauges: Sequence[Gauge]) -> str:
    """``gauges`` in the Prometheus text format, through ``prometheus_client`` when the
    ``metrics`` extra is installed and written by hand (the same format) otherwise."""
    try:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import GaugeMetricFamily
        from prometheus_client.registry import Collector
    except ImportError:  # the ``metrics`` extra is not installed: same format, by hand
        return exposition_text(gauges)

    class _Snapshot(Collector):
        def collect(self) -> Iterator[GaugeMetricFamily]:
            for gauge in gauges:
                family = GaugeMetricFamily(gauge.name, gauge.help, labels=list(gauge.labels))
                for values, value in gauge.samples:
                    family.add_metric(list(values), value)
                yield family

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot())
    return generate_latest(registry).decode()


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(text: str, *, quote: bool) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quote else text


def exposition_text(gauges: Sequence[Gauge]) -> str:
    """Prometheus text exposition format 0.0.4, written without the library."""
    lines = []
    for gauge in gauges:
        lines += [
            f"# HELP {gauge.name} {_escape(gauge.help, quote=False)}",
            f"# TYPE {gauge.name} gauge",
        ]
        for values, value in gauge.samples:
            pairs = ",".join(
                f'{k}="{_escape(v, quote=True)}"'
                for k, v in sorted(zip(gauge.labels, values, strict=True))
            )
            labels = f"{{{pairs}}}" if pairs else ""
            lines.append(f"{gauge.name}{labels} {_number(value)}")
    return "\n".join(lines) + "\n"
