"""`kvsidecar demo` end to end: real engines, real daemon, real scrapes, real signals."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from pathlib import Path

import pytest

from kvsidecar.bench.fleet import free_port
from tests.support.procs import wait_for
from tests.support.scrape import fetch, value

from .procs import Demo, session_members

PREFILL = {"role": "prefill", "segment": "kvsidecar.demo.prefill.dp0.tp0.pp0"}
DECODE = {"role": "decode", "segment": "kvsidecar.demo.decode.dp0.tp0.pp0"}
N_REQUESTS = 12


@pytest.fixture
def demos():
    started: list[Demo] = []
    yield started
    for d in started:
        d.kill()


def scrape(url: str) -> str:
    status, _, text = fetch(url + "/metrics")
    assert status == 200
    return text


def metric(text: str, name: str, rank: dict[str, str]) -> float:
    v = value(text, name, **rank)
    return -1.0 if v is None else v


@pytest.mark.timeout(90)
def test_pd_deferred_blocks_show_while_pending_then_return(
    shm_dir: str, tmp_path: Path, demos: list[Demo]
) -> None:
    demo = Demo(
        tmp_path,
        "--pd",
        "--shm-dir",
        shm_dir,
        "--web.listen-address",
        f"127.0.0.1:{free_port()}",
        "--poll-interval",
        "0.05",
        "--rate",
        "20",
        "--transfer-delay",
        "1.0",
        "--max-requests",
        str(N_REQUESTS),
        "--step-ms",
        "5",
        "--report-interval",
        "0",
    )
    demos.append(demo)
    demo.wait_banner()
    url = demo.base_url

    def pending_visible() -> bool:
        text = scrape(url)
        reqs = metric(text, "kvsidecar_requests_deferred_free", PREFILL)
        blocks = metric(text, "kvsidecar_kv_pool_deferred_free_blocks", PREFILL)
        dp = value(text, "kvsidecar_dp_kv_blocks_deferred_free", role="prefill")
        # Deferred blocks are allocated blocks: they are what keeps prefill's usage up.
        allocated = metric(text, "kvsidecar_kv_pool_allocated_blocks", PREFILL)
        return reqs > 0 and blocks > 0 and dp == blocks and allocated >= blocks

    # The transfer delay holds every prefilled request's blocks at prefill for 1 s.
    assert wait_for(pending_visible, timeout=45, interval=0.05), demo.err

    def decode_holds_pulled_kv() -> bool:
        return metric(scrape(url), "kvsidecar_kv_pool_allocated_blocks", DECODE) > 0

    assert wait_for(decode_holds_pulled_kv, timeout=20, interval=0.05), demo.err

    def drained() -> bool:
        # Idle level: nothing running or deferred holds a block, so allocated == 0 exactly;
        # prefix-cached blocks are counted in cached_blocks, not in allocated_blocks.
        text = scrape(url)
        return (
            all(
                metric(text, name, rank) == 0
                for rank in (PREFILL, DECODE)
                for name in (
                    "kvsidecar_requests_deferred_free",
                    "kvsidecar_kv_pool_deferred_free_blocks",
                    "kvsidecar_kv_pool_allocated_blocks",
                    "kvsidecar_requests_running",
                    "kvsidecar_requests_waiting",
                )
            )
            and value(text, "kvsidecar_dp_kv_blocks_deferred_free", role="prefill") == 0
        )

    assert wait_for(drained, timeout=30, interval=0.1), scrape(url)
    text = scrape(url)
    assert metric(text, "kvsidecar_kv_pool_cached_blocks", PREFILL) > 0  # blocks came back
    assert metric(text, "kvsidecar_kv_pool_block_usage_ratio", PREFILL) == 0

    assert demo.stop(signal.SIGINT) == 0, demo.err
    # Every request was prefilled, pulled and fully decoded before the Ctrl-C.
    assert f"done={N_REQUESTS} kv_pulled=" in demo.err, demo.err
    assert os.listdir(shm_dir) == []  # both agents closed: segments unlinked
    assert session_members(demo.proc.pid) == []


@pytest.mark.timeout(60)
def test_sigterm_removes_private_dir_and_leaves_no_process(
    tmp_path: Path, demos: list[Demo]
) -> None:
    with contextlib.ExitStack() as stack:
        # Default address taken (by us, or by whatever already holds it): a free port instead.
        with contextlib.suppress(OSError):
            sock = stack.enter_context(socket.socket())
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 19440))
            sock.listen()
        demo = Demo(tmp_path, "--single", "--report-interval", "0")
        demos.append(demo)
        banner = demo.wait_banner()
    assert "127.0.0.1:19440 is in use; using port" in demo.err
    assert ":19440/" not in banner["metrics"]
    status, _, _ = fetch(demo.base_url + "/-/healthy")
    assert status == 200
    shm = banner["segments"].split()[0]
    assert shm.startswith("/dev/shm/kvsidecar-demo-") and "(private" in banner["segments"]
    assert f"--shm-dir {shm}" in banner["watch"]
    # The snapshot segment, and the KV-event segment the demo's engine records (kv-events.md)
    want = ["kvevents.demo.dp0.tp0.pp0", "kvsidecar.demo.dp0.tp0.pp0"]
    assert wait_for(lambda: sorted(os.listdir(shm)) == want, timeout=30)
    assert demo.stop(signal.SIGTERM) == 0, demo.err
    assert not os.path.exists(shm)
    assert "segments left" not in demo.err
    assert session_members(demo.proc.pid) == []


@pytest.mark.timeout(60)
def test_sigkilled_demo_takes_its_children_down(
    shm_dir: str, tmp_path: Path, demos: list[Demo]
) -> None:
    """No cleanup code runs in a SIGKILLed demo: PR_SET_PDEATHSIG stops the children, and
    the P/D launcher's workers in turn, which still unlink their segments."""
    demo = Demo(
        tmp_path,
        "--pd",
        "--shm-dir",
        shm_dir,
        "--web.listen-address",
        f"127.0.0.1:{free_port()}",
        "--report-interval",
        "0",
    )
    demos.append(demo)
    demo.wait_banner()
    # Both snapshot segments and the prefill engine's KV-event segment (kv-events.md)
    assert wait_for(lambda: len(os.listdir(shm_dir)) == 3, timeout=30), demo.err
    demo.proc.kill()
    demo.proc.wait()
    assert wait_for(lambda: session_members(demo.proc.pid) == [], timeout=20), session_members(
        demo.proc.pid
    )
    assert os.listdir(shm_dir) == []
