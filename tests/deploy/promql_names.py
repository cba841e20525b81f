"""Pull metric names out of PromQL expressions (dashboards, rule files).

A small tokenizer, not a full parser: it removes what cannot be a metric name
(string literals, label matchers, range/subquery brackets, grouping label
lists, numbers and durations) and keeps identifiers that are neither function
calls nor keywords. Good enough for the expressions this repository ships;
the self-tests in test_grafana.py pin its behaviour.
"""

from __future__ import annotations

import re

# Aggregation operators, binary/set operators and modifiers. Functions are
# recognised by the "(" that follows them, so they need no list.
KEYWORDS = frozenset(
    {
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "atan2",
        "inf",
        "nan",
    }
)

# Samples Prometheus adds to every target itself; not exported by kvsidecar.
PROMETHEUS_SYNTHETIC = frozenset(
    {
        "up",
        "scrape_duration_seconds",
        "scrape_samples_scraped",
        "scrape_samples_post_metric_relabeling",
        "scrape_series_added",
    }
)

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.I)
_IDENT = re.compile(r"(?<![\w.$:])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
_GRAFANA_VAR = re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*(?::[A-Za-z]+)?\}?|\[\[[A-Za-z0-9_]+\]\]")
# Grafana Prometheus variable queries.
_LABEL_VALUES = re.compile(r"^\s*label_values\s*\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$", re.S)
_LABEL_VALUES_ONLY_LABEL = re.compile(r"^\s*label_values\s*\(\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$")
_QUERY_RESULT = re.compile(r"^\s*query_result\s*\((.*)\)\s*$", re.S)
_NON_METRIC_QUERY = re.compile(r"^\s*(?:label_names|metrics)\s*\(.*\)\s*$", re.S)


def metric_names(expr: str) -> set[str]:
    """Metric names referenced by one PromQL expression."""
    text = _STRING.sub(" ", expr)
    text = _GRAFANA_VAR.sub(" ", text)
    # Label matchers: keep any __name__="..." selection? Not used here; drop.
    text = _MATCHERS.sub(" ", text)
    while True:  # nested [..] cannot occur, but subqueries follow ranges
        new = _BRACKETS.sub(" ", text)
        if new == text:
            break
        text = new
    text = _GROUPING.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        name, call = m.group(1), m.group(2)
        if call:  # function call, or `sum(`, `by(` already gone
            continue
        if name.lower() in KEYWORDS:
            continue
        names.add(name)
    return names


def variable_query_names(query: str) -> set[str]:
    """Metric names referenced by a Grafana Prometheus variable query."""
    if _LABEL_VALUES_ONLY_LABEL.match(query) or _NON_METRIC_QUERY.match(query):
        return set()
    m = _LABEL_VALUES.match(query)
    if m:
        return metric_names(m.group(1))
    m = _QUERY_RESULT.match(query)
    if m:
        return metric_names(m.group(1))
    return metric_names(query)


def dashboard_exprs(dashboard: dict) -> list[str]:
    """Every PromQL expression of a dashboard's panels (rows included)."""
    exprs: list[str] = []

    def walk(panels):
        for panel in panels or []:
            for target in panel.get("targets", []) or []:
                if target.get("expr"):
                    exprs.append(target["expr"])
            walk(panel.get("panels"))

    walk(dashboard.get("panels"))
    return exprs


def dashboard_variable_queries(dashboard: dict) -> list[str]:
    out = []
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        q = var.get("query")
        if isinstance(q, dict):
            q = q.get("query")
        if q:
            out.append(q)
    return out


def rule_exprs(rules_doc: dict) -> list[str]:
    return [r["expr"] for g in rules_doc.get("groups", []) for r in g.get("rules", [])]


def recorded_names(rules_doc: dict) -> set[str]:
    return {
        r["record"]
        for g in rules_doc.get("groups", [])
        for r in g.get("rules", [])
        if "record" in r
    }


def grafana_to_promql(expr: str) -> str:
    """Replace Grafana variables so promtool can parse the expression."""
    expr = (
        expr.replace("$__rate_interval", "5m")
        .replace("$__interval", "1m")
        .replace("$__range", "1h")
    )
    return _GRAFANA_VAR.sub(".*", expr)
