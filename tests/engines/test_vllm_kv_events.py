"""KV events from the sidecar against vLLM's own publisher and vLLM's own block pool, on the
real vLLM 0.32 server.

One server runs with BOTH streams: vLLM's own ZMQ publisher (``--kv-events-config``, the
reference) and the agent's KV-event segment published by ``kvsidecar serve
--kv-events.*``. A test-only probe (tests/engines/vllm_pool_probe, on the server's
PYTHONPATH) reads vLLM's own set of cached block hashes in the engine core, the keys of
its BlockPool's ``cached_block_hash_to_block``, at settled points (no request left). A
prefix-heavy workload on 20 blocks of 32 tokens evicts, preempts (checked on vLLM's own
counter), aborts streams mid-way and resets the prefix cache (``POST
/reset_prefix_cache``). Then:

* both streams, decoded with vLLM's own msgspec classes (tests/streams/vllm_decode.py in
  the vLLM env), carry the same events with equal fields in the same order; the
  documented differences (docs/kv-events.md) are the sidecar's first ``AllBlocksCleared``
  (its state at attach, empty), batch boundaries and ``ts`` (not compared); vLLM's stream
  applied from its start gives the engine's own set;
* consumers applying the sidecar's stream (tests/support/kv_consumer.py) hold exactly the
  engine's set: one joined before the workload, one joined late; the engine core
  SIGKILLed (they drop every block) and a second server start (the new engine's set; the
  sidecar's stream across it: ``AllBlocksCleared`` (engine gone), ``AllBlocksCleared``
  (the new writer's empty state), then the new engine's events); the daemon SIGKILLed
  mid-load and restarted (with a replay buffer of 4 batches); a subscriber that missed
  more batches than that buffer; the daemon stopped (SIGSTOP) while the engine wrote more
  than its KV-event ring (64 records, set by the probe for the second engine);
* the same checks, applied to consumers broken on purpose (kv_consumer.py's sabotages),
  must find the one that drops an event (the latest BlockStored, whose blocks a settled
  engine still holds), the one that misses removals and the one that ignores
  ``AllBlocksCleared`` wrong; the one that ignores a publisher restart (wrong only when
  it missed the restarted daemon's first batches) is reported, not required.

Two server starts (40-90 s each on a 2-core host). The vLLM 0.33 environment has no API
server (a scheduler-only env), so 0.33, and both versions' hybrid models and async
scheduling, are checked on vLLM's real Scheduler instead (the first test): after every
step, the events the daemon's publisher builds from the segment against those vLLM's own
KVCacheManager.take_events hands its publisher, and at the end against what vLLM's own
ZMQ publisher sent (its replay, decoded with vLLM's classes); the sidecar's BlockStored
events name every KV-cache group (the hybrid model: full attention and sliding window).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import zmq

from kvsidecar.bench import fleet
from kvsidecar.bench import vllm as vb
from kvsidecar.protocol.kv_events_reader import KVEventsReader
from kvsidecar.streams.kv_events_wire import END_SEQ
from tests.engines.envs import ROOT, engine_python, vllm_server_env
from tests.engines.test_vllm_scheduler import ENVS, _results
from tests.engines.test_vllm_shutdown import vllm_child
from tests.support.kv_consumer import SABOTAGES, Consumer
from tests.support.procs import wait_for

DECODE = ROOT / "tests" / "streams" / "vllm_decode.py"
CLEARED = ["AllBlocksCleared", {"type": "AllBlocksCleared"}]
PREFIX = 96  # three blocks of 32 tokens shared by many prompts
PROBE = ROOT / "tests" / "engines" / "vllm_pool_probe"  # test-only: the engine's own set
BUFFER_STEPS = 4  # the restarted daemon's replay buffer: a stalled subscriber passes it
RING = 64  # the restarted engine's KV-event ring (records): two rounds lap it


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


class Background:
    """fn(*args) in a thread; `pump_until_done` lets the consumers follow the live stream
    meanwhile (this thread is the only one that uses them)."""

    def __init__(self, fn, *args) -> None:
        self.error: list[BaseException] = []

        def target() -> None:
            try:
                fn(*args)
            except BaseException as e:
                self.error.append(e)

        self.thread = threading.Thread(target=target)
        self.thread.start()

    def pump_until_done(self, consumers: list[Consumer]) -> None:
        while self.thread.is_alive():
            for c in consumers:
                c.pump(0.05)
        self.thread.join()
        if self.error:
            raise self.error[0]


def run_pumping(consumers: list[Consumer], fn, *args) -> None:
    """Run fn in a thread while the consumers follow the live stream."""
    Background(fn, *args).pump_until_done(consumers)


def fresh_request(port: int, seed: int) -> None:
    """One request with a prompt of its own: its blocks are new (a BlockStored that stays
    cached) and, the 20 blocks all cached, it evicts (BlockRemoved)."""
    prompt = [(13 * seed + 5 * j) % 300 + 100 for j in range(120)]
    with urllib.request.urlopen(vb.complete(port, prompt, 40), timeout=300) as r:
        assert r.status == 200


def idle(port: int) -> bool:
    """No request running or waiting in the engine (vLLM's own gauges)."""
    metrics = vb.scrape(f"http://127.0.0.1:{port}/metrics")
    busy = vb.value(metrics, "vllm:num_requests_running")
    return busy + vb.value(metrics, "vllm:num_requests_waiting") == 0


def engine_set(server: subprocess.Popen, port: int, dump: Path) -> set[int]:
    """vLLM's own set of cached block hashes, read in the engine core at a settled point
    (no request left): the probe (tests/engines/vllm_pool_probe) dumps the keys of its
    BlockPool's ``cached_block_hash_to_block`` on SIGUSR2. Two reads 0.5 s apart agree
    (an aborted stream's request may still be leaving)."""
    pid = vllm_child(server.pid, b"EngineCore")

    def read() -> set[int]:
        dump.unlink(missing_ok=True)
        os.kill(pid, signal.SIGUSR2)
        assert wait_for(dump.exists, 60, 0.05), "the probe did not answer"
        got = json.loads(dump.read_text())
        assert got["pid"] == pid and got["pools"] == 1, {**got, "entries": len(got["entries"])}
        assert {group for _hash, group in got["entries"]} <= {0}
        return {h for h, _group in got["entries"]}

    seen: list[set[int]] = []

    def stable() -> bool:
        if not idle(port):
            return False
        seen.append(read())
        return len(seen) >= 2 and seen[-1] == seen[-2]

    assert wait_for(stable, 120, 0.5), "the engine did not settle"
    return seen[-1]


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


def start_kv_daemon(shm, pub: int, replay_port: int, log, *extra: str) -> subprocess.Popen:
    """``kvsidecar serve`` publishing the KV-event segments in ``shm`` on these ports
    (``extra``: more flags)."""
    daemon, _url = fleet.start_daemon(
        str(shm),
        "--kv-events.endpoint", f"tcp://127.0.0.1:{pub}",
        "--kv-events.replay-endpoint", f"tcp://127.0.0.1:{replay_port}",
        "--kv-events.topic", "kv@sidecar@tiny",
        *extra,
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
        # vLLM's own ZMQ publisher sent exactly these events (its replay, decoded with its
        # own classes; a difference is a mismatch), and the sidecar's BlockStored events
        # name every KV-cache group (full attention 0, sliding window 1).
        assert r["kv_events_on_vllms_wire"] == r["kv_events_compared"], where
        assert r["stored_group_idx"] == list(range(r["kv_cache_groups"])), (where, r)
        # Both kinds, under eviction pressure, compared event by event.
        assert r["BlockStored"] >= 50 and r["BlockRemoved"] >= 50, (where, r)
    assert {r["config"] for r in runs} >= {"sync", "async", "hybrid", "hybrid-async"}


class Checks:
    """The sidecar's consumers, and the one check they all get at each settled point:
    every correct one holds exactly the engine's set; each one broken on purpose
    (kv_consumer.py's sabotages) is wrong after one of them at least (``caught``)."""

    def __init__(self, pub: int, replay_port: int) -> None:
        self.ports = (pub, replay_port)
        self.good: list[Consumer] = []
        self.broken = [Consumer(pub, replay_port, sabotage=s) for s in SABOTAGES]
        self.caught: dict[str, str] = {}

    @property
    def all(self) -> list[Consumer]:
        return self.good + self.broken

    def join(self) -> Consumer:
        c = Consumer(*self.ports)
        self.good.append(c)
        c.join()
        return c

    def check(self, what: str, expected: set[int]) -> None:
        for c in self.good:
            assert wait_for(lambda c=c: holds(c, expected), 60, 0.1), (what, c.held ^ expected)
        for c in self.broken:  # the stream is settled: a few seconds to catch up
            if not wait_for(lambda c=c: holds(c, expected), 5, 0.1):
                self.caught.setdefault(str(c.sabotage), what)

    def close(self) -> None:
        for c in self.all:
            c.close()


@pytest.mark.timeout(1500)
def test_sidecar_stream_equals_vllms_own_publisher_and_its_consumers_hold_vllms_blocks(
    tmp_path, tmp_path_factory
):
    python = engine_python("vllm")
    shm = tmp_path / "shm"
    shm.mkdir()
    # Below the ephemeral range: vLLM's own sockets draw ports from there.
    port, v_pub, v_replay, s_pub, s_replay = range(fleet.free_port_run(5), 0x10000)[:5]
    dump = tmp_path / "pool.json"
    env = {
        **vllm_server_env(shm, tmp_path_factory),
        "KVSIDECAR_KV_EVENTS": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
        "KVSIDECAR_TEST_POOL_DUMP": str(dump),  # the probe: the engine's own set on SIGUSR2
    }
    env["PYTHONPATH"] = os.pathsep.join([str(PROBE), env["PYTHONPATH"]])
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
    checks: Checks | None = None
    t0 = time.monotonic()
    try:
        server = vb.start_server(cmd, env, tmp_path / "server.log", timeout=300)
        # The sidecar publishes once its KV-event service found the engine's segment.
        assert wait_for(lambda: replay(s_replay, wait_s=2.0) is not None, 60, 0.5)
        checks = Checks(s_pub, s_replay)
        live = checks.join()
        for c in checks.broken:
            c.join()

        preempted = 0.0
        for round_ in range(4):
            run_pumping(checks.all, workload, port, round_, 2)
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
        # The broken consumers lose the latest BlockStored (drop_event), every BlockRemoved
        # (miss_removal): a request of new blocks, which evicts, follows.
        for c in checks.broken:
            c.arm()
        run_pumping(checks.all, fresh_request, port, 1)

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
        # The engine's own set, read in the engine: vLLM's stream says the same.
        pool = engine_set(server, port, dump)
        assert pool, "blocks stay cached after the workload"
        assert applied(theirs) == pool
        checks.check("joined before the workload", pool)
        late = checks.join()
        checks.check("late join", pool)
        print(f"phase 1: {time.monotonic() - t0:.0f} s; held {len(pool)}")

        # The engine core SIGKILLed: no consumer keeps a dead engine's blocks.
        os.kill(vllm_child(server.pid, b"EngineCore"), signal.SIGKILL)
        checks.check("engine core SIGKILLed", set())
        vb.stop_server(server)
        server = None

        # The restart (a second server start): the consumers follow the new engine. Its
        # KV-event ring is RING records (the probe), so that the daemon stopped below laps it.
        env2 = {**env, "KVSIDECAR_TEST_KV_RING": str(RING)}
        server = vb.start_server(cmd, env2, tmp_path / "server2.log", timeout=300)

        # The sidecar attached to the new engine (AllBlocksCleared for the old one gone, then
        # the new one's state, still empty) before the workload: on a loaded host it attached
        # after the first requests, and its first state then announced blocks that vLLM's
        # stream announces as its own events (the same set, another sequence).
        def attached() -> bool:
            got = replay(s_replay)
            return got is not None and len(decode(python, got)) >= len(theirs) + 3

        assert wait_for(attached, 60, 0.5)
        ring = KVEventsReader("kvevents.vllm.dp0.tp0.pp0", shm_dir=str(shm))
        assert ring.attach() is None
        assert ring.geometry is not None and ring.geometry.ring_cap == RING
        ring.close()
        run_pumping(checks.all, workload, port, 7, 0)
        theirs2, ours2 = settled(python, v_replay, s_replay, 3 + len(theirs))
        assert kinds(theirs2).get("BlockStored", 0) >= 3
        assert ours2 == [CLEARED, *theirs, CLEARED, CLEARED, *theirs2]
        pool = engine_set(server, port, dump)
        assert applied(theirs2) == pool
        checks.check("engine core SIGKILLed and restarted", pool)
        print(f"restart: vLLM's events {kinds(theirs2)}, held {len(pool)}")
        print(f"phase 2: {time.monotonic() - t0:.0f} s")

        # The daemon SIGKILLed mid-load and restarted (its sequence from 0 again), with a
        # replay buffer of BUFFER_STEPS batches.
        def rounds() -> None:
            for round_ in (8, 12):
                workload(port, round_, 0)

        load = Background(rounds)
        assert load.thread.is_alive(), ("the daemon dies mid-load", load.error)
        daemon.kill()
        daemon.wait()
        log2 = tmp_path / "daemon2.log"
        daemon = start_kv_daemon(
            shm, s_pub, s_replay, log2, "--kv-events.buffer-steps", str(BUFFER_STEPS),
            "--log-level", "info",
        )  # fmt: skip
        load.pump_until_done(checks.all)
        checks.check("daemon SIGKILLed and restarted mid-load", engine_set(server, port, dump))

        # A subscriber stalled past the replay buffer: it misses every batch (unsubscribed,
        # as a router's SUB past its high-water mark drops them) while more than
        # BUFFER_STEPS pass; on the next one it asks for the gap and gets the full state.
        late.sub.unsubscribe(b"")
        before, replays = late.last, late.replays
        run_pumping([c for c in checks.all if c is not late], workload, port, 9, 0)
        assert live.last is not None and before is not None
        assert live.last - before > BUFFER_STEPS, (before, live.last)
        late.sub.subscribe(b"")
        checks.check("subscriber stalled past the replay buffer", engine_set(server, port, dump))
        assert late.replays > replays

        # The daemon stopped (SIGSTOP) while the engine writes more than its ring: it
        # rebuilds from the table on SIGCONT.
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            for round_ in (10, 11):  # about 60 records each
                run_pumping(checks.all, workload, port, round_, 0)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        checks.check("daemon stopped past the ring", engine_set(server, port, dump))
        print(f"phase 3: {time.monotonic() - t0:.0f} s; broken consumers caught: {checks.caught}")
        assert "rebuild from the table" in log2.read_text()  # it did fall behind the ring
        # The same checks catch each consumer broken on purpose.
        assert set(checks.caught) >= {"drop_event", "miss_removal", "ignore_clear"}, checks.caught
    finally:
        if checks is not None:
            checks.close()
        if server is not None:
            vb.stop_server(server)
        if daemon.poll() is None:
            os.kill(daemon.pid, signal.SIGCONT)
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(10)
        except subprocess.TimeoutExpired:
            daemon.kill()
