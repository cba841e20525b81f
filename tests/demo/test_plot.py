"""The quickstart's plot command (issue #23 item 3): its clock starts when the engines are up
(a short run still gets samples however long torch takes to import) and it creates its
output folder. A real `kvsidecar demo --pd` under it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.timeout(240)
def test_plot_runs_its_duration_after_startup_into_a_new_folder(tmp_path) -> None:
    out = tmp_path / "new" / "folder" / "pd.png"
    # 2 s of run: less than the engines' start-up on this host, so a clock started at
    # launch would end the run before the first sample.
    r = subprocess.run(
        [sys.executable, "-m", "kvsidecar.agent.demo.plot", "--out", str(out),
         "--duration", "2", "--arrivals", "1", "--interval", "0.1"],
        capture_output=True, text=True, timeout=220, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert out.stat().st_size > 0
    counts = [int(ln.split(": ")[1].split()[0]) for ln in r.stdout.splitlines() if " samples" in ln]
    # 2 s at 100 ms: about 20 samples per rank; at least a few even on a loaded host.
    assert len(counts) == 2 and min(counts) >= 3, r.stdout


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path) -> None:
    """`make run` alone does not install matplotlib: one line naming the fix, before any run."""
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from kvsidecar.agent.demo.plot import main\n"
        f"sys.exit(main(['--out', {str(tmp_path / 'x.png')!r}]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "python -m kvsidecar.agent.demo.plot: matplotlib is not installed: run `make venv` "
        "(the dev extra) first"
    ]
