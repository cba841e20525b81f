"""The gateway endpoint (`serve --gateway.listen-address`), read as an endpoint picker reads
it (tests/support/picker.py: expfmt's strict rules, first matching series wins, untyped reads 0),
against real writer processes whose every value is a function of the step
(tests/daemon/gateway_writer.py).

Each poll is checked three ways: it parses as the picker parses it; its values are exactly
those of the step the gateway says it served (Kvsidecar-Step); and that step is at least the
one the writer had published before the request was sent (fresh, never a poll cycle old).
The same checks, run against sabotaged gateways and bodies (an untyped family, a duplicate
TYPE, a stale rank served 200, the poller's copy from the previous cycle), fail.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsidecar import settings as kv_settings
from kvsidecar.bench.fleet import free_port, free_port_run
from kvsidecar.daemon import gateway_body as gb
from kvsidecar.daemon.config import Discovery, Polling
from kvsidecar.daemon.gateway import Gateway
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol import layout
from kvsidecar.protocol.reader import SegmentReader
from kvsidecar.protocol.schema import KVCachePoolSnapshot, RuntimeSnapshot, Snapshot
from tests.conftest import REPO
from tests.daemon import gateway_writer as gw
from tests.support import picker
from tests.support.procs import _start_announcing, start_daemon, wait_for

# (status, body, served step or None)
Poll = Callable[[], tuple[int, str, "int | None"]]


def start_writer(
    name: str, shm: str, engine: str = "vllm", dp: int = 0, role: str = "both", period=0.002
) -> subprocess.Popen:
    args = ["-m", "tests.daemon.gateway_writer", name, shm, engine, str(dp), role, str(period)]
    return _start_announcing(args, "gateway writer")[0]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class HTTPPoll:
    """A picker's poll: GET /metrics on a kept-alive connection, no Accept header."""

    def __init__(self, port: int, path: str = "/metrics") -> None:
        self.port, self.path = port, path
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def __call__(self) -> tuple[int, str, int | None]:
        try:
            self.conn.request("GET", self.path)
            r = self.conn.getresponse()
        except (ConnectionError, http.client.HTTPException):
            self.conn.close()  # as Go's transport does: redial once
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            self.conn.request("GET", self.path)
            r = self.conn.getresponse()
        body = r.read().decode()
        step = r.getheader("Kvsidecar-Step")
        return r.status, body, int(step) if step is not None else None


def in_process(gateway: Gateway, rank: int = 0) -> Poll:
    def poll() -> tuple[int, str, int | None]:
        status, body, _, extra = gateway.answer(rank)
        step = extra.decode().partition(":")[2].strip()
        return status, body.decode(), int(step) if step else None

    return poll


def published_step(reader: SegmentReader) -> int:
    reading = reader.read()
    assert not isinstance(reading, Exception), reading
    return reading.snapshot.runtime.step


def check_polls(poll: Poll, reader: SegmentReader, engine: str, n: int = 150) -> int:
    """n polls, each 200, picker-parsed to exactly its served step's values, and fresh.
    Returns the number of distinct steps served (the writer moved under the polls)."""
    steps = set()
    for _ in range(n):
        before = published_step(reader)
        status, body, served = poll()
        assert status == 200, body
        assert served is not None and served >= before, (
            f"served step {served}, but step {before} was published before the request"
        )
        assert picker.extract(body, engine) == gw.expected(engine, served), (served, body)
        assert len(body.encode()) <= 1024, len(body.encode())
        steps.add(served)
    return len(steps)


def check_not_up(poll: Poll, why: str) -> str:
    """A rank that is not up is never served as numbers: 503 with the reason."""
    status, body, served = poll()
    assert status == 503, f"{why}: answered {status} {body!r}"
    assert served is None
    return body


@pytest.fixture
def shm(tmp_path_factory):
    d = tmp_path_factory.mktemp("gw-shm", numbered=True)
    os.chmod(d, 0o750)
    return str(d)


# The most ranks a test here serves (its --gateway.ranks), each on base port + dp_rank.
GATEWAY_PORTS = 4


