"""`kvsidecar serve` configured by the OpenTelemetry SDK environment variables alone, and
the Resources it pushes as docs/otlp.md lists them (issue 45, item 1)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

pytest.importorskip("requests", reason="needs kvsidecar[otlp]")
pytest.importorskip("opentelemetry.proto", reason="needs kvsidecar[otlp]")

from tests.conftest import REPO
from tests.support.otlp_points import resource_attrs
from tests.support.otlp_receiver import start_receiver
from tests.support.procs import start_daemon, start_rank, wait_for

WAIT_S = 120.0  # an "eventually", not a speed bound


def documented_resources() -> dict[str, set[str]]:
    """docs/otlp.md's Resources table: row name -> the attributes it lists."""
    text = (Path(REPO) / "docs" / "otlp.md").read_text()
    section = text.split("## Resources", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and "---" not in r][1:]
    return {
        r.split("|")[1].strip(): set(re.findall(r"`(kvsidecar\.[\w.]+)`", r.split("|")[2]))
        for r in rows
    }


def test_otel_variables_alone(shm_dir: str) -> None:
    writers = [start_rank(f"kvsidecar.fake.dp{dp}.tp0.pp0", shm_dir, dp=dp)[0] for dp in (0, 1)]
    srv, got = start_receiver()
    env = {
        **os.environ,
        # A base URL without a path: the push posts to /v1/metrics, as the SDKs do.
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{srv.server_address[1]}",
        "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=engine-0,k8s.namespace.name=llm",
        "OTEL_SERVICE_NAME": "kv-sidecar-a",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
        "KVSIDECAR_OTLP_INTERVAL": "0.3",
    }
    proc, _ = start_daemon(shm_dir, "--poll-interval", "0.1", env=env)
    try:
        # Both ranks up and their DP sums: 2 ranks + 1 engine instance + the daemon.
        assert wait_for(lambda: any(len(r.resource_metrics) >= 4 for r in got), WAIT_S)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        srv.shutdown()
        for w in writers:
            w.kill()
            w.wait()
    assert set(srv.paths) == {"/v1/metrics"}
    assert {h.get("content-encoding") for h in srv.headers} == {"gzip"}
    req = next(r for r in got if len(r.resource_metrics) >= 4)
    docs = documented_resources()
    kinds: dict[str, int] = {}
    for rm in req.resource_metrics:
        attrs = resource_attrs(rm)
        assert attrs["service.name"] == "kv-sidecar-a"  # on every Resource
        assert attrs["k8s.pod.name"] == "engine-0" and attrs["k8s.namespace.name"] == "llm"
        ours = {k for k in attrs if k.startswith("kvsidecar.")}
        names = {m.name for sm in rm.scope_metrics for m in sm.metrics}
        # Which documented row: its attributes, less kvsidecar.instance (these fake writers
        # are older than schema v1.3: "absent for writers before schema v1.3").
        row = next(n for n, a in docs.items() if ours == a - {"kvsidecar.instance"})
        kinds[row] = kinds.get(row, 0) + 1
        if row == "one per engine instance":
            assert names and all(n.startswith("kvsidecar.dp.") for n in names), names
        if row == "the daemon's":
            assert "kvsidecar.polls" in names
    assert kinds == {"one per engine rank": 2, "one per engine instance": 1, "the daemon's": 1}
    assert len(req.resource_metrics) == 4  # "2 DP ranks of one engine push 4 Resources"
