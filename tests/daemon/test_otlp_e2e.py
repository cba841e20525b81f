"""`kvsidecar serve --otlp.endpoint`: every pushed rank data point equals /metrics, both
temporalities, against a real OTLP/HTTP receiver on loopback (no Collector binary here)."""

from __future__ import annotations

import signal
import time

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="needs kvsidecar[otlp]")

from tests.support.otlp_points import rank_points
from tests.support.otlp_receiver import start_receiver
from tests.support.procs import start_daemon, start_rank, wait_for
from tests.support.scrape import fetch, samples

WAIT_S = 120.0  # generous: a shared host; never a bound on speed


@pytest.mark.parametrize("temporality", ["cumulative", "delta"])
def test_pushed_points_equal_metrics(shm_dir: str, temporality: str) -> None:
    writer = start_rank("kvsidecar.fake.dp0.tp0.pp0", shm_dir, dp=0, pools=2)[0]
    srv, got = start_receiver()
    url = f"http://127.0.0.1:{srv.server_address[1]}/v1/metrics"
    proc, base = start_daemon(
        shm_dir,
        "--poll-interval",
        "0.1",
        "--stale-after",
        "3600",  # the stopped writer stays up: its values are compared, not only its health
        "--otlp.endpoint",
        url,
        "--otlp.interval",
        "0.3",
        "--otlp.temporality",
        temporality,
    )
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not any(
            len(r.resource_metrics) > 1 for r in got[-1:]
        ):
            time.sleep(0.1)
        # Freeze the values (the writer steps on its own): SIGSTOP, so its segment stays and
        # it stays up (a killed writer is dead: only its health would be pushed), and a few
        # more pushes follow, so the last push and the scrape read the same snapshot. Counted,
        # not slept for (2 s once): on a loaded host the last push could predate the freeze,
        # and a push of step 100 met a scrape of 101. 6: more than the queue (4) and the one
        # in flight could hold from before the freeze, as in tests/demo/test_otlp_demo.py.
        writer.send_signal(signal.SIGSTOP)
        frozen_at = len(got)
        assert wait_for(lambda: len(got) >= frozen_at + 6, WAIT_S)
        # Every batch the collector accepted is counted (KvsidecarOtlpPushFailing's series);
        # the last one may be counted after the receiver has it.
        assert wait_for(lambda: (_exported(fetch(base + "/metrics")[2]) or 0) >= len(got) - 1)
        assert _exported(fetch(base + "/metrics")[2]) <= len(got)
        _, _, text = fetch(base + "/metrics")
        pushed = rank_points(list(got) if temporality == "delta" else list(got)[-1:])
        assert pushed
        scraped = {(n, tuple(sorted(lab.items()))): v for n, lab, v in samples(text)}
        last = rank_points(list(got)[-1:])
        assert "kvsidecar_kv_pool_allocated_blocks" in {k[0] for k in last}  # values, too
        for key, v in pushed.items():
            if key not in last:
                continue  # a series of an earlier push that has since changed its labels
            if key[0].endswith("age_seconds"):
                continue  # the snapshot's age: grows between the push and the scrape
            assert key in scraped, key
            assert v == pytest.approx(scraped[key]), key
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        srv.shutdown()
        writer.kill()
        writer.wait()


def _exported(text: str) -> float | None:
    found = [v for n, _, v in samples(text) if n == "kvsidecar_otlp_exported_batches_total"]
    return found[0] if found else None
