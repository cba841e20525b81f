"""Gateway failures an operator sees (issue 44, item 3): every answer counted by rank and
outcome (a fixed set), a 503 streak logged once at its start and once at its end, and
`/-/ready` naming the rank. Before: two roles claiming rank 0 gave 503s while the daemon
logged nothing, `/-/ready` said all up, and `kvsidecar_gateway_requests_total` had no rank.
Real writer processes, a real daemon (tests/daemon/test_gateway.py's helpers)."""

from __future__ import annotations

import re

from tests.daemon.test_gateway import HTTPPoll, daemon_with_gateway, start_writer, stop, stop_daemon
from tests.support.procs import wait_for
from tests.support.scrape import fetch

POLLS = 30


def _answers(url: str) -> dict[tuple[str, str], float]:
    text = fetch(url + "/metrics")[2]
    pattern = (
        r"^kvsidecar_gateway_answers_total"
        r'\{dp_rank="(\d+)",outcome="(\w+)",role="any"\} (\S+)$'
    )
    return {(r, o): float(v) for r, o, v in re.findall(pattern, text, re.M)}


def test_an_ambiguous_rank_is_counted_logged_once_and_ready_says_so(shm_dir, tmp_path) -> None:
    shm = shm_dir
    log_path = tmp_path / "daemon.log"
    with open(log_path, "wb") as log:
        daemon, url, port = daemon_with_gateway(shm, "--log-level", "info", stderr=log)
    writers = []
    try:
        writers.append(start_writer("kvsidecar.gw.prefill.dp0", shm, role="prefill"))
        writers.append(start_writer("kvsidecar.gw.decode.dp0", shm, role="decode"))
        prefill = writers[0]
        poll = HTTPPoll(port)
        assert wait_for(lambda: "all claim dp_rank 0" in poll()[1])
        for _ in range(POLLS):
            status, body, _ = poll()
            assert status == 503 and "all claim dp_rank 0" in body
        bad_path = HTTPPoll(port, "/nope")
        assert bad_path()[0] == 404
        assert wait_for(lambda: _answers(url).get(("0", "ambiguous"), 0) >= POLLS + 1)
        assert _answers(url)[("0", "not_found")] == 1
        ready = fetch(url + "/-/ready")
        assert ready[0] == 200 and "gateway answering 503 for dp_rank 0 ambiguous" in ready[2]
        stop(prefill)  # one claimant left: served again
        assert wait_for(lambda: poll()[0] == 200)
        for _ in range(POLLS):
            assert poll()[0] == 200
        assert wait_for(lambda: _answers(url).get(("0", "ok"), 0) >= POLLS)
        assert wait_for(lambda: "gateway answering" not in fetch(url + "/-/ready")[2])
    finally:
        stop_daemon(daemon)
        for writer in writers:
            stop(writer)
    lines = log_path.read_text().splitlines()
    started = [ln for ln in lines if "gateway dp_rank 0: answering 503 (ambiguous)" in ln]
    ended = [ln for ln in lines if "gateway dp_rank 0: answering 200 again (was ambiguous)" in ln]
    assert len(started) == 1, started  # once for the streak, not once per poll
    assert len(ended) == 1, ended
