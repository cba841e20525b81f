"""OTel name mapping (kvsidecar/otlp/names.py): total, collision-free, docs/otlp.md current."""

from __future__ import annotations

import os
import re

from kvsidecar.daemon.metric_defs import ALL
from kvsidecar.otlp import names
from tests.conftest import REPO


def test_every_metric_mapped_once() -> None:
    rows = names.mapping()
    assert [r.prom for r in rows] == [m.name for m in ALL]
    assert len({r.name for r in rows}) == len(rows)


def test_names_follow_otel_style() -> None:
    for r in names.mapping():
        assert r.name.startswith("kvsidecar."), r
        assert not r.name.endswith(("_bytes", "_seconds", "_ratio")), r
        # memory_total is a gauge (the device's total); only counters lose _total.
        assert not (r.kind == "sum" and r.name.endswith("_total")), r
        assert re.fullmatch(r"By|s|1|\{[a-z_]+\}", r.unit), r


def test_known_examples() -> None:
    by = {r.prom: r for r in names.mapping()}
    assert by["kvsidecar_engine_steps_total"] == names.OtelName(
        "kvsidecar_engine_steps_total", "kvsidecar.engine.steps", "{step}", "sum"
    )
    assert by["kvsidecar_kv_pool_allocated_bytes"].unit == "By"
    assert by["kvsidecar_source_read_retries_total"].unit == "{retry}"


def test_docs_table_current() -> None:
    path = os.path.join(REPO, "docs", "otlp.md")
    with open(path) as f:
        doc = f.read()
    assert names.replace_block(doc) == doc, (
        "docs/otlp.md is stale: python -m kvsidecar.otlp.names --update docs/otlp.md"
    )
