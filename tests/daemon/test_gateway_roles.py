"""Both roles of a P/D pod from one daemon (issue 44, item 6): `--gateway.role
prefill,decode` gives each role its own listeners (role i's dp_rank r on the port +
i * ranks + r), each answering only its role, counted with its `role` label, and the
overlap check counts every listener. Before: `--gateway.role` took one role, so a pod's
two engines on dp_rank 0 were ambiguous (503) unless a second daemon served the other.
Real writer processes (a prefill and a decode engine on dp_rank 0), a real daemon."""

from __future__ import annotations

import re

import pytest

from kvsidecar.bench.fleet import free_port_run, start_daemon
from tests.daemon.test_gateway import HTTPPoll, start_writer, stop, stop_daemon
from tests.daemon.test_ports_overlap import _serve, refused_in_one_line
from tests.support.procs import wait_for
from tests.support.scrape import fetch


def _answers(url: str) -> dict[tuple[str, str, str], float]:
    text = fetch(url + "/metrics")[2]
    pattern = (
        r'^kvsidecar_gateway_answers_total\{dp_rank="(\d+)",outcome="(\w+)",role="(\w+)"\} (\S+)$'
    )
    return {(role, r, o): float(v) for r, o, role, v in re.findall(pattern, text, re.M)}


def test_one_daemon_serves_each_role_on_its_own_listener(shm_dir: str) -> None:
    base = free_port_run(4)
    writers = [
        start_writer("kvsidecar.pd.prefill.dp0", shm_dir, role="prefill"),
        start_writer("kvsidecar.pd.decode.dp0", shm_dir, role="decode"),
    ]
    daemon = None
    try:
        daemon, url = start_daemon(
            shm_dir,
            "--poll-interval", "0.25",
            "--gateway.listen-address", f"127.0.0.1:{base}",
            "--gateway.ranks", "2",
            "--gateway.role", "prefill,decode",
        )  # fmt: skip
        # ranks 2: prefill dp0 on base, dp1 on base+1; decode dp0 on base+2, dp1 on base+3
        prefill, decode = HTTPPoll(base), HTTPPoll(base + 2)
        assert wait_for(lambda: prefill()[0] == 200 and decode()[0] == 200)
        for _ in range(10):
            assert prefill()[0] == 200 and decode()[0] == 200
        assert HTTPPoll(base + 3)()[0] == 503  # decode dp_rank 1: no segment
        assert wait_for(lambda: _answers(url).get(("decode", "1", "no_segment"), 0) >= 1)
        counts = _answers(url)
        assert counts[("prefill", "0", "ok")] >= 11 and counts[("decode", "0", "ok")] >= 11
        assert not any(o == "ambiguous" for _, _, o in counts)
        assert wait_for(lambda: "decode dp_rank 1 no_segment" in fetch(url + "/-/ready")[2])
        stop(writers[0])  # the prefill engine stops: its listener says so, decode's does not
        assert wait_for(lambda: prefill()[0] == 503)
        assert decode()[0] == 200
    finally:
        if daemon is not None:
            stop_daemon(daemon)
        for w in writers:
            stop(w)


def test_the_overlap_check_counts_every_roles_listeners(shm_dir: str) -> None:
    p = free_port_run(3)
    web, gateway = f"127.0.0.1:{p + 2}", f"127.0.0.1:{p}"  # decode's dp_rank 0 on the main port
    line = refused_in_one_line(
        shm_dir, "--web.listen-address", web, "--gateway.listen-address", gateway,
        "--gateway.role", "prefill,decode", "--gateway.ranks", "2",
    )  # fmt: skip
    assert f"both claim port {p + 2}" in line and "--web.listen-address" in line, line


@pytest.mark.parametrize("roles", ["prefill,prefill", "prefill,leader"])
def test_a_bad_role_list_is_a_usage_error(shm_dir: str, roles: str) -> None:
    proc = _serve(shm_dir, "--gateway.listen-address", "127.0.0.1:0", "--gateway.role", roles)
    assert proc.returncode == 2 and "--gateway.role" in proc.stderr, proc.stderr
