"""The load push end to end, all real: a writer process (tests/streams/load_writer.py),
`kvsidecar serve --load-push.endpoint` as a process, real ZMQ on 127.0.0.1, and a subscriber
that decodes as llm-d-router PR #2067's extractor does (tests/streams/picker_loadstat.py).

Checked: every step whose values changed is one message with those values, in order, seq
numbers consecutive; a step with unchanged values sends nothing; idle, the last one is
re-sent about once a second and never more often; the port is the endpoint's + dp_rank; a
dead writer's rank goes silent. The bytes against SGLang's own class: test_load_stat_wire.py.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

pytest.importorskip("zmq", reason="pyzmq (the kvevents extra, in the dev set) is missing")

from kvsidecar.bench import vllm as vb
from kvsidecar.bench.fleet import free_port_run, stop_daemon
from kvsidecar.streams.load_stat_wire import LoadStat, encode
from tests.conftest import REPO
from tests.streams.load_writer import BLOCK, TOTAL
from tests.streams.picker_loadstat import Subscriber
from tests.support.procs import start_daemon, wait_for

pytestmark = pytest.mark.timeout(300)


class Writer:
    def __init__(self, shm_dir: str, engine: str, dp: int, role: str = "both") -> None:
        name = f"kvsidecar.{engine}.{role}.dp{dp}.tp0.pp0"
        cmd = ["-m", "tests.streams.load_writer", name, shm_dir, engine, str(dp), role]
        self.proc = subprocess.Popen(
            [sys.executable, *cmd],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert self._line().startswith("ready")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def step(self, running: int, waiting: int, allocated: int) -> int:
        """Publish one step; the CLOCK_MONOTONIC ns of its publish."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{running} {waiting} {allocated}\n")
        self.proc.stdin.flush()
        return int(self._line())

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _expected(running: int, waiting: int, allocated: int, dp: int) -> bytes:
    return encode(
        LoadStat(
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            num_tokens=allocated * BLOCK,
            max_total_num_tokens=TOTAL * BLOCK,
            attn_dp_rank=dp,
        )
    )


@pytest.fixture
def pushed(tmp_path, request):
    shm = tmp_path / "shm"
    shm.mkdir()
    port = free_port_run(2)  # rank 1 on port + 1
    extra = getattr(request, "param", ())
    daemon, url = start_daemon(
        str(shm),
        "--load-push.endpoint", f"tcp://127.0.0.1:{port}",
        "--rediscover-interval", "0.1",
        *extra,
    )  # fmt: skip
    subs: list[Subscriber] = []
    writers: list[Writer] = []

    def subscribe(dp: int) -> Subscriber:
        s = Subscriber(f"tcp://127.0.0.1:{port + dp}")
        subs.append(s)
        return s

    def writer(engine: str, dp: int, role: str = "both") -> Writer:
        w = Writer(str(shm), engine, dp, role)
        writers.append(w)
        return w

    subscribe.url = url  # type: ignore[attr-defined]
    try:
        yield subscribe, writer
    finally:
        for w in writers:
            w.kill()
        for s in subs:
            s.close()
        stop_daemon(daemon)


def _until(sub: Subscriber, payload: bytes) -> list:
    """Receive until a message with `payload` arrives; every message received, in order."""
    start = len(sub.readings)

    def arrived() -> bool:
        sub.poll(0.2)
        return any(r.payload == payload for r in sub.readings[start:])

    assert wait_for(arrived, 60, 0), f"never: {payload!r}: {[r.raw for r in sub.readings[start:]]}"
    return sub.readings[start:]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_each_changed_step_is_one_message_in_order(pushed, engine):
    subscribe, writer = pushed
    sub = subscribe(1)
    w = writer(engine, 1)  # DP rank 1: the endpoint's port + 1
    _until(sub, _expected(0, 0, 0, 1))
    steps = [(1, 0, 10), (2, 1, 40), (2, 3, 40), (0, 0, 999), (3, 2, 7)]
    for running, waiting, allocated in steps:
        w.step(running, waiting, allocated)
        got = _until(sub, _expected(running, waiting, allocated, 1))
        # One message for the step; any other is a re-send of the previous one, a second on.
        *before, last = got
        assert all(b.payload == sub.readings[-len(got) - 1].payload for b in before), [
            b.raw for b in before
        ]
        assert last.running == running and last.waiting == waiting
        assert last.usage == allocated / TOTAL and last.capacity == TOTAL * BLOCK
        assert last.topic == b"load"
    assert sub.errors == []
    seqs = [r.seq for r in sub.readings]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs


