"""The small frictions of issue 45 item 5 (CLI and logs): an unreadable segment directory in a
one-shot command, `dump --watch` on a removed non-default directory, the man page's date,
and the log level's case (promslog's)."""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from kvsidecar.cli import dump as dump_mod
from kvsidecar.cli import manpage
from kvsidecar.cli.main import main
from kvsidecar.protocol.writer import SegmentWriter
from tests.support.procs import start_daemon, wait_for
from tests.support.protocol_helpers import sample_snapshot
from tests.support.scrape import fetch

KVSIDECAR = str(Path(sys.executable).parent / "kvsidecar")
OTHER = 4242  # the engine's uid, not ours


def _without_dac_override() -> None:
    """In the child before exec: root loses its read-anything capabilities (as in
    tests/test_first_failures.py), so file modes apply to it like to the daemon's user."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a directory of another uid")
@pytest.mark.parametrize("args", [["dump"], ["ls"], ["dump", "--watch", "--count", "1"]])
def test_an_unreadable_directory_is_one_line_with_the_fix(tmp_path: Path, args: list[str]):
    """Before: the scan's daemon line (`keeping the 0 known target(s) (logged once per inf
    s)`), then "no segments" (exit 1), or an empty watch (exit 0)."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o755)
    SegmentWriter("kvsidecar.x.dp0.tp0.pp0", shm_dir=str(shm)).publish(sample_snapshot(1))
    os.chown(shm, OTHER, OTHER)  # the engine's private 0700 directory: we may not list it
    r = subprocess.run(
        [KVSIDECAR, *args, "--shm-dir", str(shm)], capture_output=True, text=True,
        timeout=120, preexec_fn=_without_dac_override,
    )  # fmt: skip
    assert (r.returncode, r.stdout) == (2, ""), r
    (line,) = r.stderr.splitlines()
    assert line == (
        f"kvsidecar: permission denied listing {shm}: run kvsidecar as the engine's user or "
        "in its group (the agent creates the directory 0750)"
    )


class _Targets:
    def __init__(self, error: str = "") -> None:
        self.discovery_error = error

    def views(self) -> list:
        return []

    def poll_all(self) -> None:
        pass


def test_watch_on_a_removed_directory_says_who_creates_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: any missing directory 'does not exist yet (the agent creates it when the
    first engine starts)'; the agent creates only the default one."""
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    gone = tmp_path / "removed"
    dump_mod._watch(_Targets(), str(gone), 0.1, 1, False)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert f"{gone} does not exist (the agent creates only the default /dev/shm/kvsidecar" in out
    assert "yet" not in out, out
    # The default one the agent does create (tests/test_operator_nits.py: "yet").
    # A directory that became unreadable while watched says why, not "0 segments".
    why = f"cannot list {tmp_path}: Permission denied (EACCES)"
    dump_mod._watch(_Targets(why), str(tmp_path), 0.1, 1, False)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert why in out and "0 segments" not in out, out


@pytest.mark.parametrize("built", ["20200102-03:04:05", "unknown"])
def test_man_page_date_is_the_build_date_never_today(
    monkeypatch: pytest.MonkeyPatch, built: str
) -> None:
    """Before: a build without a date (`--version`: build date unknown) got today's."""
    monkeypatch.setattr(manpage, "build_date", lambda: built)
    with click.Context(main, info_name="kvsidecar") as ctx:
        page = manpage.render(ctx)
    th = page.splitlines()[0]
    want = "2020-01-02" if built[0].isdigit() else ""
    assert th == f'.TH "KVSIDECAR" 1 "{want}" "kvsidecar 0.1.0" "User Commands"', th
    assert datetime.date.today().isoformat() not in th


# promslog's own check of its default (slog) style, prometheus/common promslog/slog_test.go.
PROMSLOG = re.compile(r"(?P<TimeKey>time)=.*level=(?P<LevelValue>WARN|INFO|ERROR|DEBUG).*"
                      r"(?P<SourceKey>source)=.*")  # fmt: skip


@pytest.mark.parametrize("fmt", ["logfmt", "json"])
def test_log_levels_are_upper_case_as_promslog_writes_them(shm_dir: str, fmt: str) -> None:
    w = SegmentWriter("kvsidecar.log.dp0.tp0.pp0", shm_dir=shm_dir)
    w.publish(sample_snapshot(1))
    daemon, url = start_daemon(
        shm_dir, "--log.level", "debug", "--log.format", fmt, stderr=subprocess.PIPE, text=True
    )
    try:
        assert wait_for(lambda: fetch(url + "/-/ready")[0] == 200, timeout=60)
    finally:
        daemon.terminate()
        _, err = daemon.communicate(timeout=30)
        w.close()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if fmt == "json":
        levels = [json.loads(ln)["level"] for ln in lines]
    else:
        assert lines and all(PROMSLOG.match(ln) for ln in lines), lines
        levels = [PROMSLOG.match(ln)["LevelValue"] for ln in lines]  # type: ignore[index]
    assert {"DEBUG", "INFO"} <= set(levels) <= {"DEBUG", "INFO", "WARN", "ERROR"}, levels
