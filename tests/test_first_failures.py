"""The two likeliest first-install failures tell one story everywhere (issue 33 item 1):
the daemon not in the engine's group (reason ``unreadable``) and the engine's uid not
trusted (reason ``foreign_owner``). Each is reproduced with a real daemon; /metrics has the
by-reason series, /-/ready names the refusal, the first-look grep of docs/operations.md
shows it, and the troubleshooting row for it names that series."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from kvsidecar.protocol.writer import SegmentWriter
from tests.conftest import REPO
from tests.support.procs import start_daemon, wait_for
from tests.support.protocol_helpers import sample_snapshot
from tests.support.scrape import fetch, value

OPERATIONS = Path(REPO) / "docs" / "operations.md"
NAME = "kvsidecar.first.dp0.tp0.pp0"
OTHER = 4242  # the engine's (or the daemon's) uid that is not ours


def _first_look_pattern() -> re.Pattern[str]:
    text = OPERATIONS.read_text()
    [cmd] = re.findall(r"`(curl -s localhost:\d+/metrics \| grep -E [^`]+)`", text)
    return re.compile(shlex.split(cmd.split("|", 1)[1])[-1])


def _without_dac_override() -> None:
    """In the child before exec: drop CAP_DAC_OVERRIDE (1) and CAP_DAC_READ_SEARCH (2) from
    the bounding set, so root after exec obeys file modes like the daemon's own user."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _row(reason: str) -> str:
    rows = [ln for ln in OPERATIONS.read_text().splitlines() if ln.startswith("| ")]
    want = f'kvsidecar_refused_segments_by_reason{{reason="{reason}"}}'
    return next(r for r in rows if want in r.split(" | ")[0])


@pytest.mark.skipif(os.geteuid() != 0, reason="makes files of another uid")
@pytest.mark.parametrize("reason", ["foreign_owner", "unreadable"])
def test_first_failure_tells_one_story(tmp_path: Path, reason: str) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(shm, 0o755)
    w = SegmentWriter(NAME, shm_dir=str(shm))
    w.publish(sample_snapshot(3))
    path = shm / NAME
    if reason == "foreign_owner":
        os.chown(path, OTHER, OTHER)  # the engine's uid, not passed with --allow-uid
        popen: dict = {}
        extra: tuple[str, ...] = ()
    else:
        # The engine's trusted uid, but the daemon not in its group: a 0640 file it cannot
        # open. The tests run as root, so the daemon loses root's read-anything capabilities.
        os.chown(path, OTHER, OTHER)
        popen = {"preexec_fn": _without_dac_override}
        extra = ("--allow-uid", str(OTHER))
    daemon, url = start_daemon(str(shm), "--poll-interval", "0.05", *extra, **popen)
    try:
        text = ""

        def refused() -> bool:
            nonlocal text
            text = fetch(url + "/metrics")[2]
            return value(text, "kvsidecar_refused_segments_by_reason", reason=reason) == 1

        assert wait_for(refused, timeout=60), text
        assert NAME not in text, "a file name is never a label value"
        status, _, body = fetch(url + "/-/ready")
        assert status == 200 and f"no segment up; 1 refused ({reason})" in body, body
    finally:
        daemon.kill()
        daemon.wait(30)
        w.close()
    shown = [ln for ln in text.splitlines() if _first_look_pattern().search(ln)]
    assert any(ln.startswith("kvsidecar_sources 0") for ln in shown), shown
    assert any(f'kvsidecar_refused_segments_by_reason{{reason="{reason}"}} 1' in ln
               for ln in shown), shown  # fmt: skip
    assert f"1 refused ({reason})" in _row(reason)