def test_unchanged_steps_send_nothing_and_idle_resends_once_a_second(pushed):
    subscribe, writer = pushed
    sub = subscribe(0)
    w = writer("sglang", 0)
    _until(sub, _expected(0, 0, 0, 0))
    w.step(2, 1, 30)
    first = _until(sub, _expected(2, 1, 30, 0))[-1]
    for _ in range(20):  # steps whose values did not change: no message of their own
        w.step(2, 1, 30)

    def resent_thrice() -> bool:
        sub.poll(0.5)
        return sum(r.at_ns > first.at_ns for r in sub.readings) >= 3

    assert wait_for(resent_thrice, 60, 0)
    after = [r for r in sub.readings if r.at_ns >= first.at_ns]
    assert all(r.payload == first.payload for r in after)
    gaps = [(b.at_ns - a.at_ns) / 1e9 for a, b in itertools.pairwise(after)]
    # The daemon re-sends once a second has passed since the last send: never sooner
    # (less a little delivery jitter), whatever the 21 steps did.
    assert min(gaps) >= 0.9, gaps
    # Counted by reason on the daemon's /metrics, for each message the subscriber got.
    m = vb.scrape(f"{subscribe.url}/metrics")
    name = "kvsidecar_load_push_messages_total"
    changed = vb.value(m, name, dp_rank="0", reason="changed")
    resent = vb.value(m, name, dp_rank="0", reason="resent")
    assert changed >= 2 and resent >= len(after) - 1, (changed, resent)
    assert changed + resent >= len(sub.readings)


def test_a_dead_writer_goes_silent(pushed):
    subscribe, writer = pushed
    sub = subscribe(0)
    w = writer("vllm", 0)
    _until(sub, _expected(0, 0, 0, 0))
    w.kill()
    sub.poll(0.5)  # one in flight may still arrive
    n = len(sub.readings)
    sub.poll(3.0)
    sub.poll(0)
    assert len(sub.readings) == n, [r.raw for r in sub.readings[n:]]


def test_two_roles_on_one_rank_send_nothing_until_a_role_is_chosen(pushed):
    """A P/D pod's two engines both on DP rank 0: whose load would it be? Nothing is sent
    (the router's staleness takes over), as the gateway answers 503."""
    subscribe, writer = pushed
    sub = subscribe(0)
    prefill, decode = writer("vllm", 0, "prefill"), writer("vllm", 0, "decode")
    prefill.step(1, 1, 1)
    decode.step(2, 2, 2)
    sub.poll(3.0)
    sub.poll(0)
    # Before both were seen, the first alone may have been sent: never after both were.
    assert all(r.raw[1:4] in ([0, 0, 0], [1, 1, 16]) for r in sub.readings), sub.readings
    assert not any(r.raw[1:4] == [2, 2, 32] for r in sub.readings)


@pytest.mark.parametrize("pushed", [("--load-push.role", "decode")], indirect=True)
def test_the_role_chosen_is_pushed(pushed):
    subscribe, writer = pushed
    sub = subscribe(0)
    prefill, decode = writer("vllm", 0, "prefill"), writer("vllm", 0, "decode")
    prefill.step(1, 1, 1)
    decode.step(2, 2, 2)
    _until(sub, _expected(2, 2, 2, 0))
    assert not any(r.raw[1:4] == [1, 1, 16] for r in sub.readings), [r.raw for r in sub.readings]
