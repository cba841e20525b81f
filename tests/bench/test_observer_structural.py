"""The observer claim, exact and timing-free: a kvsidecar scrape does no work in the engine.

The engine is a real process running the agent (`kvsidecar.agent.bench.cost_engine`),
idle between commands: blocked reading its stdin, so it runs only if something wakes
it. While the real daemon is scraped, `proccount.observer_violations` checks that the
engine holds no socket, that its counters (CPU, context switches, read/write syscalls
and bytes) do not move at all over N scrapes, and that with the engine SIGSTOPped every
scrape is still answered with its last snapshot. No bound on time anywhere: each fact is
an equality. The same checker run against an engine that serves scrapes itself (the
in-process prometheus_client exporter) must report violations, or the check proves
nothing.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable

import pytest

from kvsidecar.bench import proccount
from kvsidecar.bench.cost import EngineProc
from kvsidecar.bench.fleet import start_daemon, stop_daemon

SCRAPES = 30


def _scraper(url: str, timeout: float) -> Callable[[], bytes | None]:
    def scrape() -> bytes | None:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return r.read()
        except OSError:
            return None

    return scrape


def _idle(engine: EngineProc) -> None:
    # Readiness, not a bound: poll until the engine sits in its read of stdin.
    deadline = time.monotonic() + 60
    while not proccount.blocked_reading(engine.pid):
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.01)


@pytest.fixture
def shm(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("shm"))


def test_scrapes_leave_the_engine_untouched(shm: str) -> None:
    engine = EngineProc(shm, exporter=False)
    daemon = None
    try:
        step = engine.run("kvsidecar", 20)["step"]
        daemon, url = start_daemon(shm)
        scrape = _scraper(f"{url}/metrics", timeout=30)
        body = scrape()
        assert body is not None
        line = next(x for x in body.splitlines() if x.startswith(b"kvsidecar_engine_steps_total{"))
        assert float(line.rsplit(b" ", 1)[1]) == step, line  # the engine's last snapshot
        _idle(engine)
        assert proccount.observer_violations(engine.pid, scrape, SCRAPES, line) == []
    finally:
        if daemon is not None:
            stop_daemon(daemon)
        engine.close()


def test_the_check_fails_for_an_engine_that_serves_scrapes(shm: str) -> None:
    engine = EngineProc(shm, exporter=True)
    try:
        engine.run("prometheus_client", 20)
        url = f"http://127.0.0.1:{engine.hello['exporter_port']}/metrics"
        _idle(engine)
        # A short timeout only makes the stopped engine's refusal quick; any value works.
        found = proccount.observer_violations(
            engine.pid, _scraper(url, timeout=1), SCRAPES, b"engine_runtime_step"
        )
    finally:
        engine.close()
    text = "\n".join(found)
    assert "socket" in found[0], text
    assert "counters moved" in text and "voluntary_ctxt" in text, text
    assert "unanswered while the engine was stopped" in text, text
