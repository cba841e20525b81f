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
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.bench.fleet import free_port
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


EVENT_COUNTERS = {
    "kvsidecar_gateway_connections_closed_total",
    "kvsidecar_otlp_dropped_batches_total",
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
        # The gateway endpoint and the OTLP push on (a collector that is not there), so
        # their families are in the scrape: the dashboard has panels on them.
        gateway, collector = free_port(), free_port()
        daemon, url = start_daemon(
            shm_dir, "--poll-interval", "0.1",
            "--gateway.listen-address", f"127.0.0.1:{gateway}",
            "--otlp.endpoint", f"http://127.0.0.1:{collector}/v1/metrics",
        )  # fmt: skip
        assert wait_for(lambda: "kvsidecar_source_up{" in fetch(url + "/metrics")[2])
        fetch(url + "/api/v1/snapshots")  # so every handler has request metrics
        fetch(f"http://127.0.0.1:{gateway}/metrics")  # an endpoint picker's poll
        # Counted once answered, and /metrics renders once per poll cycle: wait for it.
        assert wait_for(lambda: "kvsidecar_gateway_requests_total{" in fetch(url + "/metrics")[2])
        text = fetch(url + "/metrics")[2]
        # These two have no sample until their first event (a gateway connection the daemon
        # closes, a lost OTLP batch): their family in the scrape is what the panel names.
        families = {
            fam.name + "_total"
            for fam in text_string_to_metric_families(text)
            if fam.type == "counter" and fam.name + "_total" in EVENT_COUNTERS
        }
        assert families == EVENT_COUNTERS, families
        return families | {name for name, _, _ in samples(text)}
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
