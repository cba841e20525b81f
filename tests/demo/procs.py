"""Run `kvsidecar demo` and demo engines as real processes; find what they leave behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from tests.support.procs import wait_for


def session_members(sid: int) -> list[str]:
    """Live (non-zombie) processes of session `sid`, as "pid cmdline" strings."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        state, _ppid, _pgrp, session = stat.rsplit(")", 1)[1].split()[:4]
        if int(session) == sid and state != "Z":
            found.append(f"{d} {cmd}")
    return found


class Demo:
    """`python -m kvsidecar demo ...` in a new session (so every descendant is findable)."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.out_path, self.err_path = tmp / "demo.out", tmp / "demo.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvsidecar", "demo", *args],
                cwd=REPO,
                stdout=out,
                stderr=err,
                start_new_session=True,
                env={k: v for k, v in os.environ.items() if not k.startswith("KVSIDECAR_")},
            )
        self.banner: dict[str, str] = {}

    @property
    def out(self) -> str:
        return self.out_path.read_text()

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    def wait_banner(self, timeout: float = 30) -> dict[str, str]:
        """The "name: value" lines printed once the daemon listens."""
        ok = wait_for(lambda: "pids:" in self.out or self.proc.poll() is not None, timeout)
        assert ok and self.proc.poll() is None, f"demo did not start:\n{self.out}\n{self.err}"
        self.banner = dict(re.findall(r"^\s+(\w+):\s+(.*)$", self.out, re.M))
        return self.banner

    @property
    def base_url(self) -> str:
        return self.banner["metrics"].removesuffix("/metrics")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """Test teardown: take down whatever is left of the session."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for line in session_members(self.proc.pid):
            try:
                os.kill(int(line.split()[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_engine(tmp: Path, name: str, *args: str) -> subprocess.Popen:
    """`python -m kvsidecar.agent.demo ...` (stderr to tmp/<name>.err)."""
    with open(tmp / f"{name}.err", "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "kvsidecar.agent.demo", "--engine-name", name, *args],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
