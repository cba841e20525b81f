"""Issue 33 item 7: ls and dump print each bad file once (the table row, not also the
daemon's per-segment log line); `dump --watch` says when its directory is gone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvsidecar.cli import dump as dump_mod

KVSIDECAR = str(Path(sys.executable).parent / "kvsidecar")


@pytest.mark.parametrize("command", ["ls", "dump"])
def test_a_bad_file_shows_once(tmp_path: Path, command: str) -> None:
    (tmp_path / "kvsidecar.bad.1").write_bytes(b"\0" * 100)  # an impossible size: corrupt
    r = subprocess.run(
        [KVSIDECAR, command, "--shm-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    both = r.stdout + r.stderr
    assert "corrupt" in r.stdout, both
    # The name appears in the row's SEGMENT column and inside its error text (the path).
    rows = [ln for ln in both.splitlines() if "kvsidecar.bad.1" in ln]
    assert len(rows) == 1, both


class _NoTargets:
    def views(self) -> list:
        return []

    def poll_all(self) -> None:
        pass


def test_watch_says_the_directory_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    gone = tmp_path / "removed"
    dump_mod._watch(_NoTargets(), str(gone), 0.1, 1, False)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert "does not exist" in out and "0 segments" not in out, out
    capsys.readouterr()
    dump_mod._watch(_NoTargets(), str(tmp_path), 0.1, 1, False)  # type: ignore[arg-type]
    assert "0 segments" in capsys.readouterr().out
