"""`kvsidecar demo` as a user sees it (issue #13, item 7): it says when the engines are up,
cleans up when its reader is gone, and names the engine that died."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvsidecar.bench.fleet import free_port
from kvsidecar.protocol.reader import Reading, read_segment
from tests.conftest import REPO
from tests.support.procs import wait_for

from .procs import Demo, session_members


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVSIDECAR_")}


@pytest.mark.timeout(90)
def test_demo_cleans_up_when_its_reader_is_gone() -> None:
    """`kvsidecar demo |& tee log`, then Ctrl-C: tee dies too, so every later write of the
    demo hits a closed pipe; the private directory must still be removed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsidecar", "demo", "--single", "--report-interval", "0",
         "--web.listen-address", f"127.0.0.1:{free_port()}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=_env(),
    )  # fmt: skip
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            lines.append(raw.decode(errors="replace"))
            if "engines up" in raw.decode(errors="replace"):
                return

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        t.join(60)
        text = "".join(lines)
        assert "engines up after" in text, text
        assert text.index("The engines are starting") < text.index("engines up after")
        shm = re.search(r"segments:\s+(\S+)", text).group(1)
        assert os.path.isdir(shm)
        proc.stdout.close()  # the reader is gone
        proc.send_signal(signal.SIGINT)
        proc.wait(40)
        assert not os.path.exists(shm), f"{shm} left behind"
        assert wait_for(lambda: session_members(proc.pid) == [], timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
        for line in session_members(proc.pid):
            os.kill(int(line.split()[0]), signal.SIGKILL)


@pytest.mark.timeout(120)
def test_demo_names_the_engine_that_died(shm_dir: str, tmp_path: Path) -> None:
    demo = Demo(
        tmp_path, "--pd", "--shm-dir", shm_dir, "--web.listen-address",
        f"127.0.0.1:{free_port()}", "--report-interval", "0", "--duration", "90",
    )  # fmt: skip
    try:
        demo.wait_banner()
        assert wait_for(lambda: "engines up" in demo.out, timeout=60), demo.err
        name = "kvsidecar.demo.prefill.dp0.tp0.pp0"
        r = read_segment(name, shm_dir=shm_dir)
        assert isinstance(r, Reading)
        os.kill(r.writer_pid, signal.SIGKILL)
        # Unnoticed, the death would let the demo run to its --duration (90 s); the only
        # bound is well under that, and 200x the supervisor's 0.2 s poll: room for load.
        assert demo.proc.wait(40) == 1, demo.err
        stopping = [ln for ln in demo.err.splitlines() if "stopping (" in ln]
        assert stopping and name in stopping[0] and "duration" not in stopping[0], demo.err
    finally:
        demo.kill()


@pytest.mark.timeout(120)
def test_the_banner_comes_first(tmp_path: Path) -> None:
    """On a terminal (stdout and stderr together) the banner is the first thing printed
    (issue 45 item 5: the P/D launcher's `launcher pid ...` line came above it); each engine
    process names its pid once, on its own line, when it is up."""
    out_path = tmp_path / "demo.log"
    with open(out_path, "w") as out:
        r = subprocess.run(
            [sys.executable, "-m", "kvsidecar", "demo", "--duration", "8",
             "--web.listen-address", f"127.0.0.1:{free_port()}"],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=_env(), timeout=100,
        )  # fmt: skip
    text = out_path.read_text()
    assert r.returncode == 0, text
    lines = text.splitlines()
    assert lines[0].startswith("kvsidecar demo: P/D pair"), text
    launcher = int(re.search(r"^  pids: +daemon \d+, engine (\d+)$", text, re.M)[1])  # type: ignore[index]
    workers = re.findall(r"^kvsidecar-demo\[(prefill|decode)\] pid (\d+) ", text, re.M)
    assert sorted(role for role, _ in workers) == ["decode", "prefill"], text
    assert str(launcher) not in {pid for _, pid in workers}
