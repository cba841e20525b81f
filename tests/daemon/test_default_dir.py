"""The private default directory (created by the agent with the first engine): its absence
is "no segment yet" for the daemon and the debugging commands, never an error or an exit."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from click.testing import CliRunner

from kvsidecar.cli.main import main
from kvsidecar.daemon import scan as scan_mod
from kvsidecar.daemon.config import Discovery
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol.writer import SegmentWriter
from tests.support.protocol_helpers import sample_snapshot


@pytest.fixture
def missing_default(monkeypatch: pytest.MonkeyPatch):
    parent = tempfile.mkdtemp(prefix="kvsidecar-default-", dir="/dev/shm")
    path = os.path.join(parent, "kvsidecar")  # not created: no engine has started yet
    monkeypatch.setattr(scan_mod, "DEFAULT_SHM_DIR", path)
    yield path
    shutil.rmtree(parent, ignore_errors=True)


def test_missing_default_directory_is_no_segments_then_a_segment(missing_default: str) -> None:
    ts = TargetSet(Discovery(missing_default, prefix="kvsidecar.", rediscover_interval=0.0))
    ts.poll_all()
    assert ts.targets == {} and ts.discovery_error == "" and ts.discovery_errors_total == {}
    os.mkdir(missing_default, 0o750)  # what the agent does when the first engine starts
    with SegmentWriter("kvsidecar.eng.dp0.tp0.pp0", shm_dir=missing_default) as w:
        w.publish(sample_snapshot(3))
        ts.poll_all()
        assert list(ts.targets) == ["kvsidecar.eng.dp0.tp0.pp0"]


def test_a_missing_directory_that_was_named_is_still_an_error(tmp_path) -> None:
    gone = str(tmp_path / "typo")
    ts = TargetSet(Discovery(gone, prefix="kvsidecar.", rediscover_interval=0.0))
    ts.poll_all()
    assert "cannot list" in ts.discovery_error
    result = CliRunner().invoke(main, ["dump", "--shm-dir", gone])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_a_clean_close_is_logged_as_one_not_as_a_crash(shm_dir: str, caplog) -> None:
    import logging

    ts = TargetSet(Discovery(shm_dir, prefix="kvsidecar.", rediscover_interval=3600.0))
    w = SegmentWriter("kvsidecar.eng.dp0.tp0.pp0", shm_dir=shm_dir)
    w.publish(sample_snapshot(3))
    ts.poll_all()
    assert ts.targets["kvsidecar.eng.dp0.tp0.pp0"].view.state == "up"
    w.close()  # CLOSED, then unlinked
    with caplog.at_level(logging.INFO, logger="kvsidecar"):
        ts.poll_all()
        ts.poll_all()  # stays "closed cleanly", not "not found" on the next poll
    view = ts.targets["kvsidecar.eng.dp0.tp0.pp0"].view
    assert view.state == "dead" and "closed cleanly" in view.error
    transitions = [r for r in caplog.records if "up -> dead" in r.getMessage()]
    assert len(transitions) == 1 and transitions[0].levelno == logging.INFO
    assert "not found" not in transitions[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture
def default_dir(monkeypatch: pytest.MonkeyPatch):
    parent = tempfile.mkdtemp(prefix="kvsidecar-default-", dir="/dev/shm")
    path = os.path.join(parent, "kvsidecar")
    monkeypatch.setattr(scan_mod, "DEFAULT_SHM_DIR", path)
    yield path
    shutil.rmtree(parent, ignore_errors=True)


def _warnings(path: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    import logging

    ts = TargetSet(Discovery(path, prefix="kvsidecar.", allowed_uids=frozenset({os.geteuid()})))
    with caplog.at_level(logging.WARNING, logger="kvsidecar.daemon"):
        for _ in range(3):
            ts.discover()
    ts.stop()
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(path)]


@pytest.mark.parametrize("shape", ["symlink", "foreign_owner"])
def test_a_default_directory_someone_else_made_is_warned_of_once(
    default_dir: str, shape: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 31 item 11: /dev/shm is everyone's; whoever creates /dev/shm/kvsidecar first
    (a symlink elsewhere, or a directory of their own) chose where segments are read from.
    bca725e said nothing."""
    if shape == "symlink":
        real = default_dir + ".elsewhere"
        os.mkdir(real, 0o750)
        os.symlink(real, default_dir)
        expected = f"{default_dir} is a symlink to {real}"
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to create a directory of another uid")
        os.mkdir(default_dir, 0o750)
        os.chown(default_dir, 54321, 54321)
        expected = f"{default_dir} is owned by uid 54321"
    said = _warnings(default_dir, caplog)
    assert len(said) == 1 and said[0].startswith(expected), said


def test_our_own_default_directory_is_not_warned_of(
    default_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    os.mkdir(default_dir, 0o750)
    assert _warnings(default_dir, caplog) == []
