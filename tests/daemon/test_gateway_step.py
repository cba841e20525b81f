"""A gateway rank's new step answered in C (issue 44 item 1, `kvsidecar.daemon.gateway_step`).

Checked against the Python full check, never timed: the compiled answer's bytes equal the
full check's on random steps (engines, pool shapes, values), it declines (None: the full
check decides) for every change a full check could judge or print differently, its
probes see what the skipped full check would have seen, and through a real listener a
publishing writer's steps are served without a full check each (main: one per step).
Real segments, real writers, a real `PollServer`.
"""

from __future__ import annotations

import os
import socket
import time
import types

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsidecar.daemon import gateway_step
from kvsidecar.daemon.config import Discovery, Polling
from kvsidecar.daemon.gateway import Gateway
from kvsidecar.daemon.gateway_body import CONTENT_TYPE
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol import _seqlock
from kvsidecar.protocol.schema import KVCachePoolSnapshot, RuntimeSnapshot, Snapshot
from kvsidecar.protocol.writer import SegmentWriter
from kvsidecar.web import poll_server
from kvsidecar.web.poll_server import response_start

pytestmark = pytest.mark.skipif(
    not gateway_step.COMPILED, reason="kvsidecar.daemon._gatewaystep is not built"
)

NAME = "kvsidecar.step.dp0"
EXACT = 2**53


def _pool(total: int, allocated: int, available: int, **kw) -> KVCachePoolSnapshot:
    fields = dict(
        num_layers=4,
        block_size_tokens=16,
        block_size_bytes=4096,
        total_blocks=total,
        allocated_blocks=allocated,
        available_blocks=available,
        cached_blocks=kw.pop("cached", 3),
        allocs_total=kw.pop("allocs", 10),
        null_block_reserved=True,
    )
    return KVCachePoolSnapshot(**(fields | kw))


def _snapshot(engine: str, step: int, pools: list[KVCachePoolSnapshot], **rt) -> Snapshot:
    fields = dict(
        engine=engine,
        model_name="org/model",
        dp_rank=0,
        initialized=True,
        step=step,
        requests_running=rt.pop("running", step % 7),
        requests_waiting=rt.pop("waiting", step % 5),
    )
    runtime = RuntimeSnapshot(**(fields | rt))
    return Snapshot(runtime=runtime, pools=pools)


class Rank:
    """A writer, the daemon's targets (no background poller) and a gateway of rank 0."""

    def __init__(self, shm: str, first: Snapshot) -> None:
        self.shm = shm
        self.writer = SegmentWriter(NAME, shm_dir=shm)
        self.writer.publish(first)
        self.targets = TargetSet(
            Discovery(shm), polling=Polling(poll_interval=0.25, stale_after=30)
        )
        self.targets.poll_all()
        self.gateway = Gateway(self.targets, stale_after=3600.0)
        status = self.gateway.answer(0)[0]
        assert status == 200
        self.slot = self.gateway._slot(0)

    @property
    def step(self):
        return self.slot.advance

    def compiled(self) -> bytes | None:
        got = self.step(time.monotonic())
        return None if got is None else got[0]

    def full_check(self) -> bytes:
        """The Python full check's whole response, from a gateway of its own."""
        status, body, ctype, extra = Gateway(self.targets, stale_after=3600.0).answer(0)
        return response_start(status, ctype) + b"%d\r\n%s\r\n" % (len(body), extra) + body

    def close(self) -> None:
        self.targets.stop()
        self.writer.close()


@pytest.fixture
def shm(tmp_path) -> str:
    os.chmod(tmp_path, 0o750)
    return str(tmp_path)


def _clear(shm: str) -> None:
    for f in os.listdir(shm):
        os.unlink(os.path.join(shm, f))


# -- the bytes ------------------------------------------------------------------------

