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


def _series(start: float, n: int = 200) -> dict[str, list[float]]:
    t = [start + 0.1 * i for i in range(n)]
    rise = [min(i, 40) for i in range(n)]
    return {
        "t": t, "start": [start], "total_blocks": [64] * n, "allocated_blocks": rise,
        "cached_blocks": [64 - r for r in rise], "deferred_free_blocks": [r // 2 for r in rise],
        "deferred_free_requests": [r // 8 for r in rise],
        "requests_running": [1] * n, "requests_waiting": [0] * n,
    }  # fmt: skip


def test_arrivals_stop_label_clears_every_title(tmp_path) -> None:
    """Issue 45 item 5: the "arrivals stop" label sat above the top panel, across its title.
    The quickstart's geometry: arrivals stop at 10 s of a 20 s run."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvsidecar.agent.demo.plot import plot

    data = {"prefill": _series(1000.0), "decode": _series(1000.5)}
    title = "kvsidecar demo --pd: 8 req/s, transfer delay 1 s, 100 ms samples of /api/v1/snapshots"
    plot(data, str(tmp_path / "pd.png"), title, 10.0)
    fig = plt.gcf()
    try:
        renderer = fig.canvas.get_renderer()
        top = fig.axes[0]
        (label,) = [t for t in top.texts if "arrivals stop" in t.get_text()]
        box = label.get_window_extent(renderer)
        titles = [fig._suptitle, top.title, top._left_title, top._right_title]
        for other in (t for t in titles if t is not None and t.get_text()):
            assert not box.overlaps(other.get_window_extent(renderer)), other.get_text()
        assert top.get_window_extent(renderer).contains(box.x0, box.y0), box
    finally:
        plt.close(fig)
