"""Prometheus metric families (the collector's, the same objects /metrics renders) -> OTLP.

Why build SDK MetricsData directly instead of a MeterProvider: a MeterProvider carries one
Resource, and we want one Resource per engine rank; and its instruments would re-aggregate
values the snapshot already holds. The families come from the snapshot model (collector
objects), not from parsing text, so a pushed point equals the /metrics value by
construction.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from kvsidecar import __version__
from kvsidecar.daemon.metric_defs import RANK_LABELS
from kvsidecar.otlp.names import mapping

# Rank labels -> Resource attributes (the rest of a sample's labels stay on the point).
RESOURCE_ATTRS = {
    "segment": "kvsidecar.segment",
    "engine": "kvsidecar.engine",
    "model_name": "kvsidecar.model",
    "role": "kvsidecar.role",
    "dp_rank": "kvsidecar.dp_rank",
    "tp_rank": "kvsidecar.tp_rank",
    "pp_rank": "kvsidecar.pp_rank",
}
# The engine instance (runtime.instance, schema v1.3) is no label of the rank's series
# (/metrics has it on the DP sums only), so it comes from the views: segment -> instance.
INSTANCE_ATTR = "kvsidecar.instance"
_SCOPE = InstrumentationScope("kvsidecar", __version__)
_BY_PROM = {m.prom: m for m in mapping()}

Key = tuple[tuple[str, str], ...]


class Delta:
    """Previous cumulative values per series, to send differences on request."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, Key, Key], float | tuple] = {}

    def step(self, series: tuple[str, Key, Key], value):
        prev = self._last.get(series)
        self._last[series] = value
        if prev is None:
            return value
        if isinstance(value, tuple):  # histogram: (count, sum, buckets)
            c, s, b = value
            pc, ps, pb = prev
            if c < pc:  # reset: send the whole value
                return value
            return (c - pc, s - ps, [x - y for x, y in zip(b, pb)])
        return value if value < prev else value - prev


def to_metrics_data(
    families: Iterable,
    now_ns: int,
    start_ns: int,
    delta: Delta | None = None,
    instances: Mapping[str, str] | None = None,
) -> MetricsData:
    """One ResourceMetrics per engine rank (plus one for the daemon's own metrics);
    ``instances`` (segment -> engine instance) adds kvsidecar.instance where known."""
    temporality = (
        AggregationTemporality.DELTA if delta is not None else AggregationTemporality.CUMULATIVE
    )
    per_res: dict[Key, dict[str, tuple]] = {}  # resource -> otel name -> (def, points)
    for fam in families:
        # prometheus_client drops the suffix of a counter's and an info's family name.
        suffix = {"counter": "_total", "info": "_info"}.get(fam.type, "")
        d = _BY_PROM.get(fam.name + suffix) or _BY_PROM.get(fam.name)
        if d is None:
            continue  # process_*/python_* self-metrics: not in metric_defs, not pushed
        if fam.type == "histogram":
            _histogram(fam, d, per_res, now_ns, start_ns, delta)
            continue
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            if isinstance(s.value, float) and math.isnan(s.value):
                continue
            res, attrs = _split(s.labels)
            value = s.value
            if d.kind == "sum" and delta is not None:
                value = delta.step((d.name, res, attrs), value)
            pts = per_res.setdefault(res, {}).setdefault(d.name, (d, []))[1]
            pts.append(
                NumberDataPoint(
                    attributes=dict(attrs),
                    start_time_unix_nano=start_ns,
                    time_unix_nano=now_ns,
                    value=value,
                )
            )
    out = []
    for res, metrics in per_res.items():
        ms = [_metric(d, pts, temporality) for d, pts in metrics.values()]
        attrs = {"service.name": "kvsidecar", **{RESOURCE_ATTRS[k]: v for k, v in res}}
        instance = (instances or {}).get(dict(res).get("segment", ""))
        if instance:  # "" from writers before schema v1.3: no attribute, not an empty one
            attrs[INSTANCE_ATTR] = instance
        out.append(
            ResourceMetrics(
                resource=Resource(attrs),
                scope_metrics=[ScopeMetrics(scope=_SCOPE, metrics=ms, schema_url="")],
                schema_url="",
            )
        )
    return MetricsData(resource_metrics=out)


def _split(labels: dict[str, str]) -> tuple[Key, Key]:
    res = tuple((k, labels[k]) for k in RANK_LABELS if k in labels)
    rest = tuple(sorted((k, v) for k, v in labels.items() if k not in RESOURCE_ATTRS))
    return res, rest


def _metric(d, pts, temporality) -> Metric:
    if d.kind == "sum":
        data = Sum(data_points=pts, aggregation_temporality=temporality, is_monotonic=True)
    elif d.kind == "histogram":
        data = Histogram(data_points=pts, aggregation_temporality=temporality)
    else:
        data = Gauge(data_points=pts)
    return Metric(name=d.name, description="", unit=d.unit, data=data)


def _histogram(fam, d, per_res, now_ns, start_ns, delta) -> None:
    # prometheus_client: cumulative _bucket{le} samples, then _count and _sum, per series.
    series: dict[tuple[Key, Key], dict] = {}
    for s in fam.samples:
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        h = series.setdefault(_split(labels), {"b": [], "count": 0.0, "sum": 0.0})
        if s.name.endswith("_bucket"):
            h["b"].append((float(s.labels["le"]), s.value))
        elif s.name.endswith("_count"):
            h["count"] = s.value
        elif s.name.endswith("_sum"):
            h["sum"] = s.value
    for (res, attrs), h in series.items():
        cum = [v for _, v in sorted(h["b"])]
        counts = [int(c - p) for c, p in zip(cum, [0.0, *cum[:-1]])]
        bounds = [le for le, _ in sorted(h["b"]) if not math.isinf(le)]
        value = (h["count"], h["sum"], counts)
        if delta is not None:
            value = delta.step((d.name, res, attrs), value)
        count, total, counts = value
        pts = per_res.setdefault(res, {}).setdefault(d.name, (d, []))[1]
        pts.append(
            HistogramDataPoint(
                attributes=dict(attrs),
                start_time_unix_nano=start_ns,
                time_unix_nano=now_ns,
                count=int(count),
                sum=total,
                bucket_counts=counts,
                explicit_bounds=bounds,
                min=math.nan,
                max=math.nan,
                exemplars=[],
            )
        )