def daemon_with_gateway(shm: str, *extra: str, **popen) -> tuple[subprocess.Popen, str, int]:
    # every rank's port (base + dp_rank) must be free, not only the base
    port = free_port_run(GATEWAY_PORTS)
    daemon, url = start_daemon(
        shm,
        "--poll-interval", "0.25", "--gateway.listen-address", f"127.0.0.1:{port}", *extra,
        **popen,
    )  # fmt: skip
    return daemon, url, port


def stop_daemon(daemon: subprocess.Popen) -> None:
    daemon.terminate()
    try:
        daemon.wait(10)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()


# -- the protocol, per engine ------------------------------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "sglang", "atom", "kvsidecar-demo"])
def test_each_engine_is_served_in_its_own_names_fresh(shm, engine):
    writer = start_writer("kvsidecar.gw.dp0", shm, engine=engine)
    daemon, _, port = daemon_with_gateway(shm)
    try:
        poll = HTTPPoll(port)
        assert wait_for(lambda: poll()[0] == 200)
        with SegmentReader("kvsidecar.gw.dp0", shm_dir=shm) as reader:
            assert reader.attach() is None
            names = "vllm" if engine == "kvsidecar-demo" else engine
            distinct = check_polls(poll, reader, names)
        assert distinct > 1  # the values moved under the polls and stayed exact
        families = picker.parse(poll()[1])
        assert all(f.type == "gauge" for f in families.values())
        assert gb.HELD_BLOCKS in families and gb.HELD_AGE in families
    finally:
        stop_daemon(daemon)
        stop(writer)


def test_vllm_labels_are_vllms(shm):
    writer = start_writer("kvsidecar.gw.dp1", shm, dp=1)
    daemon, _, port = daemon_with_gateway(shm, "--gateway.ranks", "2")
    try:
        poll = HTTPPoll(port + 1)
        assert wait_for(lambda: poll()[0] == 200)
        families = picker.parse(poll()[1])
        labels = families["vllm:kv_cache_usage_perc"].samples[0][0]
        assert labels == {"engine": "1", "model_name": gw.MODEL}
        info = families["vllm:cache_config_info"].samples[0][0]
        assert info == {"block_size": "16", "engine": "1", "num_gpu_blocks": str(gw.TOTAL + 1)}
        # The picker may narrow a spec by label, as for a vLLM server.
        assert picker.extract(poll()[1], "vllm", 'engine="1"')["block_size"] == 16
    finally:
        stop_daemon(daemon)
        stop(writer)


# -- one listener per rank -------------------------------------------------------------------


def test_each_rank_on_its_own_port_and_a_missing_rank_is_503(shm):
    writers = [start_writer(f"kvsidecar.gw.dp{r}", shm, dp=r) for r in range(2)]
    daemon, _, port = daemon_with_gateway(shm, "--gateway.ranks", "3")
    try:
        for rank in range(2):
            poll = HTTPPoll(port + rank)
            assert wait_for(lambda poll=poll: poll()[0] == 200)
            with SegmentReader(f"kvsidecar.gw.dp{rank}", shm_dir=shm) as reader:
                assert reader.attach() is None
                check_polls(poll, reader, "vllm", n=40)
            labels = picker.parse(poll()[1])["vllm:num_requests_running"].samples[0][0]
            assert labels["engine"] == str(rank)
        body = check_not_up(HTTPPoll(port + 2), "dp_rank 2 has no segment")
        assert "no segment for dp_rank 2" in body
        status, body, _ = HTTPPoll(port, "/other")()
        assert status == 404
    finally:
        stop_daemon(daemon)
        for w in writers:
            stop(w)


