"""KV events from the sidecar against vLLM's own publisher, on the real vLLM 0.32 server.

One server runs with BOTH streams: vLLM's own ZMQ publisher (``--kv-events-config``, the
reference) and the agent's KV-event segment published by ``kvsidecar serve
--kv-events.*``. A prefix-heavy workload on 20 blocks of 32 tokens evicts, preempts
(checked on vLLM's own counter), aborts streams mid-way and resets the prefix cache
(``POST /reset_prefix_cache``). Then:

* both streams, decoded with vLLM's own msgspec classes (tests/streams/vllm_decode.py in
  the vLLM env), carry the same events with equal fields in the same order; the
  documented differences (docs/kv-events.md) are the sidecar's first ``AllBlocksCleared``
  (its state at attach, empty), batch boundaries and ``ts`` (not compared);
* a consumer applying the sidecar's stream (tests/support/kv_consumer.py, joined before
  the workload) and one joining late hold exactly the block hashes that vLLM's own
  stream, applied from its start, says are cached;
* the engine core SIGKILLed: the sidecar's consumers drop every block; a second server
  start (the restart): the consumer holds exactly the new engine's set again, and the
  sidecar's stream across the restart is ``AllBlocksCleared`` (engine gone),
  ``AllBlocksCleared`` (the new writer's empty state), then the new engine's events.

Two server starts (40-90 s each on a 2-core host). The vLLM 0.33 environment has no API
server (a scheduler-only env), so 0.33, and both versions' hybrid models and async
scheduling, are checked on vLLM's real Scheduler instead (the second test): after every
step, the events the daemon's publisher builds from the segment against those vLLM's own
KVCacheManager.take_events hands its publisher.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import threading
import urllib.request

import pytest
import zmq

from kvsidecar.bench import fleet
from kvsidecar.bench import vllm as vb
from kvsidecar.streams.kv_events_wire import END_SEQ
from tests.engines.envs import ROOT, engine_python, vllm_server_env
from tests.engines.test_vllm_scheduler import ENVS, _results
from tests.engines.test_vllm_shutdown import vllm_child
from tests.support.kv_consumer import Consumer
from tests.support.procs import wait_for

DECODE = ROOT / "tests" / "streams" / "vllm_decode.py"
CLEARED = ["AllBlocksCleared", {"type": "AllBlocksCleared"}]
PREFIX = 96  # three blocks of 32 tokens shared by many prompts


def replay(port: int, start: int = 0, wait_s: float = 5.0) -> list[bytes] | None:
    """vLLM's replay protocol: the payloads from ``start`` on, or None without an answer."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            if not dealer.poll(int(wait_s * 1000)):
                return None
            _, _topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append(payload)
    finally:
        dealer.close()


