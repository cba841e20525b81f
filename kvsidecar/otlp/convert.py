"""Prometheus metric families (the collector's, the same objects /metrics renders) -> the
OTLP wire format (an ``ExportMetricsServiceRequest``, protobuf), encoded here directly.

Why not the OpenTelemetry SDK: a MeterProvider carries one Resource, and we want one per
engine rank; its instruments would re-aggregate values the snapshot already holds; and
building the SDK's ``MetricsData`` and having its exporter encode it cost 13 of the 20 ms
a push took for 8 ranks x 4 pools (cProfile: docs/otlp.md). The messages we send use a
dozen fields of the stable OTLP 1.x protos; the tests decode every batch with
opentelemetry-proto's own ``ExportMetricsServiceRequest``. What does not change between
pushes (a series' attributes, a Resource) is encoded once and kept for the next push.

The families come from the snapshot model (collector objects), not from parsing text, so a
pushed point equals the /metrics value by construction.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvsidecar import __version__
from kvsidecar.otlp.names import mapping

# Labels -> Resource attributes (the rest of a sample's labels stay on the point). A rank's
# series carry the first seven; the DP sums (kvsidecar_dp_*) carry engine, model_name,
# role and engine_instance: one Resource per engine instance.
RESOURCE_ATTRS = {
    "segment": "kvsidecar.segment",
    "engine": "kvsidecar.engine",
    "model_name": "kvsidecar.model",
    "role": "kvsidecar.role",
    "dp_rank": "kvsidecar.dp_rank",
    "tp_rank": "kvsidecar.tp_rank",
    "pp_rank": "kvsidecar.pp_rank",
    "engine_instance": "kvsidecar.instance",
}
# The engine instance (runtime.instance, schema v1.3) is no label of the rank's series
# (/metrics has it on the DP sums only), so it comes from the views: segment -> instance.
INSTANCE_ATTR = "kvsidecar.instance"
SERVICE_NAME = "kvsidecar"
_BY_PROM = {m.prom: m for m in mapping()}

Key = tuple[tuple[str, str], ...]

# AggregationTemporality in opentelemetry/proto/metrics/v1/metrics.proto.
DELTA, CUMULATIVE = 1, 2
_F64 = struct.Struct("<d").pack
_U64 = struct.Struct("<Q").pack
_I64 = struct.Struct("<q").pack


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(key: int, body: bytes) -> bytes:
    """A length-delimited field (wire type 2): ``key`` is (number << 3) | 2."""
    return bytes((key,)) + _varint(len(body)) + body


def _key_value(key: str, value: str) -> bytes:
    """KeyValue{key: 1, value: 2 AnyValue{string_value: 1}}."""
    return _field(0x0A, key.encode()) + _field(0x12, _field(0x0A, value.encode()))


def _number(value: Any) -> bytes:
    """NumberDataPoint's value: as_int (6, sfixed64) for ints, as_double (4) otherwise."""
    if isinstance(value, int) and -(2**63) <= value < 2**63:
        return b"\x31" + _I64(value)
    return b"\x21" + _F64(float(value))


# InstrumentationScope{name: 1, version: 2}, as ScopeMetrics.scope (1).
_SCOPE = _field(0x0A, _field(0x0A, b"kvsidecar") + _field(0x12, __version__.encode()))


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


class _Kept(dict):
    """Encodings kept from one push to the next; what a push did not use is dropped at
    the end of the next, so a fleet whose segments come and go never grows it."""

    def __init__(self) -> None:
        super().__init__()
        self._old: dict = {}

    def __missing__(self, key):
        if key in self._old:
            value = self[key] = self._old.pop(key)
            return value
        raise KeyError(key)

    def roll(self) -> None:
        self._old = dict(self)
        self.clear()


@dataclass(frozen=True)
class Batch:
    """One encoded ExportMetricsServiceRequest and what it holds."""

    body: bytes
    resources: int
    points: int


