"""End to end: real writer processes, `kvsidecar serve` as a process, real HTTP scrapes."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile

import pytest

from tests.support.procs import start_daemon, start_rank, wait_for
from tests.support.rank_writer import expected_pool
from tests.support.scrape import fetch, samples, value


@pytest.fixture
def two_ranks(shm_dir: str):
    procs = [
        start_rank(f"kvsidecar.fake.dp{dp}.tp0.pp0", shm_dir, dp=dp, pools=2)[0] for dp in (0, 1)
    ]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture
def daemon(shm_dir: str, two_ranks):
    proc, url = start_daemon(shm_dir, "--poll-interval", "0.1", "--stale-after", "1")
    yield url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0  # clean shutdown on SIGTERM


def test_metrics_match_what_writers_published(daemon: str) -> None:
    status, ctype, text = fetch(daemon + "/metrics")
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
    for dp in (0, 1):
        seg = f"kvsidecar.fake.dp{dp}.tp0.pp0"
        assert value(text, "kvsidecar_source_up", segment=seg) == 1.0
        assert value(text, "kvsidecar_requests_deferred_free", segment=seg) == dp + 3
        assert (
            value(
                text,
                "kvsidecar_requests_running",
                segment=seg,
                engine="fake",
                model_name="tiny-model",
                role="prefill",
                dp_rank=str(dp),
            )
            == 4 + dp
        )
        for i in (0, 1):
            exp = expected_pool(dp, i)
            lab = {"segment": seg, "pool": f"pool{i}", "group": str(i)}
            for field in (
                "total_blocks",
                "allocated_blocks",
                "reserved_blocks",
                "available_blocks",
                "cached_blocks",
                "deferred_free_blocks",
                "tokens_used",
            ):
                assert value(text, f"kvsidecar_kv_pool_{field}", **lab) == exp[field], field
            assert value(text, "kvsidecar_kv_pool_evictions_total", **lab) == exp["evictions_total"]
            assert value(text, "kvsidecar_kv_pool_block_usage_ratio", **lab) == pytest.approx(
                exp["allocated_blocks"] / exp["total_blocks"]
            )
            assert value(text, "kvsidecar_kv_pool_token_usage_ratio", **lab) == pytest.approx(
                exp["tokens_used"] / (exp["total_blocks"] * 16)
            )
    # The ATOM pair summed over DP ranks of one engine.
    dp_labels = {"engine": "fake", "model_name": "tiny-model", "role": "prefill"}
    assert value(text, "kvsidecar_dp_requests_deferred_free", **dp_labels) == 3 + 4
    expected_blocks = sum(
        expected_pool(dp, i)["deferred_free_blocks"] for dp in (0, 1) for i in (0, 1)
    )
    assert value(text, "kvsidecar_dp_kv_blocks_deferred_free", **dp_labels) == expected_blocks
    # The step counter moves between scrapes (the daemon is not serving a frozen copy).
    seg0 = "kvsidecar.fake.dp0.tp0.pp0"
    first = value(text, "kvsidecar_engine_steps_total", segment=seg0)
    assert wait_for(
        lambda: (
            value(fetch(daemon + "/metrics")[2], "kvsidecar_engine_steps_total", segment=seg0)
            > first
        ),
    )


def test_promtool_check_metrics(daemon: str) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    _, _, text = fetch(daemon + "/metrics")
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_openmetrics_when_asked(daemon: str) -> None:
    status, ctype, text = fetch(
        daemon + "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert status == 200 and ctype.startswith("application/openmetrics-text")
    assert text.rstrip().endswith("# EOF")
    assert "kvsidecar_kv_pool_allocated_blocks{" in text


def test_json_snapshots(daemon: str) -> None:
    status, ctype, body = fetch(daemon + "/api/v1/snapshots")
    assert status == 200 and ctype.startswith("application/json")
    targets = {t["segment"]: t for t in json.loads(body)["targets"]}
    t = targets["kvsidecar.fake.dp1.tp0.pp0"]
    assert t["state"] == "up" and t["snapshot"]["runtime"]["dp_rank"] == 1
    assert t["snapshot"]["pools"][1]["allocated_blocks"] == expected_pool(1, 1)["allocated_blocks"]


def test_health_ready_and_landing(daemon: str) -> None:
    assert fetch(daemon + "/-/healthy")[0] == 200
    status, _, body = fetch(daemon + "/-/ready")
    assert status == 200
    status, ctype, body = fetch(daemon + "/")
    assert status == 200 and "/metrics" in body and "text/html" in ctype


def test_stop_kill_restart(shm_dir: str) -> None:
    name = "kvsidecar.fake.dp0.tp0.pp0"
    writer, inc1 = start_rank(name, shm_dir, dp=0)
    daemon, url = start_daemon(shm_dir, "--poll-interval", "0.1", "--stale-after", "1")
    try:
        m = lambda: fetch(url + "/metrics")[2]  # noqa: E731
        assert wait_for(lambda: value(m(), "kvsidecar_source_up", segment=name) == 1.0)
        writer.send_signal(signal.SIGSTOP)
        # Stale once older than the configured age (1 s): up 0, no values served as fresh.
        # The age check below is a lower bound: a loaded host can only make it larger.
        assert wait_for(lambda: value(m(), "kvsidecar_source_up", segment=name) == 0.0)
        text = m()
        assert value(text, "kvsidecar_source_state", segment=name, state="stale") == 1.0
        assert value(text, "kvsidecar_source_snapshot_age_seconds", segment=name) >= 1.0
        assert value(text, "kvsidecar_kv_pool_allocated_blocks", segment=name) is None
        assert value(text, "kvsidecar_requests_running", segment=name) is None
        writer.send_signal(signal.SIGCONT)
        assert wait_for(lambda: value(m(), "kvsidecar_source_up", segment=name) == 1.0)
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        assert wait_for(
            lambda: value(m(), "kvsidecar_source_state", segment=name, state="dead") == 1.0,
        )
        assert value(m(), "kvsidecar_source_up", segment=name) == 0.0
        writer, inc2 = start_rank(name, shm_dir, dp=0)
        assert inc2 != inc1
        assert wait_for(lambda: value(m(), "kvsidecar_source_up", segment=name) == 1.0)
        text = m()
        assert value(text, "kvsidecar_source_writer_restarts_total", segment=name) == 1.0
        assert value(text, "kvsidecar_source_generation", segment=name) == 2.0
    finally:
        writer.kill()
        daemon.kill()


def test_real_prometheus_scrapes_the_daemon(daemon: str, tmp_path) -> None:
    """A real Prometheus server scrapes us; PromQL returns the published deferred-free value."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus not installed (apt-get install prometheus)")
    from kvsidecar.bench.fleet import free_port

    target = daemon.removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: kvsidecar\n    static_configs: [{{targets: ['{target}']}}]\n"
    )
    port = free_port()
    data = tempfile.mkdtemp(prefix="prom-", dir=tmp_path)
    prom = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        query = f"http://127.0.0.1:{port}/api/v1/query?query=kvsidecar_dp_kv_blocks_deferred_free"
        result: list = []

        def answered() -> bool:
            nonlocal result
            try:
                status, _, body = fetch(query, timeout=2)
            except OSError:
                return False
            result = json.loads(body)["data"]["result"] if status == 200 else []
            return bool(result)

        assert wait_for(answered, timeout=30, interval=0.5), prom.stderr
        expected = sum(
            expected_pool(dp, i)["deferred_free_blocks"] for dp in (0, 1) for i in (0, 1)
        )
        assert float(result[0]["value"][1]) == expected
        assert result[0]["metric"]["job"] == "kvsidecar"
        _, _, body = fetch(
            f"http://127.0.0.1:{port}/api/v1/query?query=up%7Bjob%3D%22kvsidecar%22%7D"
        )
        assert json.loads(body)["data"]["result"][0]["value"][1] == "1"
    finally:
        prom.terminate()
        prom.wait(10)


def test_scrape_output_parses_and_has_no_duplicate_series(daemon: str) -> None:
    _, _, text = fetch(daemon + "/metrics")
    seen = set()
    for name, labels, _ in samples(text):
        key = (name, tuple(sorted(labels.items())))
        assert key not in seen, key
        seen.add(key)