def test_two_live_segments_for_one_rank_are_ambiguous_until_a_role_is_chosen(shm):
    writers = [
        start_writer("kvsidecar.gw.prefill.dp0", shm, role="prefill"),
        start_writer("kvsidecar.gw.decode.dp0", shm, role="decode"),
    ]
    daemon, _, port = daemon_with_gateway(shm)
    daemon2, _, port2 = daemon_with_gateway(shm, "--gateway.role", "decode")
    try:
        poll = HTTPPoll(port)
        assert wait_for(lambda: "all claim dp_rank 0" in poll()[1])
        check_not_up(poll, "two live segments claim dp_rank 0")
        decode = HTTPPoll(port2)
        assert wait_for(lambda: decode()[0] == 200)
        with SegmentReader("kvsidecar.gw.decode.dp0", shm_dir=shm) as reader:
            assert reader.attach() is None
            check_polls(decode, reader, "vllm", n=40)
    finally:
        stop_daemon(daemon)
        stop_daemon(daemon2)
        for w in writers:
            stop(w)


# -- never stale, dead, corrupt or gone as fresh numbers ------------------------------------


def test_a_rank_that_is_not_up_is_never_served_as_numbers(shm):
    name = "kvsidecar.gw.dp0"
    writer = start_writer(name, shm)
    daemon, _, port = daemon_with_gateway(shm, "--stale-after", "0.5")
    poll = HTTPPoll(port)
    try:
        assert wait_for(lambda: poll()[0] == 200)
        # Stale: the writer stops publishing (SIGSTOP) but is alive.
        writer.send_signal(signal.SIGSTOP)
        assert wait_for(lambda: poll()[0] == 503)
        assert "stale" in check_not_up(poll, "stale")
        writer.send_signal(signal.SIGCONT)
        assert wait_for(lambda: poll()[0] == 200)
        # Dead: SIGKILL, the segment left behind.
        writer.kill()
        writer.wait()
        assert wait_for(lambda: poll()[0] == 503)
        assert "dead" in check_not_up(poll, "dead")
        # A new writer under the same name: served again (generation 2).
        writer = start_writer(name, shm)
        assert wait_for(lambda: poll()[0] == 200)
        # Corrupt: the header's magic overwritten under a live writer.
        path = os.path.join(shm, name)
        writer.send_signal(signal.SIGSTOP)
        with open(path, "r+b") as f:
            f.seek(layout.OFF_MAGIC)
            f.write(b"NOTOURS!")
        assert wait_for(lambda: poll()[0] == 503)
        assert "corrupt" in check_not_up(poll, "corrupt")
        writer.kill()
        writer.wait()
        os.unlink(path)
        # Closed cleanly by its writer: still not numbers.
        writer = start_writer(name, shm)
        assert wait_for(lambda: poll()[0] == 200)
        writer.terminate()
        writer.wait()
        assert wait_for(lambda: poll()[0] == 503)
        check_not_up(poll, "closed")
    finally:
        stop_daemon(daemon)
        stop(writer)


def daemon_view(url: str, name: str) -> dict:
    """The daemon's own record of `name` (/api/v1/snapshots): state, age on its clock."""
    with urllib.request.urlopen(f"{url}/api/v1/snapshots", timeout=30) as r:
        records = json.load(r)["targets"]
    (record,) = [t for t in records if t["segment"] == name]
    return record


def test_a_hung_writer_is_not_served_past_the_gateways_own_bound(shm):
    """A SIGSTOPped writer (alive, so not dead; its heartbeat frozen) is answered 503 once
    the daemon's clock says it showed no progress for --gateway.stale-after, long before
    the daemon's own --stale-after verdict (60 s here): a picker trusts a sample 2 s."""
    name = "kvsidecar.gw.dp0"
    bound = gb_stale_after = 1.5  # the default, below the picker's 2 s
    writer = start_writer(name, shm)
    daemon, url, port = daemon_with_gateway(shm, "--stale-after", "60")
    poll = HTTPPoll(port)
    try:
        assert wait_for(lambda: poll()[0] == 200)
        writer.send_signal(signal.SIGSTOP)
        poll()  # sees the last publish, so the age below counts from it on both sides
        while True:
            before = daemon_view(url, name)  # read first: the age at the answer is larger
            status, body, _ = poll()
            if status != 200:
                break
            assert before["age_seconds"] <= bound, (
                f"200 with frozen numbers after {before['age_seconds']} s without progress"
            )
        assert status == 503 and "--gateway.stale-after" in body, body
        # The gateway's decision, not the daemon's verdict: the target is still up there.
        after = daemon_view(url, name)
        assert after["state"] == "up", after
        assert after["age_seconds"] >= gb_stale_after, after
        # It steps again: served again at once.
        writer.send_signal(signal.SIGCONT)
        assert wait_for(lambda: poll()[0] == 200)
    finally:
        stop_daemon(daemon)
        stop(writer)