class Encoder:
    """Families -> OTLP bytes. ``resource_attrs`` (OTEL_RESOURCE_ATTRIBUTES) go on every
    Resource under ours; ``service_name`` (OTEL_SERVICE_NAME) replaces "kvsidecar"."""

    def __init__(
        self,
        resource_attrs: Mapping[str, str] | None = None,
        service_name: str = SERVICE_NAME,
        delta: Delta | None = None,
    ) -> None:
        self._env = dict(resource_attrs or {})
        self._service = service_name
        self.delta = delta
        self._labels = _Kept()  # (attributes field, labels) -> (resource key, attrs, bytes)
        self._resources = _Kept()  # (resource key, instance) -> Resource bytes

    def resource(self, res: Key, instance: str = "") -> dict[str, str]:
        """A Resource's attributes: the environment's, then service.name, then ours."""
        attrs = {**self._env, "service.name": self._service}
        attrs.update((RESOURCE_ATTRS[k], v) for k, v in res if v or k != "engine_instance")
        if instance:  # "" from writers before schema v1.3: no attribute, not an empty one
            attrs[INSTANCE_ATTR] = instance
        return attrs

    def encode(
        self,
        families: Iterable,
        now_ns: int,
        start_ns: int,
        instances: Mapping[str, str] | None = None,
    ) -> Batch:
        """One Resource per engine rank, one per engine instance for the DP sums, one for
        the daemon's own metrics; ``instances`` (segment -> engine instance) adds
        kvsidecar.instance to the ranks' where known."""
        delta = self.delta
        times = b"\x11" + _U64(start_ns) + b"\x19" + _U64(now_ns)  # start 2, time 3: fixed64
        per_res: dict[Key, dict[str, tuple]] = {}  # resource -> otel name -> (def, points)
        points = 0
        for fam in families:
            # prometheus_client drops the suffix of a counter's and an info's family name.
            suffix = {"counter": "_total", "info": "_info"}.get(fam.type, "")
            d = _BY_PROM.get(fam.name + suffix) or _BY_PROM.get(fam.name)
            if d is None:
                continue  # process_*/python_* self-metrics: not in metric_defs, not pushed
            if fam.type == "histogram":
                points += self._histogram(fam, d, per_res, times)
                continue
            step = delta is not None and d.kind == "sum"
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                value = s.value
                if value != value:
                    continue  # NaN: no point
                res, attrs, attr_bytes = self._split(0x3A, s.labels)  # attributes: 7
                if step:
                    value = delta.step((d.name, res, attrs), value)
                pts = per_res.setdefault(res, {}).setdefault(d.name, (d, []))[1]
                pts.append(attr_bytes + times + _number(value))
                points += 1
        temporality = DELTA if delta is not None else CUMULATIVE
        out = []
        for res, metrics in per_res.items():
            instance = (instances or {}).get(dict(res).get("segment", ""), "")
            scope = [_SCOPE]
            for d, pts in metrics.values():
                scope.append(_field(0x12, _metric(d, pts, temporality)))  # metrics: 2
            body = self._resource(res, instance) + _field(0x12, b"".join(scope))
            out.append(_field(0x0A, body))  # resource_metrics: 1
        self._labels.roll()
        self._resources.roll()
        return Batch(b"".join(out), len(out), points)

    def _split(self, field: int, labels: dict[str, str]) -> tuple[Key, Key, bytes]:
        key = (field, tuple(labels.items()))
        try:
            return self._labels[key]
        except KeyError:
            pass
        res = tuple((k, v) for k, v in labels.items() if k in RESOURCE_ATTRS)
        res = tuple(sorted(res, key=lambda kv: _ORDER[kv[0]]))
        attrs = tuple(sorted((k, v) for k, v in labels.items() if k not in RESOURCE_ATTRS))
        encoded = b"".join(_field(field, _key_value(k, v)) for k, v in attrs)
        out = self._labels[key] = (res, attrs, encoded)
        return out

    def _resource(self, res: Key, instance: str) -> bytes:
        """ResourceMetrics.resource (1): Resource{attributes: 1}."""
        key = (res, instance)
        try:
            return self._resources[key]
        except KeyError:
            pass
        attrs = self.resource(res, instance)
        body = b"".join(_field(0x0A, _key_value(k, v)) for k, v in attrs.items())
        out = self._resources[key] = _field(0x0A, body)
        return out

    def _histogram(self, fam, d, per_res, times: bytes) -> int:
        # prometheus_client: cumulative _bucket{le} samples, then _count and _sum, per series.
        series: dict[tuple, dict] = {}
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            h = series.setdefault(self._split(0x4A, labels), {"b": [], "count": 0, "sum": 0.0})
            if s.name.endswith("_bucket"):
                h["b"].append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                h["count"] = s.value
            elif s.name.endswith("_sum"):
                h["sum"] = s.value
        for (res, attrs, attr_bytes), h in series.items():
            cum = [v for _, v in sorted(h["b"])]
            counts = [int(c - p) for c, p in zip(cum, [0.0, *cum[:-1]])]
            bounds = [le for le, _ in sorted(h["b"]) if not math.isinf(le)]
            value = (h["count"], h["sum"], counts)
            if self.delta is not None:
                value = self.delta.step((d.name, res, attrs), value)
            count, total, counts = value
            # HistogramDataPoint: count 4 (fixed64), sum 5 (double), bucket_counts 6
            # (packed fixed64), explicit_bounds 7 (packed double); min/max unknown: absent.
            point = [attr_bytes, times, b"\x21", _U64(int(count)), b"\x29", _F64(total)]
            point.append(_field(0x32, b"".join(_U64(max(0, int(c))) for c in counts)))
            point.append(_field(0x3A, b"".join(_F64(b) for b in bounds)))
            pts = per_res.setdefault(res, {}).setdefault(d.name, (d, []))[1]
            pts.append(b"".join(point))
        return len(series)


_ORDER = {k: i for i, k in enumerate(RESOURCE_ATTRS)}


def _metric(d, pts: list[bytes], temporality: int) -> bytes:
    """Metric{name: 1, unit: 3, gauge: 5 | sum: 7 | histogram: 9}; each data point is
    field 1 of its Gauge/Sum/Histogram."""
    data = b"".join(b"\x0a" + _varint(len(p)) + p for p in pts)
    head = _field(0x0A, d.name.encode()) + _field(0x1A, d.unit.encode())
    if d.kind == "sum":  # aggregation_temporality 2, is_monotonic 3
        return head + _field(0x3A, data + bytes((0x10, temporality, 0x18, 1)))
    if d.kind == "histogram":
        return head + _field(0x4A, data + bytes((0x10, temporality)))
    return head + _field(0x2A, data)
