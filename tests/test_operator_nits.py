"""The smaller operator frictions of issue #23 item 5, each checked: log lines (no trailing
space, the segment named once, a corrupt file at warning, a directory called one), dump/ls
ranges and messages, and the table never dropping columns silently."""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile

import pytest
from click.testing import CliRunner

from kvsidecar import discovery as discovery_mod
from kvsidecar.cli.dump import render_table
from kvsidecar.cli.main import main
from kvsidecar.daemon.config import Discovery, Tuning
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol.writer import SegmentWriter
from tests.support.protocol_helpers import sample_snapshot

NAME = "kvsidecar.eng.dp0.tp0.pp0"


def _messages(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("kvsidecar")]


def test_target_log_lines(shm_dir: str, caplog) -> None:
    w = SegmentWriter(NAME, shm_dir=shm_dir)
    w.publish(sample_snapshot(3))
    with open(os.path.join(shm_dir, "kvsidecar.bad"), "wb") as f:
        f.write(b"NOTASEG!" + b"\0" * 8192)
    os.mkdir(os.path.join(shm_dir, "kvsidecar.dir"))
    ts = TargetSet(
        Discovery(shm_dir, prefix="kvsidecar.", rediscover_interval=3600.0),
        tuning=Tuning(summary_interval=0),
    )
    try:
        with caplog.at_level(logging.INFO, logger="kvsidecar"):
            ts.poll_all()
            w.close(unlink=False)  # the writer is gone, its file left behind
            ts.poll_all()
        msgs = _messages(caplog)
        assert (logging.INFO, f"{NAME}: found, up") in msgs  # no trailing space
        bad = [m for m in msgs if m[1].startswith("kvsidecar.bad: found, corrupt")]
        assert bad and bad[0][0] == logging.WARNING
        dead = [m for m in msgs if m[1].startswith(f"{NAME}: up -> dead")]
        assert dead and dead[0][1].count(NAME) == 1, dead
        assert "is a directory" in ts.refused["kvsidecar.dir"]
        assert "FIFO" not in ts.refused["kvsidecar.dir"]
    finally:
        ts.stop()


def test_table_without_pools_and_at_80_columns(shm_dir: str) -> None:
    w = SegmentWriter(NAME, shm_dir=shm_dir)
    try:
        w.publish(sample_snapshot(3, pools=0))
        ts = TargetSet(Discovery(shm_dir, prefix="kvsidecar."))
        ts.poll_all()
        text = render_table(ts.views(), 160)
        assert "POOL" not in text and "(no pools registered)" in text
        w.publish(sample_snapshot(4))
        ts.poll_all()
        narrow = render_table(ts.views(), 80)
        assert all(len(line) <= 80 for line in narrow.splitlines()[:-1])
        assert "widen the terminal or use --json" in narrow.splitlines()[-1]
        assert "widen" not in render_table(ts.views(), 400)
        ts.stop()
    finally:
        w.close()


@pytest.mark.parametrize("command", ["dump", "ls"])
def test_negative_stale_after_is_refused(shm_dir: str, command: str) -> None:
    r = CliRunner().invoke(main, [command, "--shm-dir", shm_dir, "--stale-after", "-3"])
    assert r.exit_code == 2 and "--stale-after" in r.output, r.output


@pytest.mark.parametrize("command", ["dump", "ls"])
def test_missing_default_directory_is_named(monkeypatch, command: str) -> None:
    parent = tempfile.mkdtemp(prefix="kvsidecar-default-")
    missing = os.path.join(parent, "kvsidecar")
    monkeypatch.setattr(discovery_mod, "DEFAULT_SHM_DIR", missing)
    try:
        r = CliRunner().invoke(main, [command, "--shm-dir", missing])
        assert r.exit_code == 1
        assert "does not exist yet" in r.output and "first engine" in r.output, r.output
    finally:
        shutil.rmtree(parent)


def test_bench_help_names_the_variables_it_reads() -> None:
    from kvsidecar import settings

    for s in settings.ALL:
        if settings.BENCH in s.used_by and s.name.endswith("_PYTHON"):
            # The bench command its meaning names (`kvsidecar bench vllm`, `... bench cost`).
            command = re.search(r"kvsidecar bench (\w+)", s.meaning)
            assert command, (s.name, s.meaning)
            r = CliRunner().invoke(main, ["bench", command.group(1), "--help"])
            assert r.exit_code == 0 and s.name in r.output, (s.name, r.output)


def test_serve_says_it_waits_for_the_default_directory(monkeypatch, caplog) -> None:
    from kvsidecar.daemon import scan as scan_mod

    parent = tempfile.mkdtemp(prefix="kvsidecar-default-")
    missing = os.path.join(parent, "kvsidecar")
    monkeypatch.setattr(scan_mod, "DEFAULT_SHM_DIR", missing)
    ts = TargetSet(Discovery(missing, prefix="kvsidecar.", rediscover_interval=0.0))
    try:
        with caplog.at_level(logging.INFO, logger="kvsidecar"):
            ts.poll_all()
            ts.poll_all()
        lines = [m for _, m in _messages(caplog) if "does not exist yet" in m]
        assert lines == [
            f"{missing} does not exist yet: no segments until the first engine's agent creates it"
        ]
    finally:
        ts.stop()
        shutil.rmtree(parent)


def test_a_bad_telemetry_path_is_a_usage_error_naming_the_option(shm_dir: str) -> None:
    r = CliRunner().invoke(
        main,
        ["serve", "--shm-dir", shm_dir, "--web.listen-address", "127.0.0.1:0",
         "--web.telemetry-path", "metrics"],
    )  # fmt: skip
    assert r.exit_code == 2 and "--web.telemetry-path" in r.output, r.output
    assert "cannot listen" not in r.output


def test_build_info_and_version_carry_the_revision() -> None:
    import subprocess

    from kvsidecar.daemon.collector import SnapshotCollector
    from tests.conftest import REPO

    head = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    assert head
    r = CliRunner().invoke(main, ["ls", "--version"])
    assert r.exit_code == 0 and f"version 0.1.0 (revision {head})" in r.output, r.output
    fams = {f.name: f for f in SnapshotCollector(lambda: []).collect()}
    (sample,) = fams["kvsidecar_build"].samples
    assert sample.labels["revision"] == head and sample.labels["version"] == "0.1.0"


def test_selfcheck_shows_progress_and_what_the_time_was() -> None:
    from tests.test_operator_cli import cli

    r = cli("selfcheck", "--seconds", "0.3", timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("selfcheck: starting a writer and 2 reader processes"), r.stderr
    assert "in 0.3 s of reads (" in r.stdout and "with process start-up)" in r.stdout, r.stdout