def test_an_idle_engine_stays_served_on_its_idle_heartbeat(shm):
    """No steps, only the agent's idle heartbeat (1 s, its default): every poll for several
    heartbeats is 200, the first 1.5 s after the step included (the heartbeat thread on a
    fixed grid left that gap at up to 2 s, and the gateway answered 503 in it)."""
    name = "kvsidecar.gw.dp0"
    # The daemon first, scanning often, so the polls begin right after the writer's step.
    daemon, _, port = daemon_with_gateway(shm, "--rediscover-interval", "0.05")
    writer = start_writer(name, shm, period="idle:1.0")
    poll = HTTPPoll(port)
    try:
        assert wait_for(lambda: poll()[0] == 200)
        answers = []
        deadline = time.monotonic() + 4.0  # three idle heartbeats after the step
        while time.monotonic() < deadline:
            status, body, step = poll()
            answers.append((status, step, body if status != 200 else ""))
            time.sleep(0.02)
        refused = [a for a in answers if a[0] != 200]
        assert not refused, f"{len(refused)} of {len(answers)} polls refused: {refused[:3]}"
        assert {a[1] for a in answers} == {1}  # never a step: the heartbeat kept it fresh
    finally:
        stop_daemon(daemon)
        stop(writer)


def test_a_refused_segment_is_never_served(shm):
    name = "kvsidecar.gw.dp0"
    writer = start_writer(name, shm)
    os.chown(os.path.join(shm, name), 12345, -1)  # not an allowed writer uid
    daemon, _, port = daemon_with_gateway(shm)
    try:
        body = check_not_up(HTTPPoll(port), "foreign owner")
        assert "no segment for dp_rank 0" in body
    finally:
        stop_daemon(daemon)
        stop(writer)


# -- the same checks, sabotaged, fail ---------------------------------------------------------


@pytest.fixture
def live(shm):
    """A fast writer, a TargetSet polled every 0.25 s in the background, a reader."""
    writer = start_writer("kvsidecar.gw.dp0", shm, period=0.001)
    targets = TargetSet(Discovery(shm), polling=Polling(poll_interval=0.25, stale_after=0.5))
    targets.poll_all()
    targets.start()
    reader = SegmentReader("kvsidecar.gw.dp0", shm_dir=shm)
    assert reader.attach() is None
    try:
        yield writer, targets, reader
    finally:
        reader.close()
        targets.stop()
        stop(writer)


def test_in_process_gateway_passes_the_checks(live):
    _, targets, reader = live
    assert check_polls(in_process(Gateway(targets)), reader, "vllm") > 1


def test_sabotage_an_untyped_family_fails(live):
    _, targets, reader = live
    real = in_process(Gateway(targets))

    def untyped():
        status, body, step = real()
        return (
            status,
            body.replace("vllm:kv_cache_usage_perc gauge", "vllm:kv_cache_usage_perc untyped"),
            step,
        )

    with pytest.raises(AssertionError):
        check_polls(untyped, reader, "vllm", n=50)


def test_sabotage_a_duplicate_type_fails(live):
    _, targets, reader = live
    real = in_process(Gateway(targets))

    def duplicate():
        status, body, step = real()
        return status, body + "# TYPE vllm:num_requests_running gauge\n", step

    with pytest.raises(picker.ParseError, match="second TYPE"):
        check_polls(duplicate, reader, "vllm", n=5)


