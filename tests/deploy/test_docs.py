"""docs/operations.md: refers to files that exist and to real flags."""

from __future__ import annotations

import re

from .support import REPO, env_twin, serve_env_twins

DOC = REPO / "docs" / "operations.md"


def test_referenced_deploy_files_exist() -> None:
    text = DOC.read_text()
    paths = set(re.findall(r"`(deploy/[A-Za-z0-9_./-]+)`", text))
    assert paths
    missing = sorted(p for p in paths if not (REPO / p.split(" ")[0]).exists())
    assert not missing, missing


def test_flag_table_matches_cli() -> None:
    text = DOC.read_text()
    rows = re.findall(
        r"^\| `(--[a-z.-]+)[^`]*` (?:\(repeatable\) )?\| `(KVSIDECAR_[A-Z_]+)` \|", text, re.M
    )
    assert rows, "flag table not found"
    for flag, env in rows:
        assert env == env_twin(flag), flag
    twins, _ = serve_env_twins()
    assert {env for _, env in rows} == twins


def test_covers_required_topics() -> None:
    text = DOC.read_text().lower()
    for topic in (
        "systemd",
        "kubernetes",
        "docker",
        "--ipc=container:",
        "fsgroup",
        "0640",
        "removeipc",
        "36 kib",
        "upgrade",
        "permission denied",
        "not found",
        "stale",
        "version mismatch",
        "/dev/shm` full",
    ):
        assert topic in text, topic


def test_job_selector_sentence_names_the_alerts_that_use_it() -> None:
    """The alerts said to assume `job="kvsidecar..."` are exactly those whose expression
    selects on job (issue #23: "the last two" pointed at other rows), and the alert table
    lists every shipped alert."""
    import yaml

    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "kvsidecar-rules.yml").read_text())
    alerts = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    text = DOC.read_text()
    m = re.search(r"\n(`Kvsidecar\w+`(?:,? (?:and )?`Kvsidecar\w+`)*) assume scrape jobs", text)
    assert m, "the job-selector sentence is not found"
    named = set(re.findall(r"`(Kvsidecar\w+)`", m.group(1)))
    assert named == {a for a, e in alerts.items() if "job=" in e}
    table = set(re.findall(r"^\| `(Kvsidecar\w+)` \|", text, re.M))
    assert table == alerts.keys()


def test_dashboard_variables_listed_are_the_dashboards() -> None:
    import json

    dashboard = json.loads((REPO / "deploy" / "grafana" / "kvsidecar.json").read_text())
    names = [v["name"] for v in dashboard["templating"]["list"]]
    row = next(ln for ln in DOC.read_text().splitlines() if "`deploy/grafana/kvsidecar.json`" in ln)
    listed = re.findall(r"`(\w+)`", row.split("variables", 1)[1])
    assert listed == names


def test_kube_prometheus_stack_release_label_is_mentioned() -> None:
    """Its Prometheus ignores a PodMonitor without `release: <name>`: say so where the
    PodMonitor is (issue #23)."""
    assert (
        "release: <helm release name>" in (REPO / "deploy/kubernetes/podmonitor.yaml").read_text()
    )
    assert "kube-prometheus-stack" in DOC.read_text()
    assert "`release: <helm release name>`" in DOC.read_text()
