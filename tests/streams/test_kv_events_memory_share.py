"""The KV-event publishers' share of the daemon's memory (#43 item 8,
kvsidecar/streams/kv_events_budget.py): the sum of what the published segments cost stays
within `--kv-events.memory-bytes`, however many segments an engine makes and however big.

Before it every segment was published whatever its size: 8 segments of 12,500 slots took
the daemon to 90.1 MiB anonymous with every reader kind at once, 1 of 1M slots to 97.5-105.7
(docs/kv-events.md, "Memory"), over the 64Mi the sidecar is shipped with.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("zmq", reason="pyzmq (the kvevents extra, in the dev set) is missing")

import zmq

from kvsidecar.bench.fleet import free_port
from kvsidecar.daemon.config import KVEventsOptions
from kvsidecar.protocol import kv_events_layout as kvl
from kvsidecar.protocol.kv_events_writer import KVEventsWriter
from kvsidecar.streams import kv_events_budget as kb
from kvsidecar.streams import kv_events_zmq as kz
from tests.attacks import kv_events_memory as kvm
from tests.attacks.all_readers import listening
from tests.support.kv_chains import store_chains
from tests.support.procs import start_daemon, wait_for

OPS = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "release"]),
        st.sampled_from("abcde"),
        st.integers(0, 300_000),
        st.integers(0, 300_000),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(0, 64 * kb.MIB), ops=OPS)
def test_admitted_segments_never_cost_more_than_the_budget(limit: int, ops: list) -> None:
    """Brute force: after any sequence of reservations and releases, what is held is
    exactly the admitted segments' costs, their sum within the limit; a reservation is
    refused exactly when the others' share and its cost would pass the limit, and the
    refusal names the flag and the shortfall, which raising the limit by admits."""
    budget = kb.MemoryBudget(limit)
    held: dict[str, int] = {}
    for op, name, n_slots, cached in ops:
        cached = min(cached, n_slots)
        if op == "release":
            budget.release(name)
            held.pop(name, None)
            continue
        held.pop(name, None)  # a resize: its old share is not counted against it
        others = sum(kb.cost(*n) for n in held.values())
        refusal = budget.reserve(name, n_slots, cached)
        fits = others + kb.cost(n_slots, cached) <= limit
        assert (refusal is None) == fits, (others, n_slots, limit, refusal)
        if fits:
            held[name] = (n_slots, cached)
        else:
            short = others + kb.cost(n_slots, cached) - limit
            assert "\n" not in refusal and "--kv-events.memory-bytes" in refusal
            assert f"raise --kv-events.memory-bytes by {short:,} " in refusal
            wider = kb.MemoryBudget(limit + short)
            for other, shape in held.items():  # the same others, at the raised limit
                assert wider.reserve(other, *shape) is None
            assert wider.reserve(name, n_slots, cached) is None
        assert budget.used() == sum(kb.cost(*n) for n in held.values()) <= limit


def test_the_default_admits_what_was_measured_within_64_mib() -> None:
    """The shapes the default was measured at (docs/kv-events.md, "Memory"): one segment
    of 91,750 slots, or two of 6,553; not one slot more, nor a third segment."""
    assert kb.slots_within(kb.DEFAULT_BYTES) == 91_750
    one = kb.MemoryBudget(kb.DEFAULT_BYTES)
    assert one.reserve("a", 91_750) is None and one.reserve("b", 0) is not None
    assert kb.MemoryBudget(kb.DEFAULT_BYTES).reserve("a", 91_751) is not None
    two = kb.MemoryBudget(kb.DEFAULT_BYTES)
    assert two.reserve("a", 6_553) is None and two.reserve("b", 6_553) is None
    assert two.reserve("c", 0) is not None
    assert kb.MemoryBudget(kb.DEFAULT_BYTES).reserve("a", 1_000_000) is not None
    # An agent's segment: what its engine can cache plus a ring's worth of slots, charged
    # at attach for the blocks it can cache: one engine of up to 75,366 entries.
    ring = kvl.DEFAULT_RING_CAP
    assert kb.cacheable(75_366 + ring, ring) == 75_366
    assert kb.MemoryBudget(kb.DEFAULT_BYTES).reserve("a", 75_366 + ring, 75_366) is None
    assert kb.MemoryBudget(kb.DEFAULT_BYTES).reserve("a", 75_367 + ring, 75_367) is not None
    assert kb.cacheable(100, 1 << 20) == 0  # a bigger ring forgives no more than the default
    assert kb.cacheable(ring + 100, 1 << 20) == 100


def _published(ctx: zmq.Context, replay: int) -> bool:
    try:
        kvm._wait_published(ctx, f"tcp://127.0.0.1:{replay}", timeout=60)
    except RuntimeError:
        return False
    return True


def test_a_segment_over_the_share_is_refused_in_one_line_and_admitted_when_it_fits(
    shm_dir: str, tmp_path: Path
) -> None:
    """A real daemon and two engines' segments: the first (10,000 slots) is published;
    the second, come later (10,000 slots, DP rank 1), would pass the share, so it is not
    published, its ports stay unbound and the log says so in one line, once, naming the
    flag; replaced by a segment of 100 slots (what the share leaves room for), it is."""
    budget = kb.cost(10_000) + kb.cost(100)
    port = free_port()
    replay = port + 100  # rank r on port + r and replay + r
    ctx = zmq.Context()
    log = tmp_path / "daemon.log"
    first = kvm._writer(shm_dir, 10_000, "kvevents.a.dp0.tp0.pp0", 0)
    writers = [first]
    daemon = None
    try:
        with open(log, "wb") as err:
            daemon, _url = start_daemon(
                shm_dir,
                "--kv-events.endpoint", f"tcp://127.0.0.1:{port}",
                "--kv-events.replay-endpoint", f"tcp://127.0.0.1:{replay}",
                "--kv-events.memory-bytes", str(budget),
                "--rediscover-interval", "0.1",
                stderr=err,
            )  # fmt: skip
        assert _published(ctx, replay)  # rank 0
        second = kvm._writer(shm_dir, 10_000, "kvevents.b.dp1.tp0.pp0", 1)
        writers.append(second)
        refused = "KV-event segment kvevents.b.dp1.tp0.pp0: 10,000 slots, 0 cached, need"
        assert wait_for(lambda: refused in log.read_text(), timeout=30), log.read_text()
        assert not listening(port + 1) and not listening(replay + 1)
        # Retried every second: still refused, and said once.
        wait_for(lambda: False, timeout=2.5)
        lines = [line for line in log.read_text().splitlines() if refused in line]
        assert len(lines) == 1, lines
        assert "raise --kv-events.memory-bytes by " in lines[0]
        # The second engine restarts with a table the share holds.
        os.kill(second, signal.SIGKILL)
        os.waitpid(second, 0)
        writers.remove(second)
        writers.append(kvm._writer(shm_dir, 100, "kvevents.b.dp1.tp0.pp0", 1))
        assert _published(ctx, replay + 1), log.read_text()
        assert _published(ctx, replay)  # the first still served
    finally:
        ctx.term()
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        for pid in writers:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_a_full_state_past_its_charge_is_stopped_and_cleared(shm_dir: str) -> None:
    """A writer of its own caching every slot, the ring's included: charged at attach for
    none (its table is all ring), its full state finds 20,000 cached blocks; the share
    holds 8,000 more than charged: the build stops before keeping more (nothing of the
    segment's state kept, its share given back, said in one line), and with a share that
    holds them all the same segment is published whole."""
    name = "kvevents.over.dp0.tp0.pp0"
    w = KVEventsWriter(name, n_slots=20_000, block_size=16, shm_dir=shm_dir)
    store_chains(w, 20_000)
    for share, published in ((kb.cost(20_000, 8_000), False), (kb.cost(20_000), True)):
        ctx = zmq.Context()
        options = KVEventsOptions("tcp://127.0.0.1:0", memory_bytes=share)
        pub = kz.RankPublisher(name, shm_dir, options, ctx)
        sent: list[bytes] = []
        remember = pub._remember
        pub._remember = lambda seq, payload, sent=sent, remember=remember: (
            sent.append(payload),
            remember(seq, payload),
        )[1]
        try:
            pub.poll_once()
            if published:
                assert pub.reader is not None and pub.error is None
                assert pub.budget.used() == kb.cost(20_000)
                assert pub.stats["resyncs"] == 1
            else:
                assert pub.reader is None and pub._state is None
                assert pub.budget.used() == 0
                assert pub.error is not None and "20,000 slots, 8," in pub.error
                assert "raise --kv-events.memory-bytes by " in pub.error
                assert pub.stats["resyncs"] == 0 and not sent  # nothing of it went out
                pub.poll_once()  # not looked at again before OVER_RETRY_S
                assert pub.reader is None and pub.stats["resyncs"] == 0
        finally:
            pub._close()
            ctx.term()
    w.close()