class _PreviousCycle(Gateway):
    """Sabotage: serves the poller's copy (up to a poll interval old), no fresh read."""

    def answer(self, dp_rank: int):
        t = self._candidates(dp_rank)[0]
        last = t.view.last
        step = b"Kvsidecar-Step: %d\r\n" % last.snapshot.runtime.step
        return 200, gb.render(last.snapshot, time.monotonic_ns()), gb.CONTENT_TYPE, step


class _StaleServed(Gateway):
    """Sabotage: serves the last reading whatever the target's state."""

    def answer(self, dp_rank: int):
        t = self._candidates(dp_rank)[0]
        view = t.poll()
        step = b"Kvsidecar-Step: %d\r\n" % view.last.snapshot.runtime.step
        return 200, gb.render(view.last.snapshot, time.monotonic_ns()), gb.CONTENT_TYPE, step


def test_sabotage_a_value_from_the_previous_cycle_fails(live):
    _, targets, reader = live
    with pytest.raises(AssertionError, match="was published before the request"):
        check_polls(in_process(_PreviousCycle(targets)), reader, "vllm")


def test_sabotage_a_stale_rank_served_200_fails(live):
    writer, targets, _ = live
    real, sabotaged = in_process(Gateway(targets)), in_process(_StaleServed(targets))
    writer.send_signal(signal.SIGSTOP)
    try:
        assert wait_for(lambda: real()[0] == 503)
        check_not_up(real, "stale")
        with pytest.raises(AssertionError, match="answered 200"):
            check_not_up(sabotaged, "stale")
    finally:
        writer.send_signal(signal.SIGCONT)


# -- the body, for any snapshot ---------------------------------------------------------------

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=64)
_count = st.integers(0, 2**31)


@st.composite
def snapshots(draw):
    total = draw(st.integers(1, 10**6))
    return Snapshot(
        runtime=RuntimeSnapshot(
            engine=draw(st.sampled_from(["vllm", "sglang", "atom", "kvsidecar-demo", ""])),
            model_name=draw(_text),
            role=draw(st.sampled_from(["prefill", "decode", "both"])),
            dp_rank=draw(st.integers(0, 255)),
            dp_size=draw(st.integers(1, 256)),
            tp_rank=draw(st.integers(0, 7)),
            requests_running=draw(_count),
            requests_waiting=draw(_count),
        ),
        pools=[
            KVCachePoolSnapshot(
                pool_name=draw(_text),
                block_size_tokens=draw(st.integers(1, 1024)),
                total_blocks=total,
                allocated_blocks=(allocated := draw(st.integers(0, total))),
                available_blocks=draw(st.one_of(st.none(), st.just(total - allocated))),
                virtual_blocks=draw(st.one_of(st.none(), st.just(total + 1))),
                deferred_free_blocks=draw(st.one_of(st.none(), st.integers(0, total))),
                oldest_deferred_free_mono_ns=draw(st.one_of(st.none(), st.just(0), _count)),
            )
        ],
    )


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(snapshots())
def test_any_snapshot_renders_a_body_the_picker_parses_exactly(snap):
    body = gb.render(snap, time.monotonic_ns()).decode()
    engine = snap.runtime.engine if snap.runtime.engine in ("sglang", "atom") else "vllm"
    got = picker.extract(body, engine)
    p, rt = snap.pools[0], snap.runtime
    assert got["waiting"] == rt.requests_waiting and got["running"] == rt.requests_running
    usage = p.allocated_blocks / p.total_blocks
    want = round(usage, 2) if engine == "sglang" else usage
    if engine == "vllm" and p.available_blocks is not None:
        want = 1.0 - p.available_blocks / p.total_blocks  # vLLM's get_usage()
    assert got["usage"] == want
    assert got["block_size"] == p.block_size_tokens
    families = picker.parse(body)
    assert all(f.type == "gauge" and len(f.samples) == 1 for f in families.values())
    if engine == "vllm":
        labels = families["vllm:num_requests_running"].samples[0][0]
        assert labels == {"engine": str(rt.dp_rank), "model_name": rt.model_name}
    held = families.get(gb.HELD_BLOCKS)
    assert (held is None) == (p.deferred_free_blocks is None)


# -- the listener itself ----------------------------------------------------------------------