def decode(python: str, payloads: list[bytes], script=DECODE) -> list[list]:
    """The events of these batches, in order, as vLLM's own classes decode them (another
    engine's with its ``script``): [type, fields] each."""
    proc = subprocess.run(
        [python, str(script)],
        input=json.dumps([p.hex() for p in payloads]),
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    batches = json.loads(proc.stdout.splitlines()[-1])["batches"]
    return [event for _rank, events in batches for event in events]


def applied(events: list[list]) -> set[int]:
    """The block hashes a consumer holds after these events (llm-d's set semantics)."""
    held: set[int] = set()
    for kind, fields in events:
        if kind == "BlockStored":
            held.update(fields["block_hashes"])
        elif kind == "BlockRemoved":
            held.difference_update(fields["block_hashes"])
        else:
            held.clear()
    return held


def prompts(round_: int, n: int) -> list[list[int]]:
    """Prefix-heavy: three shared 96-token prefixes, each prompt with a suffix of its own."""
    out = []
    for i in range(n):
        prefix = [(37 * (i % 3) + j) % 400 + 1 for j in range(PREFIX)]
        out.append(prefix + [(11 * i + 7 * round_ + j) % 450 + 20 for j in range(40)])
    return out


def workload(port: int, round_: int, aborts: int) -> None:
    """Eight requests at once on 20 blocks (each needs 7: vLLM preempts), plus streams
    that the client drops after their first chunk (vLLM aborts them)."""

    def one(p: list[int]) -> None:
        with urllib.request.urlopen(vb.complete(port, p, 88), timeout=300) as r:
            assert r.status == 200

    def aborted(p: list[int]) -> None:
        with urllib.request.urlopen(vb.complete(port, p, 200, stream=True), timeout=300) as r:
            r.readline()  # the first chunk, then the connection closes: an abort

    ps = prompts(round_, 8)
    with concurrent.futures.ThreadPoolExecutor(8 + aborts) as ex:
        futures = [ex.submit(one, p) for p in ps]
        futures += [ex.submit(aborted, p[::-1]) for p in ps[:aborts]]
        for f in futures:
            f.result()


def run_pumping(consumer: Consumer, fn, *args) -> None:
    """Run fn in a thread while the consumer follows the live stream (one thread uses it)."""
    error: list[BaseException] = []

    def target() -> None:
        try:
            fn(*args)
        except BaseException as e:
            error.append(e)

    t = threading.Thread(target=target)
    t.start()
    while t.is_alive():
        consumer.pump(0.2)
    t.join()
    if error:
        raise error[0]


def settled(python: str, vllm_replay: int, side_replay: int, offset: int):
    """Wait until the sidecar's stream has as many events as vLLM's plus ``offset`` (the
    sidecar reads the engine's segment every 10 ms); (vLLM's events, the sidecar's)."""
    got: dict[str, list] = {}

    def same_length() -> bool:
        theirs, ours = replay(vllm_replay), replay(side_replay)
        if theirs is None or ours is None:
            return False
        got["vllm"], got["side"] = decode(python, theirs), decode(python, ours)
        return len(got["side"]) >= len(got["vllm"]) + offset

    assert wait_for(same_length, 120, 1.0), {k: len(v) for k, v in got.items()}
    return got["vllm"], got["side"]


def differing(a: dict, b: dict) -> dict:
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def kinds(events: list[list]) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind, _ in events:
        out[kind] = out.get(kind, 0) + 1
    return out


def start_kv_daemon(shm, pub: int, replay_port: int, log) -> subprocess.Popen:
    """``kvsidecar serve`` publishing the KV-event segments in ``shm`` on these ports."""
    daemon, _url = fleet.start_daemon(
        str(shm),
        "--kv-events.endpoint", f"tcp://127.0.0.1:{pub}",
        "--kv-events.replay-endpoint", f"tcp://127.0.0.1:{replay_port}",
        "--kv-events.topic", "kv@sidecar@tiny",
        wait_for_source=False,
        timeout=60,
        stderr=open(log, "wb"),
    )  # fmt: skip
    return daemon


def holds(consumer: Consumer, expected: set[int]) -> bool:
    consumer.pump(0.3)
    return consumer.held == expected


def late_joiner(
    live: Consumer, consumers: list[Consumer], pub: int, replay_port: int, truth: set[int]
) -> Consumer:
    """The live consumer, and one joining now (kept in ``consumers``, returned), hold
    exactly ``truth``."""
    assert wait_for(lambda: holds(live, truth), 60, 0.1), live.held ^ truth
    late = Consumer(pub, replay_port)
    consumers.append(late)
    late.join()
    assert wait_for(lambda: holds(late, truth), 60, 0.1), late.held ^ truth
    return late


def stop_all(consumers: list[Consumer], server, daemon: subprocess.Popen, stop=vb.stop_server):
    """The consumers, the engine server (when up, by ``stop``), then the daemon."""
    for c in consumers:
        c.close()
    if server is not None:
        stop(server)
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(10)
    except subprocess.TimeoutExpired:
        daemon.kill()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("env", ENVS)
def test_recorded_events_equal_vllms_own_queue_every_step(env):
    runs = _results(env, ["--steps", "300", "--kv-events"])
    for r in runs:
        where = (r["vllm"], r["config"], r["seed"])
        assert r["mismatches"] == 0, (where, r["first_mismatches"])
        if r["config"] == "no-prefix-cache":
            assert r["kv_events_compared"] == 0, where  # vLLM emits none without caching
            continue
        assert r["kv_events_by_block"] == (r["kv_cache_groups"] == 2), where
        # Both kinds, under eviction pressure, compared event by event.
        assert r["BlockStored"] >= 50 and r["BlockRemoved"] >= 50, (where, r)
    assert {r["config"] for r in runs} >= {"sync", "async", "hybrid", "hybrid-async"}


@pytest.mark.timeout(1200)
def test_sidecar_stream_equals_vllms_own_publisher_and_its_consumers_hold_vllms_blocks(
    tmp_path, tmp_path_factory
):
    python = engine_python("vllm")
    shm = tmp_path / "shm"
    shm.mkdir()
    # Below the ephemeral range: vLLM's own sockets draw ports from there.
    port, v_pub, v_replay, s_pub, s_replay = range(fleet.free_port_run(5), 0x10000)[:5]
    env = {
        **vllm_server_env(shm, tmp_path_factory),
        "KVSIDECAR_KV_EVENTS": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
    }
    kv_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{v_pub}",
        "replay_endpoint": f"tcp://*:{v_replay}",
        "topic": "vllm",
    }
    cmd = vb.server_command(
        python,
        vb.write_model(tmp_path / "model"),
        port,
        num_gpu_blocks=20,
        extra=("--max-model-len", "512", "--kv-events-config", json.dumps(kv_config)),
    )
    daemon = start_kv_daemon(shm, s_pub, s_replay, tmp_path / "daemon.log")
    server = None
    consumers: list[Consumer] = []
    try:
        server = vb.start_server(cmd, env, tmp_path / "server.log", timeout=300)
        # The sidecar publishes once its KV-event service found the engine's segment.
        assert wait_for(lambda: replay(s_replay, wait_s=2.0) is not None, 60, 0.5)
        live = Consumer(s_pub, s_replay)
        consumers.append(live)
        live.join()

        preempted = 0.0
        for round_ in range(4):
            run_pumping(live, workload, port, round_, 2)
            if round_ == 0:  # idle now: every block free, so vLLM's reset succeeds
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}/reset_prefix_cache", method="POST"
                )
                with urllib.request.urlopen(req, timeout=30) as r:
                    assert r.status == 200
            metrics = vb.scrape(f"http://127.0.0.1:{port}/metrics")
            preempted = vb.value(metrics, "vllm:num_preemptions_total")
            if round_ >= 1 and preempted > 0:
                break
        assert preempted > 0, "the workload was sized to preempt"

        theirs, ours = settled(python, v_replay, s_replay, 1)
        counts = kinds(theirs)
        print("vLLM's events:", counts, "sidecar's:", kinds(ours))
        assert counts.get("BlockStored", 0) >= 10 and counts.get("BlockRemoved", 0) >= 10
        assert counts.get("AllBlocksCleared", 0) == 1  # the reset
        # The same events, equal fields, the same order; the sidecar's first event is its
        # state when it attached (empty: before any request).
        assert ours[0] == CLEARED
        for i, (a, b) in enumerate(zip(ours[1:], theirs)):
            assert a == b, (i, a[0], b[0], differing(a[1], b[1]))
        assert ours == [CLEARED, *theirs]
        truth = applied(theirs)
        assert truth, "blocks stay cached after the workload"

        late = late_joiner(live, consumers, s_pub, s_replay, truth)

        # The engine core SIGKILLed: no consumer keeps a dead engine's blocks.
        os.kill(vllm_child(server.pid, b"EngineCore"), signal.SIGKILL)
        assert wait_for(lambda: holds(live, set()), 60, 0.1)
        vb.stop_server(server)
        server = None

        # The restart (a second server start): the consumers follow the new engine.
        server = vb.start_server(cmd, env, tmp_path / "server2.log", timeout=300)

        # The sidecar attached to the new engine (AllBlocksCleared for the old one gone, then
        # the new one's state, still empty) before the workload: on a loaded host it attached
        # after the first requests, and its first state then announced blocks that vLLM's
        # stream announces as its own events (the same set, another sequence).
        def attached() -> bool:
            got = replay(s_replay)
            return got is not None and len(decode(python, got)) >= len(theirs) + 3

        assert wait_for(attached, 60, 0.5)
        run_pumping(live, workload, port, 7, 0)
        theirs2, ours2 = settled(python, v_replay, s_replay, 3 + len(theirs))
        assert kinds(theirs2).get("BlockStored", 0) >= 3
        assert ours2 == [CLEARED, *theirs, CLEARED, CLEARED, *theirs2]
        truth2 = applied(theirs2)
        assert wait_for(lambda: holds(live, truth2), 60, 0.1), live.held ^ truth2
        assert wait_for(lambda: holds(late, truth2), 60, 0.1), late.held ^ truth2
        print("restart: vLLM's events", kinds(theirs2), "held", len(truth2))
    finally:
        stop_all(consumers, server, daemon)
