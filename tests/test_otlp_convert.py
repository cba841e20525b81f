"""Families -> OTLP (kvsidecar/otlp/convert.py): one Resource per rank, values kept, delta;
every batch decoded by opentelemetry-proto's own ExportMetricsServiceRequest."""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.proto", reason="needs the kvsidecar[otlp] extra")

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)

from kvsidecar.daemon.metric_defs import POOL_LABELS, RANK_LABELS
from kvsidecar.otlp.convert import Delta, Encoder


def _families(steps: float, count: float) -> list:
    steps_f = CounterMetricFamily("kvsidecar_engine_steps", "", labels=RANK_LABELS)
    alloc = GaugeMetricFamily("kvsidecar_kv_pool_allocated_blocks", "", labels=POOL_LABELS)
    for dp in ("0", "1"):
        rank = ["seg" + dp, "vllm", "m", "decode", dp, "0", "0"]
        steps_f.add_metric(rank, steps + int(dp))
        alloc.add_metric([*rank, "kv", "0"], 10 + int(dp))
    hist = HistogramMetricFamily("kvsidecar_http_request_duration_seconds", "", labels=["handler"])
    hist.add_metric(["/metrics"], [("0.1", count), ("+Inf", count + 1)], sum_value=0.5)
    return [steps_f, alloc, hist]


def _points(req) -> dict:
    out = {}
    for rm in req.resource_metrics:
        res = {a.key: a.value.string_value for a in rm.resource.attributes}
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = m.WhichOneof("data")
                for p in getattr(m, kind).data_points:
                    attrs = tuple(sorted((a.key, a.value.string_value) for a in p.attributes))
                    key = (res.get("kvsidecar.dp_rank", ""), m.name, attrs)
                    if kind == "histogram":
                        out[key] = (p.count, p.sum, list(p.bucket_counts), m.unit)
                    else:
                        v = p.as_int if p.WhichOneof("value") == "as_int" else p.as_double
                        out[key] = (
                            v,
                            m.unit,
                            getattr(m, kind).aggregation_temporality if kind == "sum" else None,
                        )
    return out


def _encode(families, now: int, start: int, enc: Encoder | None = None, instances=None):
    enc = enc if enc is not None else Encoder()
    return ExportMetricsServiceRequest.FromString(enc.encode(families, now, start, instances).body)


def test_cumulative_one_resource_per_rank() -> None:
    req = _encode(_families(5, 2), 2_000, 1_000)
    assert len(req.resource_metrics) == 3  # two ranks + the daemon's own
    pts = _points(req)
    assert pts[("0", "kvsidecar.engine.steps", ())] == (5, "{step}", 2)  # 2 = CUMULATIVE
    assert pts[("1", "kvsidecar.engine.steps", ())] == (6, "{step}", 2)
    key = ("1", "kvsidecar.kv_pool.allocated_blocks", (("group", "0"), ("pool", "kv")))
    assert pts[key][:2] == (11, "{block}")
    hist = pts[("", "kvsidecar.http_request_duration", (("handler", "/metrics"),))]
    assert hist == (3, 0.5, [2, 1], "s")


def test_delta_sends_differences() -> None:
    enc = Encoder(delta=Delta())
    _encode(_families(5, 2), 2_000, 1_000, enc)
    pts = _points(_encode(_families(9, 3), 3_000, 2_000, enc))
    assert pts[("0", "kvsidecar.engine.steps", ())] == (4, "{step}", 1)  # 1 = DELTA
    key = ("0", "kvsidecar.kv_pool.allocated_blocks", (("group", "0"), ("pool", "kv")))
    assert pts[key][0] == 10  # gauges stay as they are
    hist = pts[("", "kvsidecar.http_request_duration", (("handler", "/metrics"),))]
    assert hist[:3] == (1, 0.0, [1, 0])


def _decoded(families, instances) -> ExportMetricsServiceRequest:
    """Through the wire format, as a collector receives it."""
    return _encode(families, 2_000, 1_000, instances=instances)


def test_rank_resource_names_the_instance() -> None:
    req = _decoded(_families(5, 2), {"seg0": "4026531836.77", "seg1": ""})
    res = [
        {a.key: a.value.string_value for a in rm.resource.attributes} for rm in req.resource_metrics
    ]
    ranks = {r.get("kvsidecar.segment"): r for r in res}
    assert ranks["seg0"] == {
        "service.name": "kvsidecar",
        "kvsidecar.segment": "seg0",
        "kvsidecar.engine": "vllm",
        "kvsidecar.model": "m",
        "kvsidecar.role": "decode",
        "kvsidecar.dp_rank": "0",
        "kvsidecar.tp_rank": "0",
        "kvsidecar.pp_rank": "0",
        "kvsidecar.instance": "4026531836.77",
    }
    assert "kvsidecar.instance" not in ranks["seg1"]  # "" (a writer before v1.3): no attribute
    assert ranks[None] == {"service.name": "kvsidecar"}  # the daemon's own metrics


def test_info_families_are_pushed() -> None:
    info = InfoMetricFamily("kvsidecar_engine", "", labels=RANK_LABELS)
    info.add_metric(["seg0", "vllm", "m", "decode", "0", "0", "0"], {"device": "cuda:0"})
    m = _decoded([info], None).resource_metrics[0].scope_metrics[0].metrics[0]
    assert (m.name, m.unit, m.WhichOneof("data")) == ("kvsidecar.engine.info", "1", "gauge")
    attrs = {a.key: a.value.string_value for a in m.gauge.data_points[0].attributes}
    assert attrs == {"device": "cuda:0"} and m.gauge.data_points[0].as_int == 1


def test_kept_encodings_follow_the_fleet() -> None:
    """What does not change between pushes is encoded once; a segment gone for a push is
    forgotten, so a fleet whose engines come and go never grows the encoder."""
    enc = Encoder()
    _encode(_families(5, 2), 2_000, 1_000, enc)
    steps = CounterMetricFamily("kvsidecar_engine_steps", "", labels=RANK_LABELS)
    steps.add_metric(["seg9", "vllm", "m", "decode", "9", "0", "0"], 1)
    for _ in range(2):  # the first push keeps the departed ranks' as "old", the second drops them
        req = _encode([steps], 3_000, 1_000, enc)
    kept = {k[1] for k in enc._labels} | {k[1] for k in enc._labels._old}
    assert all(dict(labels).get("segment") == "seg9" for labels in kept), kept
    assert len(enc._resources) + len(enc._resources._old) == 1
    assert _points(req)[("9", "kvsidecar.engine.steps", ())][0] == 1


def test_values_of_every_kind_survive_the_wire() -> None:
    g = GaugeMetricFamily("kvsidecar_kv_pool_allocated_blocks", "", labels=POOL_LABELS)
    rank = ["s", "vllm", "m", "decode", "0", "0", "0"]
    for i, v in enumerate([0, -1, 2**63 - 1, 2**64 - 1, 0.25, float("inf"), float("nan")]):
        g.add_metric([*rank, "kv", str(i)], v)
    pts = _points(_encode([g], 2_000, 1_000))
    got = {k[2][0][1]: v[0] for k, v in pts.items()}
    assert got == {
        "0": 0,
        "1": -1,
        "2": 2**63 - 1,
        "3": float(2**64 - 1),
        "4": 0.25,
        "5": float("inf"),
    }
