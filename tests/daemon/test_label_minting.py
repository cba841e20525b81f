"""Short-lived files of a trusted uid must not mint `segment` labels at their own rate
(issue 24): on 0704fc0 every valid segment living a few scans became a label (1,828 in
20 s in the audit). New names are admitted by a token bucket (kvsidecar/daemon/admission.py):
--max-new-targets at once, then one per --new-target-interval, live and longest-followed
first; a name exported before costs nothing. Real segments, a real daemon, a real churner.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

from kvsidecar import settings
from kvsidecar.daemon.admission import Admission
from kvsidecar.daemon.config import Discovery
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol.writer import SegmentWriter
from tests.attacks import hostile_writers as hw
from tests.attacks.labels import start_churn
from tests.support.procs import start_writer, wait_for
from tests.support.protocol_helpers import sample_snapshot
from tests.support.scrape import fetch, samples, value

ENGINE = "kvsidecar.vllm.dp0.tp0.pp0"
REDISCOVER = 0.2


@contextlib.contextmanager
def serving(shm_dir: str, *args: str) -> Iterator[str]:
    with hw._daemon(shm_dir, "--poll-interval", "0.05", *args) as (_, url):
        yield url


def _segments(text: str) -> set[str]:
    return {lab["segment"] for _, lab, _ in samples(text) if "segment" in lab}


def test_short_lived_trusted_files_mint_a_bounded_number_of_labels(shm_dir: str) -> None:
    """A churner of our own uid: valid segments under fresh names, each living 1.5-3
    rediscover intervals, 50 a second for 12 s; a real engine starts 2 s in. Distinct
    `segment` labels across back-to-back scrapes stay within the default burst plus the
    refill (about 600 on 0704fc0), and the engine is served while the churn goes on."""
    burst = settings.MAX_NEW_TARGETS.default
    interval = settings.NEW_TARGET_INTERVAL.default
    engine = None
    try:
        with serving(shm_dir, "--rediscover-interval", str(REDISCOVER)) as url:
            t0 = time.monotonic()
            churn = start_churn(shm_dir, 12.0, 0.02, (1.5 * REDISCOVER, 3 * REDISCOVER))
            seen: set[str] = set()
            started = served = None
            waiting_seen = 0.0
            while churn.poll() is None:
                if engine is None and time.monotonic() - t0 >= 2.0:
                    engine, _ = start_writer(ENGINE, shm_dir, period=0.01)
                    started = time.monotonic()
                text = fetch(url + "/metrics")[2]
                seen |= _segments(text)
                waiting_seen = max(waiting_seen, value(text, "kvsidecar_targets_waiting") or 0)
                if served is None and value(text, "kvsidecar_source_up", segment=ENGINE) == 1:
                    served = time.monotonic()
            elapsed = time.monotonic() - t0
            files = int(churn.stdout.read()) if churn.stdout else 0
            text = fetch(url + "/metrics")[2]
            seen |= _segments(text)
            churned = seen - {ENGINE}
            # Tokens: the burst, one per interval of the run, one spare for rounding.
            bound = burst + elapsed / interval + 1
            assert files > 3 * bound, files  # the churn really outran the bucket
            assert len(churned) <= bound, (len(churned), files, sorted(churned)[:5])
            assert waiting_seen >= 1  # the ones held back were visible as a count
            assert value(text, "kvsidecar_segment_refusals_total", reason="admission") >= 1
            # Served while the churn still ran (expected within ~one interval after it
            # outlived the churned files: ~4 s of the 10 s it had, polls lagging on a
            # loaded host included); not starved behind the churn.
            assert served is not None and started is not None, "engine not served during churn"
            assert value(text, "kvsidecar_source_up", segment=ENGINE) == 1
    finally:
        if engine is not None:
            engine.kill()
            engine.wait()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _publish(shm_dir: str, name: str, step: int = 1) -> SegmentWriter:
    w = SegmentWriter(name, shm_dir=shm_dir)
    w.publish(sample_snapshot(step))
    return w


def _shown(ts: TargetSet) -> set[str]:
    return {v.name for v in ts.views()}


def test_a_known_name_returning_costs_no_token(shm_dir: str) -> None:
    """An engine restarted under its own name (the agent's names are deterministic) brings
    back the same series: admitted at once even with no token left; a new name waits."""
    clock = Clock()
    ts = TargetSet(
        Discovery(shm_dir, prefix="kvsidecar.", rediscover_interval=0.0),
        admission=Admission(1, 10, clock=clock),
    )
    w = _publish(shm_dir, ENGINE)
    ts.poll_all()
    assert _shown(ts) == {ENGINE}
    w.close()
    ts.poll_all()
    assert ENGINE not in ts.targets  # forgotten with its file
    for restart in range(3):  # crash-looping: each time served at once, never a token
        w = _publish(shm_dir, ENGINE, step=restart + 2)
        other = _publish(shm_dir, f"kvsidecar.fresh{restart}.dp0.tp0.pp0")
        ts.poll_all()
        assert _shown(ts) == {ENGINE}, _shown(ts)
        assert ts.waiting == 1
        w.close()
        other.close()
        ts.poll_all()
    assert ts.refusals_total.get("admission") == 3  # each fresh name counted once
    assert ts.waiting == 0


def test_live_and_longest_followed_targets_go_first(shm_dir: str) -> None:
    """With one token per interval, the oldest live candidate gets it: not a younger one,
    not an older file that was never up; a file gone while waiting was never exported."""
    clock = Clock()
    ts = TargetSet(
        Discovery(shm_dir, prefix="kvsidecar.", rediscover_interval=0.0, confirm_after=0.0),
        admission=Admission(1, 10, clock=clock),
    )
    first = _publish(shm_dir, "kvsidecar.first.dp0.tp0.pp0")
    ts.poll_all()  # takes the only token
    open(os.path.join(shm_dir, "kvsidecar.junk.dp0.tp0.pp0"), "wb").close()  # never up
    ts.poll_all()
    time.sleep(0.01)  # admitted_mono: strictly older than the next ones
    old = _publish(shm_dir, "kvsidecar.old.dp0.tp0.pp0")
    ts.poll_all()
    time.sleep(0.01)
    young = _publish(shm_dir, "kvsidecar.young.dp0.tp0.pp0")
    short = _publish(shm_dir, "kvsidecar.short.dp0.tp0.pp0")
    ts.poll_all()
    assert _shown(ts) == {"kvsidecar.first.dp0.tp0.pp0"}
    assert ts.waiting == 4
    short.close()  # dies while waiting
    clock.now += 10  # one token
    ts.poll_all()
    assert _shown(ts) == {"kvsidecar.first.dp0.tp0.pp0", "kvsidecar.old.dp0.tp0.pp0"}
    clock.now += 10
    ts.poll_all()
    assert "kvsidecar.young.dp0.tp0.pp0" in _shown(ts)
    clock.now += 10
    ts.poll_all()
    assert "kvsidecar.junk.dp0.tp0.pp0" in _shown(ts)  # last: it was never up
    assert "kvsidecar.short.dp0.tp0.pp0" not in _shown(ts)
    assert ts.waiting == 0
    for w in (first, old, young):
        w.close()


def test_refill_and_the_bounded_memory_of_known_names() -> None:
    clock = Clock()
    a = Admission(2, 5, names=3, clock=clock)
    assert a.admit(["a", "b", "c"]) == ["a", "b"]  # the burst
    assert a.admit(["c"]) == []
    clock.now += 4.9
    assert a.admit(["c"]) == []  # not a whole token yet
    clock.now += 0.1
    assert a.admit(["c", "d"]) == ["c"]
    clock.now += 3600  # idle: the bucket holds the burst, not an hour of tokens
    assert a.admit(["d", "e", "f"]) == ["d", "e"]
    # 3 names remembered: a, b and c were pushed out, so a returning costs a token again.
    assert not a.known("a") and a.known("e")
    assert a.admit(["a", "e"]) == ["e"]


def test_burst_serves_a_whole_node_at_once(shm_dir: str) -> None:
    """The default burst: 64 ranks starting together are all exported on the first poll."""
    writers = [_publish(shm_dir, f"kvsidecar.node.dp{i}.tp0.pp0") for i in range(64)]
    try:
        ts = TargetSet(Discovery(shm_dir, prefix="kvsidecar."), admission=Admission())
        ts.poll_all()
        assert len(ts.views()) == 64 and ts.waiting == 0
    finally:
        for w in writers:
            w.close()


def test_serve_takes_the_admission_flags(shm_dir: str) -> None:
    """--max-new-targets 1: a second new name waits, and /-/ready says so."""
    writers = [_publish(shm_dir, f"kvsidecar.two.dp{i}.tp0.pp0") for i in range(2)]
    args = ("--max-new-targets", "1", "--new-target-interval", "3600")
    try:
        with serving(shm_dir, *args) as url:
            text = ""

            def one_waits() -> bool:
                nonlocal text
                text = fetch(url + "/metrics")[2]
                return value(text, "kvsidecar_targets_waiting") == 1

            assert wait_for(one_waits)
            assert len(_segments(text)) == 1
            code, _, body = fetch(url + "/-/ready")
            assert code == 200 and "1 new segment(s) waiting for admission" in body, body
    finally:
        for w in writers:
            w.close()