_COUNT = st.integers(0, EXACT - 1) | st.integers(0, 2000)
_TOTAL = st.sampled_from([0, 1, 999, 120_000, EXACT - 1])  # total_blocks (0: not sized)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    engine=st.sampled_from(["vllm", "sglang", "atom", "kvsidecar-demo"]),
    totals=st.lists(_TOTAL, min_size=1, max_size=4),
    steps=st.lists(st.lists(_COUNT, min_size=12, max_size=12), min_size=1, max_size=6),
)
def test_compiled_bytes_equal_the_full_checks_on_random_steps(shm, engine, totals, steps):
    """Whatever the engine's names, pool shapes and counts (in range, or past what a
    double holds: then declined), a step answered in C is byte for byte the full check's
    response, and every step whose counts stay below 2^53 is answered in C."""

    def pools(values: list[int]) -> list[KVCachePoolSnapshot]:
        out = []
        for i, total in enumerate(totals):
            allocated, available = values[2 + 2 * i], values[3 + 2 * i]
            out.append(_pool(total, allocated, available, cached=values[0]))
        return out

    _clear(shm)
    rank = Rank(shm, _snapshot(engine, 1, pools([0] * 12)))
    try:
        for n, values in enumerate(steps, start=2):
            rt = {"running": values[0], "waiting": values[1]}
            rank.writer.publish(_snapshot(engine, n, pools(values), **rt))
            got = rank.compiled()
            want = rank.full_check()
            # Every sum the usage takes within what a double holds exactly.
            sums = sum(totals) + sum(values[2 : 2 + 2 * len(totals)])
            if got is not None:
                assert got == want
            elif all(v < EXACT for v in values) and sums < EXACT:
                pytest.fail(f"declined a step in range: {values}")
    finally:
        rank.close()


