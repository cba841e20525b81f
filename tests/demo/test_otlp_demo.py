"""The OTLP push of the demo engine (a real P/D pair moving K/V): every pushed rank data
point equals the same snapshot's /metrics value, and every rank series of /metrics is
pushed, cumulative and delta side by side; each rank's Resource names its engine
instance (issue 34 acceptance)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.proto", reason="needs kvsidecar[otlp]")
pytest.importorskip("torch", reason="the demo engine needs the agent extra")

from tests.support.otlp_points import TO_PROM, rank_points, resource_attrs
from tests.support.otlp_receiver import start_receiver
from tests.support.procs import start_daemon, wait_for
from tests.support.scrape import fetch, samples

from .procs import run_engine

WAIT_S = 120.0  # an "eventually": torch start-up on a shared 2-core host
SEGMENTS = ("kvsidecar.demo.prefill.dp0.tp0.pp0", "kvsidecar.demo.decode.dp0.tp0.pp0")
PUSHED = {m.prom for m in TO_PROM.values()}


@pytest.fixture
def engine(shm_dir: str, tmp_path: Path) -> Iterator[subprocess.Popen]:
    args = ("--pd", "--shm-dir", shm_dir, "--rate", "20", "--max-requests", "10")
    proc = run_engine(tmp_path, "demo", *args, "--transfer-delay", "0.2", "--threads", "1")
    yield proc
    os.killpg(proc.pid, signal.SIGKILL)  # its own session: the pair goes too (stopped or not)
    proc.wait()


def _series(text: str) -> dict:
    """/metrics' rank series (a segment label) that the push carries, ages left out."""
    return {
        (n, tuple(sorted(lab.items()))): v
        for n, lab, v in samples(text)
        if "segment" in lab and n in PUSHED and not n.endswith("age_seconds")
    }


def _receivers() -> dict[str, tuple]:
    return {t: start_receiver() for t in ("cumulative", "delta")}


def test_demo_push_equals_metrics(shm_dir: str, engine: subprocess.Popen) -> None:
    recv = _receivers()
    daemons = {}
    for temporality, (srv, _) in recv.items():
        endpoint = f"http://127.0.0.1:{srv.server_address[1]}/v1/metrics"
        daemons[temporality] = start_daemon(
            shm_dir,
            *("--poll-interval", "0.1", "--stale-after", "3600"),  # stopped engines stay up
            *("--otlp.endpoint", endpoint, "--otlp.interval", "0.3"),
            *("--otlp.temporality", temporality),
        )
    try:
        base = daemons["cumulative"][1]

        def served() -> bool:  # both ranks up and through some requests
            text = fetch(base + "/metrics")[2]
            steps = [v for n, lab, v in samples(text) if n == "kvsidecar_engine_steps_total"]
            allocs = [v for n, _, v in samples(text) if n == "kvsidecar_kv_pool_block_allocs_total"]
            return len(steps) == 2 and len(allocs) == 2 and min(allocs) > 0

        assert wait_for(served, WAIT_S, 0.2)
        # Freeze the snapshots: SIGSTOP the pair (their segments stay, --stale-after keeps
        # them up), then let every daemon poll and push the frozen values. 6 more pushes:
        # more than the queue (4) and the one in flight could hold from before the freeze.
        os.killpg(engine.pid, signal.SIGSTOP)
        frozen_at = {t: len(got) for t, (_, got) in recv.items()}

        def pushed_since() -> bool:
            return all(len(g) >= frozen_at[t] + 6 for t, (_, g) in recv.items())

        assert wait_for(pushed_since, WAIT_S)
        for temporality, (_, base_url) in daemons.items():
            got = list(recv[temporality][1])
            scraped = _series(fetch(base_url + "/metrics")[2])
            assert {dict(k[1])["segment"] for k in scraped} == set(SEGMENTS)
            last = rank_points(got[-1:])
            # Delta: the points of every push add up to the cumulative value.
            pushed = rank_points(got) if temporality == "delta" else last
            pushed = {k: v for k, v in pushed.items() if k in last}  # series still there
            pushed = {k: v for k, v in pushed.items() if not k[0].endswith("age_seconds")}
            assert set(pushed) == set(scraped), temporality  # every series, both ways
            for key, v in scraped.items():
                assert pushed[key] == pytest.approx(v), (temporality, key)
            _assert_instances(got[-1], base_url)
    finally:
        for proc, _ in daemons.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        for srv, _ in recv.values():
            srv.shutdown()


def _assert_instances(req, base_url: str) -> None:
    """Each rank Resource carries engine, model, role, ranks and the engine instance."""
    body = json.loads(fetch(base_url + "/api/v1/snapshots")[2])
    want = {t["segment"]: t["snapshot"]["runtime"] for t in body["targets"]}
    ranks = [resource_attrs(rm) for rm in req.resource_metrics]
    ranks = [r for r in ranks if "kvsidecar.segment" in r]
    assert {r["kvsidecar.segment"] for r in ranks} == set(SEGMENTS)
    for r in ranks:
        rt = want[r["kvsidecar.segment"]]
        assert rt["instance"]  # the agent always sets one
        assert r == {
            "service.name": "kvsidecar",
            "kvsidecar.segment": r["kvsidecar.segment"],
            "kvsidecar.engine": rt["engine"],
            "kvsidecar.model": rt["model_name"],
            "kvsidecar.role": rt["role"],
            "kvsidecar.dp_rank": str(rt["dp_rank"]),
            "kvsidecar.tp_rank": str(rt["tp_rank"]),
            "kvsidecar.pp_rank": str(rt["pp_rank"]),
            "kvsidecar.instance": rt["instance"],
        }
