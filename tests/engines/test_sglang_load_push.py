"""The load push against SGLang's own: a real SGLang 0.5.23 server (CPU, dummy weights, the
plugin by its entry point) with its ``--load-publish-endpoint`` on, and `kvsidecar serve
--load-push.endpoint` beside it. Both streams are read by one subscriber that decodes as
llm-d-router PR #2067's extractor (tests/streams/picker_loadstat.py).

Checked: the same framing (3 frames, topic ``load``, 8-byte big-endian seq) and message
shape (11 fields, the same msgpack types); at the settled point after a burst (idle), the
same running, waiting, tokens in use, capacity and rank, and our payload byte for byte
SGLang's with the appended fields kvsidecar does not have set to 0; under a steady decode
load, the (running, waiting) SGLang reports are ours, and each of its (running, waiting,
tokens) is a state we sent too. Printed: messages a second of each side and how long after
SGLang's our message with the same values arrived.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time

import msgspec
import pytest

pytest.importorskip("zmq", reason="pyzmq (the kvevents extra, in the dev set) is missing")

import zmq

from kvsidecar.bench import fleet
from kvsidecar.bench import sglang as sb
from kvsidecar.bench import vllm as vb
from kvsidecar.streams.load_stat_wire import LoadStat, encode
from tests.engines import sglang_server as ss
from tests.engines.envs import engine_python
from tests.streams.picker_loadstat import extract
from tests.support.procs import wait_for

pytestmark = pytest.mark.timeout(900)

MAX_TOTAL = 2048
FIRST = 5  # the #34608 prefix kvsidecar fills: running, waiting, tokens, capacity, rank


class Both:
    """SUB sockets on SGLang's load socket and ours; every message, by side, on a thread."""

    def __init__(self, theirs: str, ours: str) -> None:
        self.ctx = zmq.Context()
        self.socks = {}
        for side, endpoint in (("sglang", theirs), ("kvsidecar", ours)):
            s = self.ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(endpoint)
            self.socks[side] = s
        self.got: dict[str, list] = {"sglang": [], "kvsidecar": []}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for s in self.socks.values():
            poller.register(s, zmq.POLLIN)
        by_sock = {s: side for side, s in self.socks.items()}
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                frames = sock.recv_multipart()
                now = time.monotonic_ns()
                try:
                    decoded = extract(frames[-1])
                except Exception as e:
                    self.errors.append(f"{by_sock[sock]}: {e}")
                    continue
                self.got[by_sock[sock]].append((now, frames, decoded[4]))

    def last(self, side: str) -> list:
        return self.got[side][-1][2] if self.got[side] else []

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in self.socks.values():
            s.close(linger=0)
        self.ctx.term()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    python = engine_python("sglang")
    if (problem := ss.standin_problem(python)) is not None:
        pytest.fail(problem)
    tmp = tmp_path_factory.mktemp("sglang-load")
    shm = tmp / "shm"
    shm.mkdir()
    # Below the ephemeral range: a port picked there may be a connection's by the bind.
    port = fleet.free_port_run(4)
    kv, theirs, ours = port + 1, port + 2, port + 3
    cmd = sb.server_command(python, ss.model_dir(tmp / "model"), port, MAX_TOTAL)
    # SGLang's load socket needs its KV-event publisher's tcp endpoint (discovery).
    cmd += [
        "--kv-events-config", f'{{"publisher": "zmq", "endpoint": "tcp://*:{kv}"}}',
        "--load-publish-endpoint", f"tcp://*:{theirs}",
    ]  # fmt: skip
    server = vb.start_server(cmd, sb.server_env(shm), tmp / "server.log", timeout=420)
    daemon = both = None
    try:
        daemon, _url = fleet.start_daemon(
            str(shm), "--load-push.endpoint", f"tcp://127.0.0.1:{ours}", timeout=60
        )
        both = Both(f"tcp://127.0.0.1:{theirs}", f"tcp://127.0.0.1:{ours}")
        yield {"port": port, "both": both}
    finally:
        if both is not None:
            both.close()
        if daemon is not None:
            fleet.stop_daemon(daemon)
        ss.stop(server)


def _settled(both: Both) -> tuple[list, list]:
    def agree() -> bool:
        a, b = both.last("sglang"), both.last("kvsidecar")
        return bool(a) and a[:FIRST] == b[:FIRST]

    assert wait_for(agree, 90, 0.2), (both.last("sglang"), both.last("kvsidecar"))
    return both.last("sglang"), both.last("kvsidecar")


