"""Faults injected under a running daemon (a real process): it follows, refuses, keeps serving."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvsidecar.bench.fleet import fd_count, map_count
from kvsidecar.protocol import layout
from tests.conftest import REPO
from tests.support.procs import start_daemon, wait_for
from tests.support.scrape import fetch, samples, value
from tests.support.writers import fork_writer, stop

GOOD = "kvsidecar.good.dp0.tp0.pp0"


def metrics(url: str) -> str:
    return fetch(url + "/metrics")[2]


@pytest.fixture
def served(shm_dir: str):
    """A daemon over shm_dir with one healthy writer that must stay up through every fault."""
    good = fork_writer(GOOD, shm_dir)
    daemon, url = start_daemon(
        shm_dir, "--poll-interval", "0.05", "--rediscover-interval", "0.05", "--stale-after", "2"
    )
    assert wait_for(lambda: value(metrics(url), "kvsidecar_source_up", segment=GOOD) == 1)
    yield daemon, url
    assert value(metrics(url), "kvsidecar_source_up", segment=GOOD) == 1  # never disturbed
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(10) == 0
    stop(good)


def test_writer_restarted_100_times_is_followed_without_leaks(shm_dir: str, served) -> None:
    daemon, url = served
    name = "kvsidecar.restart.dp0.tp0.pp0"
    pid = fork_writer(name, shm_dir)
    assert wait_for(lambda: value(metrics(url), "kvsidecar_source_up", segment=name) == 1)
    fds, maps = fd_count(daemon.pid), map_count(daemon.pid)
    for i in range(1, 101):
        stop(pid)
        pid = fork_writer(name, shm_dir, steps_from=1)
        # Followed: the new incarnation is seen (the generation counts restarts).
        assert wait_for(
            lambda i=i: value(metrics(url), "kvsidecar_source_generation", segment=name) == i + 1,
        ), i
    text = metrics(url)
    assert value(text, "kvsidecar_source_writer_restarts_total", segment=name) == 100
    # The counter reset is visible: steps restarted from 1 in the last incarnation.
    assert value(text, "kvsidecar_engine_steps_total", segment=name) < 1000
    stop(pid)
    time.sleep(0.3)
    assert fd_count(daemon.pid) <= fds + 1  # +1: a scrape's socket may be open
    assert map_count(daemon.pid) <= maps + 2


def test_unlinked_segment_is_forgotten(shm_dir: str, served) -> None:
    _, url = served
    name = "kvsidecar.unlinked.dp0.tp0.pp0"
    pid = fork_writer(name, shm_dir)
    assert wait_for(lambda: value(metrics(url), "kvsidecar_source_up", segment=name) == 1)
    os.unlink(os.path.join(shm_dir, name))  # while the writer lives and we are attached
    assert wait_for(lambda: value(metrics(url), "kvsidecar_source_up", segment=name) is None)
    stop(pid)


def test_truncated_bad_magic_newer_major_and_minor(shm_dir: str, served) -> None:
    _, url = served
    names = {k: f"kvsidecar.{k}.dp0.tp0.pp0" for k in ("trunc", "magic", "major", "minor")}
    pids = [fork_writer(n, shm_dir) for n in names.values()]
    try:
        for n in names.values():
            assert wait_for(lambda n=n: value(metrics(url), "kvsidecar_source_up", segment=n) == 1)
        os.truncate(os.path.join(shm_dir, names["trunc"]), layout.PAGE)
        with open(os.path.join(shm_dir, names["magic"]), "r+b") as f:
            f.write(b"NOTASEG!")
        with open(os.path.join(shm_dir, names["major"]), "r+b") as f:
            f.seek(layout.OFF_MAJOR)
            f.write((layout.LAYOUT_MAJOR + 1).to_bytes(2, "little"))
        with open(os.path.join(shm_dir, names["minor"]), "r+b") as f:
            f.seek(layout.OFF_MINOR)
            f.write((layout.LAYOUT_MINOR + 1).to_bytes(2, "little"))
        # Each is seen on the next read of the attached segment, not only at attach time.
        expected = {"trunc": "corrupt", "magic": "corrupt", "major": "refused"}
        for key, state in expected.items():
            assert wait_for(
                lambda k=key, st=state: (
                    value(metrics(url), "kvsidecar_source_state", segment=names[k], state=st) == 1
                )
            ), key
        text = metrics(url)
        for key in expected:
            assert value(text, "kvsidecar_kv_pool_allocated_blocks", segment=names[key]) is None
        assert value(text, "kvsidecar_source_up", segment=names["minor"]) == 1  # newer minor
    finally:
        for p in pids:
            stop(p)


def test_bad_files_at_discovery_are_refused_with_a_reason(shm_dir: str, served) -> None:
    daemon, url = served
    base = os.path.join(shm_dir, "kvsidecar.")
    os.symlink(os.path.join(shm_dir, GOOD), base + "symlink")
    os.mkfifo(base + "fifo")
    with open(os.path.join(shm_dir, GOOD), "rb") as f:
        good = bytearray(f.read())
    magic = bytearray(good)
    magic[0:8] = b"BADMAGIC"
    (major := bytearray(good))[layout.OFF_MAJOR] = layout.LAYOUT_MAJOR + 1
    for suffix, content in (
        ("magic", magic),
        ("major", major),
        ("short", b"x" * 100),
        ("huge", b""),
    ):
        with open(base + suffix, "wb") as f:
            f.write(content)
    os.truncate(base + "huge", layout.MAX_SEGMENT_SIZE + layout.PAGE)
    text = ""

    def settled() -> bool:
        nonlocal text
        text = metrics(url)
        # New targets with no good reading show after one rediscover interval (a file
        # that vanishes sooner mints nothing).
        corrupt = [
            value(text, "kvsidecar_source_state", segment="kvsidecar." + s, state="corrupt")
            for s in ("magic", "short", "huge")
        ]
        return value(text, "kvsidecar_refused_segments") == 3 and None not in corrupt

    assert wait_for(settled), text
    # Refused (symlink, fifo, major): not targets, so they mint no series.
    for suffix in ("symlink", "fifo", "major"):
        assert value(text, "kvsidecar_source_up", segment="kvsidecar." + suffix) is None
    # Corrupt regular files are targets in state corrupt, exporting health only.
    for suffix in ("magic", "short", "huge"):
        assert (
            value(text, "kvsidecar_source_state", segment="kvsidecar." + suffix, state="corrupt")
            == 1
        )
    assert daemon.poll() is None


def test_foreign_uid_refused_unless_allowed(shm_dir: str) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to chown a segment to another uid")
    name = "kvsidecar.foreign.dp0.tp0.pp0"
    pid = fork_writer(name, shm_dir)
    os.chown(os.path.join(shm_dir, name), 4321, -1)
    try:
        daemon, url = start_daemon(shm_dir, "--poll-interval", "0.05")
        assert wait_for(lambda: value(metrics(url), "kvsidecar_refused_segments") == 1)
        assert value(metrics(url), "kvsidecar_source_up", segment=name) is None
        daemon.kill()
        daemon, url = start_daemon(shm_dir, "--poll-interval", "0.05", "--allow-uid", "4321")
        assert wait_for(lambda: value(metrics(url), "kvsidecar_source_up", segment=name) == 1)
        daemon.kill()
    finally:
        stop(pid)


def test_64_segments_appearing_and_disappearing(shm_dir: str, served) -> None:
    daemon, url = served
    fds = fd_count(daemon.pid)
    for wave in range(3):
        pids = [
            fork_writer(f"kvsidecar.wave.dp{i}.tp0.pp0", shm_dir, period=0.05) for i in range(64)
        ]
        assert wait_for(lambda: value(metrics(url), "kvsidecar_sources") == 65, timeout=10), wave

        def all_up() -> bool:
            ups = [
                (lab["segment"], v)
                for n, lab, v in samples(metrics(url))
                if n == "kvsidecar_source_up" and lab["segment"].startswith("kvsidecar.wave")
            ]
            return len(ups) == 64 and all(v == 1 for _, v in ups)

        assert wait_for(all_up, timeout=10)
        for p in pids:
            stop(p, signal.SIGTERM)  # a clean exit unlinks each segment
        assert wait_for(lambda: value(metrics(url), "kvsidecar_sources") == 1, timeout=10)
    time.sleep(0.2)
    assert fd_count(daemon.pid) <= fds + 1


def test_daemon_sigkilled_and_restarted_while_the_engine_runs(shm_dir: str) -> None:
    """The engine's steps do not slow down when its daemon dies or comes back."""
    engine = subprocess.Popen(
        [sys.executable, "-m", "tests.support.agent_loop", shm_dir, "500"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        name = engine.stdout.readline().split()[1]
        daemon, url = start_daemon(shm_dir, "--poll-interval", "0.05")

        def steps() -> float:
            return value(metrics(url), "kvsidecar_engine_steps_total", segment=name) or 0.0

        def rate(seconds: float = 1.0) -> float:
            a = steps()
            time.sleep(seconds)
            return (steps() - a) / seconds

        assert wait_for(lambda: steps() > 0)
        before = rate()
        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
        time.sleep(1.0)  # the engine runs on with no daemon at all
        daemon, url = start_daemon(shm_dir, "--poll-interval", "0.05")
        assert wait_for(lambda: steps() > 0)  # reattached
        after = rate()
        # Same loop, same rate (the sleep-paced loop targets 500 steps/s).
        assert after > 0.7 * before, (before, after)
        daemon.kill()
    finally:
        engine.kill()
        engine.wait()
