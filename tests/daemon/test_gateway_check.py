"""docs/gateway.md's "Check it works" runs as printed (issue 44, item 6): the quick look's
`serve` line and the three check lines, taken from the doc, run by bash against real
writer processes (a prefill and a decode engine on dp_rank 0, as the demo's P/D pair),
with only the directory and the two ports replaced by free ones. Before: the doc had no
such step."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

from kvsidecar import settings
from kvsidecar.bench.fleet import free_port, free_port_run
from tests.conftest import REPO
from tests.daemon.test_gateway import start_writer, stop
from tests.support.procs import wait_for

DOC = Path(REPO) / "docs" / "gateway.md"


def _blocks() -> tuple[str, list[str]]:
    text = DOC.read_text()
    quick = text.split("A quick look on a clone", 1)[1]
    (serve,) = [ln for ln in re.findall(r"^```sh\n(.*?)^```", quick, re.M | re.S)[0].splitlines()
                if " serve " in ln]  # fmt: skip
    check = text.split("### Check it works", 1)[1]
    lines = re.findall(r"^```sh\n(.*?)^```", check, re.M | re.S)[0].strip().splitlines()
    return serve, lines


def _fill(line: str, shm: str, web: int, gateway: int) -> str:
    return (
        line.replace("/dev/shm/kvsidecar-demo", shm)
        .replace("127.0.0.1:19441", f"127.0.0.1:{web}")
        .replace("127.0.0.1:19450", f"127.0.0.1:{gateway}")
    )


def test_the_documented_check_runs_as_printed(shm_dir: str) -> None:
    serve, checks = _blocks()
    assert len(checks) == 3, checks
    web, gateway = free_port(), free_port_run(1)
    argv = shlex.split(_fill(serve, shm_dir, web, gateway))
    assert argv[0] == ".venv/bin/kvsidecar"
    writers, daemon = [], None
    try:
        writers.append(start_writer("kvsidecar.demo.prefill.dp0", shm_dir, role="prefill"))
        writers.append(start_writer("kvsidecar.demo.decode.dp0", shm_dir, role="decode"))
        daemon = subprocess.Popen(
            argv, cwd=REPO, env=settings.without_ours(os.environ), stderr=subprocess.DEVNULL
        )

        def run(i: int) -> str:
            line = _fill(checks[i], shm_dir, web, gateway)
            return subprocess.run(
                ["bash", "-c", line], capture_output=True, text=True, timeout=60
            ).stdout

        assert wait_for(lambda: run(1) == "200\n")
        assert run(0) == "4\n"
        assert wait_for(
            lambda: (
                re.search(
                    r"^kvsidecar_gateway_answers_total"
                    r'\{dp_rank="0",outcome="ok",role="decode"\} [1-9]',
                    run(2),
                    re.M,
                )
                is not None
            )
        )
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(30)
        for w in writers:
            stop(w)
