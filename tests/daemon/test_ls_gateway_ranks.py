"""`kvsidecar ls` says which ranks a gateway listener would answer 503 (issue 44, item 3):
two live segments claiming one dp_rank (ambiguous, with the fix) and a rank none of whose
segments is up (down). Before: ls listed the segments, each `up`, and said nothing of the
rank they share. Real writer processes, the real command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from kvsidecar import settings
from tests.daemon.test_gateway import start_writer, stop
from tests.support.procs import wait_for


def _ls(shm: str, *args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "kvsidecar", "ls", "--shm-dir", shm, *args],
        env=settings.without_ours(os.environ), capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip


def test_ls_names_an_ambiguous_and_a_down_rank(shm_dir: str) -> None:
    writers = []
    try:
        writers.append(start_writer("kvsidecar.ls.prefill.dp0", shm_dir, role="prefill"))
        writers.append(start_writer("kvsidecar.ls.decode.dp0", shm_dir, role="decode"))
        writers.append(start_writer("kvsidecar.ls.both.dp1", shm_dir, dp=1))
        out = _ls(shm_dir)
        (line,) = [ln for ln in out.splitlines() if ln.startswith("dp_rank 0:")]
        assert "ambiguous: 2 live segments claim it" in line, out
        assert "kvsidecar.ls.prefill.dp0" in line and "kvsidecar.ls.decode.dp0" in line
        assert "--gateway.role (decode or prefill)" in line, line
        assert "dp_rank 1:" not in out, out  # served: one live segment
        writers[2].send_signal(signal.SIGSTOP)  # rank 1's engine hangs
        assert wait_for(lambda: "dp_rank 1: down" in _ls(shm_dir, "--stale-after", "0.5"))
        line = [ln for ln in _ls(shm_dir, "--stale-after", "0.5").splitlines() if "dp_rank 1" in ln]
        assert line and "kvsidecar.ls.both.dp1 stale" in line[0], line
    finally:
        for w in writers:
            stop(w)


def test_ls_is_quiet_when_every_rank_is_served(shm_dir: str) -> None:
    w = start_writer("kvsidecar.ls.both.dp0", shm_dir)
    try:
        out = _ls(shm_dir)
        assert "kvsidecar.ls.both.dp0" in out and "GATEWAY" not in out, out
    finally:
        stop(w)
