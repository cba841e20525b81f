"""bench cost's controls: the burner burns what it is told and touches nothing else, and a
daemon from another source tree really runs that tree's code."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from kvsidecar.bench import fleet, proccount, rounds

ROOT = Path(__file__).resolve().parents[2]


def _tree_cpu_ms(pid: int) -> float:
    return sum(proccount.counters(p)["cpu_ms"] for p in proccount.tree(pid))


def test_burner_burns_in_two_processes_and_counts_its_wakeups(tmp_path: Path) -> None:
    burner = rounds.Burner(50.0, scraper_ms=3.0, daemon_ms=3.0, tmp=str(tmp_path))
    try:
        deadline = time.monotonic() + 30
        while len(proccount.tree(burner.proc.pid)) < 2 and time.monotonic() < deadline:
            burner.resume()  # the fork happens once it runs
            time.sleep(0.05)
            burner.pause()
        parent, child = proccount.tree(burner.proc.pid)
        cpu0 = {p: proccount.counters(p)["cpu_ms"] for p in (parent, child)}
        n0 = burner.answered
        burner.resume()
        while burner.answered - n0 < 40 and time.monotonic() < deadline + 60:
            time.sleep(0.1)
        burner.pause()
        n = burner.answered - n0
        assert n >= 40
        for p in (parent, child):
            # 3 ms per wake-up each: at least half of it shows, ticks of 10 ms included
            assert proccount.counters(p)["cpu_ms"] - cpu0[p] >= n * 3.0 / 2 - 10
        # Paused, it does nothing: the count stays put.
        time.sleep(0.3)
        assert burner.answered - n0 == n
    finally:
        burner.close()


def test_daemon_command_refuses_a_directory_that_is_not_a_source_tree(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a kvsidecar source tree"):
        fleet.daemon_command(str(tmp_path))


def test_a_daemon_from_another_tree_runs_that_trees_code(tmp_path: Path) -> None:
    # A copy of this tree with its own version string: only code run from the copy prints
    # it; this install's editable finder must not win over the copy's path.
    copy = tmp_path / "tree"
    shutil.copytree(ROOT / "kvsidecar", copy / "kvsidecar", symlinks=True)
    init = copy / "kvsidecar" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "', '__version__ = "9.9.9-copy+'))
    argv = fleet.daemon_command(str(copy))
    out = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=60)
    assert "9.9.9-copy+" in out.stdout, out.stdout + out.stderr
    with fleet.fleet(ranks=1, pools=1, hz=20.0, checkout=str(copy)) as f:
        cmdline = open(f"/proc/{f['daemon_pid']}/cmdline").read().split("\0")
        assert "-I" in cmdline and str(copy) in cmdline
        body = urllib.request.urlopen(f["url"] + "/metrics", timeout=10).read()
    assert b"kvsidecar_source_up{" in body
