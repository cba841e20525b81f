"""docs/metrics.md is generated from metric_defs and documents every exported name."""

from __future__ import annotations

import os
import re

from kvsidecar.daemon import metric_defs
from tests.conftest import REPO


def test_metrics_doc_is_current() -> None:
    with open(os.path.join(REPO, "docs", "metrics.md")) as f:
        assert f.read() == metric_defs.markdown(), (
            "regenerate: python -m kvsidecar.daemon.metric_defs > docs/metrics.md"
        )


def test_every_metric_name_in_code_is_documented() -> None:
    doc = open(os.path.join(REPO, "docs", "metrics.md")).read()
    code = ""
    for root in ("kvsidecar", "agent"):
        for dirpath, _, files in os.walk(os.path.join(REPO, root)):
            for name in files:
                if name.endswith(".py"):
                    code += open(os.path.join(dirpath, name)).read()
    names = set(re.findall(r'"(kvsidecar_[a-z0-9_]+)"', code))
    missing = sorted(n for n in names if n not in doc)
    assert not missing, missing


def test_names_follow_conventions() -> None:
    for m in metric_defs.ALL:
        assert re.fullmatch(r"kvsidecar_[a-z][a-z0-9_]*", m.name), m.name
        if m.type == metric_defs.COUNTER:
            assert m.name.endswith("_total"), m.name
        else:
            assert not m.name.endswith("_total"), m.name
        base = m.name.removesuffix("_total")  # a counter's unit precedes _total
        if m.unit == "bytes":
            assert base.endswith("_bytes"), m.name
        if m.unit == "seconds":
            assert base.endswith("_seconds"), m.name
        if m.type == metric_defs.INFO:
            assert m.name.endswith("_info"), m.name


def test_every_help_line_fits() -> None:
    """Issue 45 item 5: 12 HELP lines were over 300 characters (up to 692), a page of text
    in every scrape and in a Grafana tooltip. The details past one line are docs/metrics.md's
    (`more`), which keeps both."""
    long = {}
    for m in metric_defs.ALL:
        line = f"# HELP {m.name} {m.help}"  # a counter's family name is shorter (no _total)
        if len(line) > metric_defs.HELP_LINE_MAX:
            long[m.name] = len(line)
    assert not long, long
    assert metric_defs.HELP_LINE_MAX == 300
    doc = metric_defs.markdown()
    for m in metric_defs.ALL:
        if m.more:
            assert f"| {m.help} {m.more} |" in doc, m.name
