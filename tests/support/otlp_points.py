"""Decoded OTLP requests (opentelemetry-proto) back to /metrics' terms: (name, labels)."""

from __future__ import annotations

from kvsidecar.otlp.convert import INSTANCE_ATTR, RESOURCE_ATTRS
from kvsidecar.otlp.names import mapping

TO_PROM = {m.name: m for m in mapping()}
RES = {attr: label for label, attr in RESOURCE_ATTRS.items()}
DELTA = 1  # AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA in the proto

Key = tuple[str, tuple[tuple[str, str], ...]]


def resource_attrs(rm) -> dict[str, str]:
    return {a.key: a.value.string_value for a in rm.resource.attributes}


def rank_points(reqs) -> dict[Key, float]:
    """(prom name, sorted labels) -> value, for the rank resources' sums and gauges, over
    ``reqs`` in arrival order: delta sums add up to the cumulative, the rest keep the last."""
    out: dict[Key, float] = {}
    for req in reqs:
        for rm in req.resource_metrics:
            attrs = resource_attrs(rm)
            # A rank's instance is a Resource attribute, not a label of its series.
            res = {RES[k]: v for k, v in attrs.items() if k in RES and k != INSTANCE_ATTR}
            if "segment" not in res:
                continue  # the daemon's own metrics: they change between push and scrape
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    if kind not in ("sum", "gauge"):
                        continue
                    prom = TO_PROM[m.name].prom
                    delta = kind == "sum" and m.sum.aggregation_temporality == DELTA
                    for p in getattr(m, kind).data_points:
                        lab = {**res, **{a.key: a.value.string_value for a in p.attributes}}
                        v = p.as_int if p.WhichOneof("value") == "as_int" else p.as_double
                        key = (prom, tuple(sorted(lab.items())))
                        out[key] = out.get(key, 0) + v if delta else v
    return out