@pytest.mark.parametrize("total", [8, 16, 40, 200, 1000])
def test_sglang_s_rounded_usage_equals_python_s_round_at_every_tie(shm, total):
    """SGLang's token usage is rounded to 2 decimals by Python's round (half to even on
    the exact binary value); the compiled step rounds in C. At every count of small
    pools (exact ties among them: 1/8, 3/8, 5/8, 7/8) the bytes are the full check's."""
    rank = Rank(shm, _snapshot("sglang", 1, [_pool(total, 0, total)]))
    try:
        assert rank.step.c_read  # the seqlock read through its C API
        for allocated in range(1, total + 1, max(1, total // 50)):
            pools = [_pool(total, allocated, total - allocated)]
            rank.writer.publish(_snapshot("sglang", allocated + 1, pools))
            assert rank.compiled() == rank.full_check()
    finally:
        rank.close()


# -- what it declines ----------------------------------------------------------------


def _base(step: int = 1, **changes) -> Snapshot:
    pool = dict(total=999, allocated=100, available=899)
    pool.update(changes.pop("pool", {}))
    return _snapshot("vllm", step, [_pool(**pool)], **changes)


CHANGES = {
    "capacity": {"pool": {"total": 998}},
    "block size": {"pool": {"block_size_tokens": 32}},
    "held blocks": {"pool": {"deferred_free_blocks": 2}},
    "a deferral's stamp": {"pool": {"oldest_deferred_free_mono_ns": 5}},
    "a count gone": {"pool": {"cached": None}},
    "a count past 2^53": {"pool": {"allocs": EXACT}},
    "the model": {"model_name": "org/other"},
    "the writer's errors": {"publish_errors_total": 1},
    "a stamp of the runtime": {"start_time": 1.5},
}


@pytest.mark.parametrize("what", list(CHANGES))
def test_a_change_the_full_check_judges_is_declined(shm, what):
    """Each is a field the full check's verdict or the body's kept text depends on
    (labels, the held KV, a stamp, a series appearing, the range a double holds): the
    compiled check declines, and the full check answers it as ever."""
    rank = Rank(shm, _base())
    try:
        rank.writer.publish(_base(2))
        assert rank.compiled() is not None  # a count moved: answered in C
        changes = dict(CHANGES[what])
        if "pool" in changes:
            changes["pool"] = {"allocated": 101, "available": 898, **changes["pool"]}
        rank.writer.publish(_base(3, **changes))
        assert rank.compiled() is None
        assert rank.full_check().startswith(b"HTTP/1.1 200 OK")
    finally:
        rank.close()


@pytest.mark.parametrize("end", ["faulted", "closed"])
def test_a_faulted_or_closed_state_byte_is_declined(shm, end):
    """The engine's fatal-error path (FAULTED) or its clean shutdown (CLOSED, the file
    left in place) after a new step: declined by the header's state byte alone (the
    probes not due), and the full check answers 503."""
    rank = Rank(shm, _base())
    try:
        rank.writer.publish(_base(2))
        if end == "faulted":
            rank.writer.mark_faulted()
        else:
            rank.writer.close(unlink=False)
        rank.step.probed = time.monotonic() + 3600
        assert rank.compiled() is None
        assert rank.full_check().startswith(b"HTTP/1.1 503")
    finally:
        rank.close()


def test_a_retry_under_a_lapping_writer_is_declined(shm, monkeypatch):
    """A read that needed more than one attempt is left to the full check, which counts
    the retries (read_retries_total)."""
    rank = Rank(shm, _base())
    try:
        rank.writer.publish(_base(2))

        def lapped(mm, retries, fd):
            status, seq, header, payload, _ = _seqlock.read_latest(mm, retries, fd)
            return status, seq, header, payload, 2

        with monkeypatch.context() as m:
            m.setattr(gateway_step, "_seqlock", types.SimpleNamespace(read_latest=lapped))
            stand_in = _compiled(rank)
            assert not stand_in.c_read  # a stand-in `read`: called through Python
            assert stand_in(time.monotonic()) is None
        assert _compiled(rank)(time.monotonic()) is not None
    finally:
        rank.close()


def _compiled(rank: Rank, **kw: float):
    """`compiled_step` for the rank's last full check, its probes due at once, the
    gateway's bound an hour (each overridable: stale_after, probed_until, progress)."""
    target = rank.targets.targets[NAME]
    now = time.monotonic()
    options = {"stale_after": 3600.0, "probed_until": 0.0, "progress": now} | kw
    step = gateway_step.compiled_step(
        target,
        target.view.last,
        rank.gateway._templates,
        response_start(200, CONTENT_TYPE),
        every=0.1,
        **options,
    )
    assert step is not None
    return step


# -- the probes it makes in place of the full check's -------------------------------


def test_a_dead_writer_is_declined_when_the_probes_are_due(shm):
    """The liveness probe (the writer's OFD lock): a step published, then the writer
    gone without a CLOSED mark (a crash). Within the probed window the step may be served
    (the full check skipped the probe too); once the probes are due, declined."""
    rank = Rank(shm, _base())
    try:
        rank.writer.publish(_base(2))
        rank.writer._forget_in_child()  # the lock released, the state byte READY
        rank.step.probed = 0.0  # due
        assert rank.compiled() is None
        assert b"dead" in rank.full_check()
    finally:
        rank.targets.stop()


def test_a_replaced_segment_is_declined_when_the_probes_are_due(shm):
    """The path's inode: a new segment renamed over the name while the old writer keeps
    publishing. Due probes decline; the full check then serves the new segment."""
    rank = Rank(shm, _base())
    successor = SegmentWriter("kvsidecar.step.next", shm_dir=shm)
    try:
        successor.publish(_base(1000))
        os.rename(os.path.join(shm, "kvsidecar.step.next"), os.path.join(shm, NAME))
        rank.writer.publish(_base(2))
        assert rank.compiled() is not None  # within the probed window, as the full check
        rank.writer.publish(_base(3))
        rank.step.probed = 0.0
        assert rank.compiled() is None
        assert b"Kvsidecar-Step: 1000\r\n" in rank.full_check()
    finally:
        rank.targets.stop()
        successor._forget_in_child()
        rank.writer.close()


def test_a_truncated_file_is_declined_and_never_a_crash(shm):
    rank = Rank(shm, _base())
    try:
        rank.writer.publish(_base(2))
        os.truncate(os.path.join(shm, NAME), 256)
        rank.step.probed = 0.0
        assert rank.compiled() is None  # the size probe
        rank.step.probed = time.monotonic() + 60
        assert rank.compiled() is None  # no probe: the guarded copy's SIGBUS, a status
    finally:
        rank.targets.stop()
        rank.writer._forget_in_child()


def test_a_reader_that_re_attached_is_declined(shm):
    """The Step holds the map and descriptor of its check: once the reader holds others
    (re-attached, or closed and its descriptor number reused), it never probes them."""
    rank = Rank(shm, _base())
    try:
        rank.writer.publish(_base(2))
        rank.targets.targets[NAME].reader.attach()
        assert rank.compiled() is None
    finally:
        rank.close()


# -- through the listener -------------------------------------------------------------

HEAD = b"GET /metrics HTTP/1.1\r\nHost: picker\r\n\r\n"


def _read(f) -> tuple[int, int, bytes]:
    status = int(f.readline().split()[1])
    length = step = 0
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
        elif name.lower() == b"kvsidecar-step":
            step = int(value)
    return status, step, f.read(length)


@pytest.mark.skipif(not poll_server.FAST, reason="kvsidecar.web._pollfast is not built")
def test_a_publishing_writer_is_served_without_a_full_check_per_step(shm):
    """Fails on main: each of 40 new steps took a full check (41 in all). Now one: the
    40 are answered by the listener's compiled path, each body the full check's for its
    step, and poll cycles that change no claim keep the compiled answers valid (main:
    each cycle, every 0.25 s, invalidated them)."""
    rank = Rank(shm, _base())
    sock = socket.create_server(("127.0.0.1", 0))
    server = poll_server.PollServer([(sock, rank.gateway.route(0))])
    server.start()
    s = socket.create_connection(sock.getsockname(), timeout=30)
    f = s.makefile("rb")
    try:
        s.sendall(HEAD)
        assert _read(f)[:2] == (200, 1)
        s.sendall(HEAD)
        assert _read(f)[:2] == (200, 1)  # the slot armed: the next polls can take C
        checks = rank.gateway.full_checks
        for step in range(2, 42):
            snap = _base(step, pool={"allocated": step, "available": 999 - step})
            rank.writer.publish(snap)
            rank.targets.poll_all()  # a poll cycle, as the daemon's poller runs them
            s.sendall(HEAD)
            status, served, body = _read(f)
            assert (status, served) == (200, step)
            assert rank.full_check().endswith(body)
        assert rank.gateway.full_checks == checks  # none for 40 steps
        assert rank.slot.advanced == 40
        assert rank.gateway.counts()[(0, "ok")] == 43  # each counted (the first check's too)
    finally:
        f.close()
        s.close()
        server.shutdown()
        rank.close()


def test_a_poll_cycle_that_changes_a_claim_takes_the_full_check(shm):
    """The claims' version moves when a second live segment claims the rank: the next
    poll is a full check, answered 503 ambiguous (the compiled answer not served)."""
    rank = Rank(shm, _base())
    other = SegmentWriter("kvsidecar.step.other", shm_dir=shm)
    try:
        version = rank.targets.claims.version
        rank.targets.poll_all()
        assert rank.targets.claims.version == version  # nothing changed: still valid
        other.publish(_base(7))
        rank.targets.discover()  # its directory scan finds the second segment
        rank.targets.poll_all()  # the next poll cycle
        assert rank.targets.claims.version != version
        status, body, _, _ = rank.gateway.answer(0)
        assert status == 503 and b"all claim dp_rank 0" in body
        assert rank.gateway.last_outcome[0][0] == "ambiguous"
    finally:
        other.close()
        rank.close()


def test_the_volatile_fields_are_values_never_identity_or_labels():
    """What may move without a full check: counts and counters only. An identity field,
    a string, a label of the info gauge, the held KV or a stamp among them would let a
    step the full check judges differently be served from the kept text."""
    from kvsidecar.daemon import budget

    assert set(gateway_step.RUNTIME_VOLATILE) <= set(budget.RUNTIME_VALUE_FIELDS)
    assert set(gateway_step.POOL_VOLATILE) <= set(budget.POOL_VALUE_FIELDS)
    never = {
        "total_blocks",
        "block_size_tokens",
        "null_block_reserved",
        "deferred_free_blocks",
        "oldest_deferred_free_mono_ns",
        "start_time",
        "in_shrink",
        "initialized",
    }
    assert not never & set(gateway_step.RUNTIME_VOLATILE + gateway_step.POOL_VOLATILE)
    # Bools are values in budget.py but never unsigned integers on the wire: declined.
    assert msgspec.msgpack.encode(True) == b"\xc3"


# -- a quiet engine: progress is its heartbeat ------------------------------------------


def _quiet(shm: str, stale_after: float) -> tuple[Rank, object, float]:
    """A rank whose Step is given the clock: (rank, step, its check's time)."""
    rank = Rank(shm, _base())
    t0 = time.monotonic()
    step = _compiled(rank, stale_after=stale_after, progress=t0, probed_until=t0 + 3600)
    return rank, step, t0


def test_a_quiet_engine_s_heartbeat_keeps_its_answer_current(shm):
    """No new step, the window over: the heartbeat moved, so the same body is answered
    in C, current for another window (main: a full check every 0.1 s per polled rank)."""
    rank, step, t0 = _quiet(shm, stale_after=1.5)
    try:
        first = step(t0 + 0.05)
        assert first is not None and first[2] == pytest.approx(t0 + 0.05 + 0.1)
        for k in range(1, 30):  # 3 s of 0.1 s windows, each after a heartbeat
            rank.writer.heartbeat()
            got = step(t0 + 0.05 + 0.1 * k)
            assert got is not None and got[:2] == first[:2]
    finally:
        rank.close()


def test_a_hung_engine_is_declined_past_the_gateway_s_bound(shm):
    """Neither a step nor a heartbeat: the answer's window shrinks to the bound, and past
    it the compiled check declines: the full check answers 503 not fresh."""
    rank, step, t0 = _quiet(shm, stale_after=1.5)
    try:
        got = step(t0 + 1.45)
        assert got is not None and got[2] == pytest.approx(t0 + 1.5)  # never past the bound
        assert step(t0 + 1.6) is None
        rank.writer.heartbeat()  # progress again: served again
        assert step(t0 + 1.7) is not None
    finally:
        rank.close()
