"""``kvsidecar --help`` loads the command line only: no daemon, exporter or torch code."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

HEAVY = ("prometheus_client", "msgspec", "torch")


def test_help_imports_no_exporter_msgspec_or_torch() -> None:
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kvsidecar", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "serve" in r.stdout and "dump" in r.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if "|" in line}
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
    assert not any(m.startswith("kvsidecar.daemon") for m in imported), sorted(imported)


def test_selfcheck_help_states_the_torn_start_timeout() -> None:
    from kvsidecar.bench import torn
    from kvsidecar.cli import selfcheck

    assert selfcheck.START_TIMEOUT == torn.START_TIMEOUT
