"""Every metric the dashboard and the rules query is in a real scrape of the daemon.

The writer is a real engine-like loop (tests.support.agent_loop: KVBlockPool + KVSidecarAgent),
so every field the agent supports is populated, as in production.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import yaml

from tests.conftest import REPO
from tests.support.procs import start_daemon, wait_for
from tests.support.scrape import fetch, samples

from .promql_names import (
    PROMETHEUS_SYNTHETIC,
    dashboard_exprs,
    dashboard_variable_queries,
    metric_names,
    recorded_names,
    rule_exprs,
    variable_query_names,
)
from .support import HERE

DEPLOY = HERE.parent.parent / "deploy"
# Queried names that only engine sources this CPU loop lacks export, each scraped from a real
# daemon by the test named (it needs the real engine): KVBlockPool reports no lease expiry.
OTHER_SOURCES = {
    "kvsidecar_kv_pool_deferred_free_expired_total": "tests/engines/test_vllm_pd.py",
}


def _scraped_names(shm_dir: str) -> set[str]:
    # A file the daemon refuses (a FIFO), so the per-file refusal series is in the scrape.
    os.mkfifo(os.path.join(shm_dir, "kvsidecar.refused"))
    engine = subprocess.Popen(
        [sys.executable, "-m", "tests.support.agent_loop", shm_dir, "200"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    daemon = None
    try:
        assert engine.stdout.readline().startswith("ready")
        daemon, url = start_daemon(shm_dir, "--poll-interval", "0.1")
        assert wait_for(lambda: "kvsidecar_source_up{" in fetch(url + "/metrics")[2])
        fetch(url + "/api/v1/snapshots")  # so every handler has request metrics
        return {name for name, _, _ in samples(fetch(url + "/metrics")[2])}
    finally:
        engine.kill()
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(10)


def test_dashboard_and_rules_query_only_scraped_metrics(shm_dir: str) -> None:
    scraped = _scraped_names(shm_dir)
    dashboard = json.loads((DEPLOY / "grafana" / "kvsidecar.json").read_text())
    rules = yaml.safe_load((DEPLOY / "prometheus" / "kvsidecar-rules.yml").read_text())
    queried: set[str] = set()
    for expr in dashboard_exprs(dashboard) + rule_exprs(rules):
        queried |= metric_names(expr)
    for query in dashboard_variable_queries(dashboard):
        queried |= variable_query_names(query)
    queried -= recorded_names(rules) | PROMETHEUS_SYNTHETIC
    assert queried, "no metric names extracted"
    missing = sorted(queried - scraped - set(OTHER_SOURCES))
    assert not missing, f"queried but not exported by a real daemon: {missing}"
    for name, test in OTHER_SOURCES.items():
        assert name not in scraped, f"{name} is scraped here now: drop it from OTHER_SOURCES"
        field = name.removeprefix("kvsidecar_kv_pool_")
        with open(os.path.join(REPO, test)) as f:
            assert f'"{field}"' in f.read(), f"{test} does not scrape {name}"
