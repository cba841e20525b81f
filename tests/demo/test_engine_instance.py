"""A restarted engine continues its series (issue 33 item 6): the demo engine, killed and
started again in a new session (a new process group, as a systemd or container restart
gives), exports its `kvsidecar_dp_*` series under the same label set, `engine_instance`
the host name. With the former default (PID namespace + process group) each restart
minted new series."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from kvsidecar.bench import fleet
from kvsidecar.bench import vllm as vb
from tests.demo.procs import run_engine
from tests.support.procs import wait_for

pytestmark = pytest.mark.timeout(300)

ENGINE = "restarted"


def dp_label_sets(url: str) -> set[tuple]:
    """The label sets of this engine's kvsidecar_dp_* series."""
    metrics = vb.scrape(f"{url}/metrics")
    return {
        (name, tuple(sorted(labels.items())))
        for name, series in metrics.items()
        if name.startswith("kvsidecar_dp_")
        for labels, _ in series
        if labels.get("engine") == ENGINE
    }


def up(url: str) -> bool:
    metrics = vb.scrape(f"{url}/metrics")
    return any(
        labels.get("engine") == ENGINE and v == 1
        for labels, v in metrics.get("kvsidecar_source_up", [])
    )


def test_a_restarted_engine_keeps_its_dp_series(tmp_path: Path, shm_dir: str) -> None:
    args = ("--shm-dir", shm_dir, "--rate", "20", "--seed", "1")
    daemon, url = fleet.start_daemon(shm_dir, "--poll-interval", "0.1", wait_for_source=False)
    engine = run_engine(tmp_path, ENGINE, *args)
    try:
        assert wait_for(lambda: up(url) and dp_label_sets(url), 120), "no dp series"
        first = dp_label_sets(url)
        engine.send_signal(signal.SIGKILL)  # a crash: nothing cleaned up
        engine.wait(30)
        assert wait_for(lambda: not up(url), 30)
        engine = run_engine(tmp_path, ENGINE, *args)  # a new session: a new process group
        assert wait_for(lambda: up(url) and dp_label_sets(url), 120), "no dp series again"
        second = dp_label_sets(url)
    finally:
        engine.kill()
        engine.wait(30)
        fleet.stop_daemon(daemon)
    assert second == first, (first, second)
    instances = {dict(labels)["engine_instance"] for _, labels in first}
    assert instances == {socket.gethostname()}, first