def _check_same_wire(both: Both) -> None:
    assert both.errors == []
    for side in ("sglang", "kvsidecar"):
        for _, frames, raw in both.got[side]:
            assert len(frames) == 3 and frames[0] == b"load" and len(frames[1]) == 8, frames
            assert len(raw) == 11 and raw[0] == "LoadStat", raw
            assert [type(v) for v in raw] == [str] + [int] * 10, raw


def test_idle_after_a_burst_equal_to_sglangs_own(stack):
    both = stack["both"]
    prompts = [[(7 * i + j) % 900 + 50 for j in range(60)] for i in range(10)]
    sb.generate(stack["port"], prompts, 24)  # 10 requests, 4 running at most
    theirs, ours = _settled(both)
    print(f"settled: sglang {theirs} kvsidecar {ours}")
    assert ours[:FIRST] == theirs[:FIRST]
    assert theirs[4] == MAX_TOTAL and theirs[1] == theirs[2] == 0
    # Byte for byte SGLang's message, with the fields kvsidecar does not have set to 0.
    fields = LoadStat.__struct_fields__
    same = LoadStat(**dict(zip(fields, [*theirs[1 : FIRST + 1], 0, 0, 0, 0, 0])))
    assert both.got["kvsidecar"][-1][1][2] == encode(same)
    assert msgspec.msgpack.decode(both.got["sglang"][-1][1][2]) == theirs
    _check_same_wire(both)
    # Idle: each side re-sends its last one about once a second, never sooner.
    n = {s: len(both.got[s]) for s in both.got}
    assert wait_for(lambda: all(len(both.got[s]) >= n[s] + 3 for s in n), 60, 0.1)
    for side in n:
        resent = both.got[side][n[side] - 1 :]
        gaps = [(b[0] - a[0]) / 1e9 for a, b in itertools.pairwise(resent)]
        print(f"idle: {side} re-sent after {[round(g, 2) for g in gaps]} s")
        assert all(r[1][2] == resent[0][1][2] for r in resent)
        assert min(gaps) >= 0.9, (side, gaps)


def test_steady_decode_load(stack):
    both = stack["both"]
    start = {s: len(both.got[s]) for s in both.got}
    prompts = [[(13 * i + j) % 900 + 50 for j in range(32)] for i in range(4)]
    t0 = time.monotonic()
    sb.generate(stack["port"], prompts, 160)  # 4 running, none waiting, long decode
    seconds = time.monotonic() - t0
    _settled(both)
    got = {s: both.got[s][start[s] :] for s in both.got}
    theirs = [(at, tuple(raw[1:4])) for at, _, raw in got["sglang"]]
    ours = [(at, tuple(raw[1:4])) for at, _, raw in got["kvsidecar"]]
    busy = [v for _, v in theirs if v[0] == 4]
    assert len(busy) >= 5, f"SGLang hardly reported the load: {theirs}"
    our_states = {v for _, v in ours}
    missing = [v for v in busy if v not in our_states]
    # How long after SGLang's message ours with the same values came (negative: first).
    first_ours: dict[tuple, int] = {}
    for at, v in ours:
        first_ours.setdefault(v, at)
    lags = [(first_ours[v] - at) / 1e6 for at, v in theirs if v in first_ours and v[0] == 4]
    print(
        f"steady load {seconds:.1f} s: sglang {len(theirs)} messages "
        f"({len(theirs) / seconds:.1f}/s), kvsidecar {len(ours)} ({len(ours) / seconds:.1f}/s); "
        f"{len(busy) - len(missing)} of SGLang's {len(busy)} busy states also sent by us; "
        f"ours after SGLang's by median {statistics.median(lags) if lags else float('nan'):.1f} ms"
    )
    _check_same_wire(both)
    # The push reads the segment every 5 ms (--load-push.poll-interval's default): an
    # engine stepping faster than that (the stand-in model decodes hundreds of steps a
    # second on an idle host) has steps no read sees, and SGLang's every-15th-step message
    # may fall on one. Then each of SGLang's busy states must lie between two of ours
    # (the same load, a step or two apart); slower, ours must carry it exactly.
    steps_per_s = 160 / seconds
    if steps_per_s * 0.005 < 1:
        assert not missing or len(missing) <= len(busy) // 10, missing[:20]
    else:
        tokens = sorted(v[2] for v in our_states if v[:2] == (4, 0))
        unbracketed = [v for v in missing if not tokens or not (tokens[0] <= v[2] <= tokens[-1])]
        assert not unbracketed, (unbracketed, tokens[:5], tokens[-5:])