def test_the_flag_table_in_gateway_md_is_the_settings():
    """docs/gateway.md's flag table names every --gateway.* setting with its default, and
    the freshness bound stays below the picker's staleness threshold."""
    text = (Path(REPO) / "docs" / "gateway.md").read_text()
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| `(--gateway\.[a-z-]+)` \(`(KVSIDECAR_[A-Z_]+)`\) \| ([^|]+) \|", line)
        if m:
            rows[m[1]] = (m[2], m[3].strip())
    ours = {s.flag: s for s in kv_settings.ALL if s.flag.startswith("--gateway.")}
    assert set(rows) == set(ours)
    for flag, s in ours.items():
        name, default = rows[flag]
        assert name == s.name, flag
        if s.default is not None:
            assert default == f"{s.default:g}" if isinstance(s.default, float) else str(s.default)
    assert kv_settings.GATEWAY_STALE_AFTER.default < picker.STALENESS_THRESHOLD_S


def test_role_choices_are_the_schemas():
    from kvsidecar.cli.serve import GATEWAY_ROLES
    from kvsidecar.protocol.schema import ROLES

    assert GATEWAY_ROLES == ROLES


def test_bad_gateway_flags_are_one_line_usage_errors(shm):
    out = subprocess.run(
        [sys.executable, "-m", "kvsidecar", "serve", "--shm-dir", shm,
         "--gateway.listen-address", "nonsense"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "--gateway.listen-address" in out.stderr, out.stderr
    with socket.socket() as squat:
        squat.bind(("127.0.0.1", 0))
        squat.listen()
        port = squat.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "kvsidecar", "serve", "--shm-dir", shm,
             "--web.listen-address", f"127.0.0.1:{free_port()}",
             "--gateway.listen-address", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert out.returncode == 2, out.stderr
    line = [x for x in out.stderr.splitlines() if "gateway" in x]
    assert line and "port in use" in line[0] and "--gateway.listen-address" in line[0], out.stderr


def test_slow_heads_and_idle_connections_do_not_hold_the_gateway(shm):
    """A connection that never finishes its head is closed; at the connection cap a
    newcomer takes the place of the one idle longest, so polls keep being answered."""
    writer = start_writer("kvsidecar.gw.dp0", shm)
    daemon, url, port = daemon_with_gateway(shm, "--gateway.max-connections", "8")
    held = []
    try:
        poll = HTTPPoll(port)
        assert wait_for(lambda: poll()[0] == 200)
        for _ in range(20):  # more than the cap, each with half a head
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            held.append(s)
        for _ in range(20):
            fresh = HTTPPoll(port)
            assert fresh()[0] == 200
            fresh.conn.close()

        def closed(s: socket.socket) -> bool:
            s.settimeout(30)
            try:
                return s.recv(1) == b""
            except OSError:
                return True

        assert all(closed(s) for s in held)  # every half head was closed, none waits forever
        text = HTTPPoll(int(url.rsplit(":", 1)[1]))()[1]
        fams = picker.parse(text)
        reasons = {
            s[0]["reason"] for s in fams["kvsidecar_gateway_connections_closed_total"].samples
        }
        assert reasons & {"evicted", "slow_head"}, reasons
        codes = {s[0]["code"]: s[1] for s in fams["kvsidecar_gateway_requests_total"].samples}
        assert codes["200"] >= 21
    finally:
        for s in held:
            s.close()
        stop_daemon(daemon)
        stop(writer)


def test_a_forgotten_target_is_never_reattached(shm):
    """The gateway may poll a Target the poller has just closed (forgotten): it must not
    reopen the segment (that descriptor would never be closed) nor serve it."""
    writer = start_writer("kvsidecar.gw.dp0", shm)
    targets = TargetSet(Discovery(shm))
    try:
        targets.poll_all()
        (target,) = targets.targets.values()
        assert target.view.up and target.reader.fd >= 0
        target.close()
        view = target.poll()
        assert not view.up and target.reader.fd == -1 and target.reader.mm is None
    finally:
        targets.stop()
        stop(writer)
