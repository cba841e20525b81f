"""Values from a buggy writer (#12 item 12) and duplicate pools (item 7): both exposition
formats always parse, no series is ever duplicated, rejected values are counted.

Hostile records are real publishes into a real segment, read through the real
TargetSet and rendered by the daemon's own handlers; prometheus_client's text and
OpenMetrics parsers and `promtool check metrics` judge the bodies.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import tempfile
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families as text_parse

from kvsidecar.bench.fleet import free_port_run
from kvsidecar.daemon.app import Daemon
from kvsidecar.daemon.budget import identity_error
from kvsidecar.daemon.config import Discovery, Polling
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol.schema import KVCachePoolSnapshot, RuntimeSnapshot, Snapshot
from kvsidecar.protocol.writer import SegmentWriter
from tests.support.procs import start_daemon, wait_for
from tests.support.scrape import fetch, value
from tests.support.writers import fork_raw_writer, stop

NAME = "kvsidecar.buggy.dp0.tp0.pp0"
INT_LIMIT = 2**63
OM = "application/openmetrics-text; version=1.0.0"

# msgpack carries ints in [-2^63, 2^64); every one of them must be safe to serve.
wire_int = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([-1, 0, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]),
)
wire_float = st.floats(allow_nan=True, allow_infinity=True)
label_text = st.text(max_size=24)  # any unicode, control characters included


def _records(cls: type, draw_value) -> st.SearchStrategy:
    kwargs = {}
    for name, ftype in zip(cls.__struct_fields__, cls.__annotations__.values()):
        t = str(ftype)
        if t.startswith("str"):
            kwargs[name] = label_text
        elif t.startswith("bool"):
            kwargs[name] = st.booleans()
        elif t.startswith("float"):
            kwargs[name] = wire_float
        elif t.startswith("int"):
            kwargs[name] = draw_value if "None" not in t else st.none() | draw_value
        else:
            kwargs[name] = st.none() | draw_value if "None" in t else draw_value
    return st.builds(cls, **kwargs)


pools = _records(KVCachePoolSnapshot, wire_int)
# Few pool names and groups, so duplicates (item 7) come up often.
pool = st.builds(
    lambda p, name, group: _with(p, pool_name=name, group_id=group),
    pools,
    st.sampled_from(["block_pool", "block_pool#2", "mla", ""]),
    st.integers(0, 1),
)
snapshots = st.builds(
    Snapshot, runtime=_records(RuntimeSnapshot, wire_int), pools=st.lists(pool, max_size=4)
)


def _with(record, **changes):
    for k, v in changes.items():
        setattr(record, k, v)
    return record


def _check_body(text: str, om: str) -> None:
    for parse, body in ((text_parse, text), (om_parse, om)):
        seen = set()
        for fam in parse(body):
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                assert key not in seen, f"duplicate series {key}"
                seen.add(key)
                if fam.type == "counter" and s.name.endswith("_total"):
                    assert s.value >= 0 and not math.isnan(s.value), s
                assert not math.isinf(s.value) or s.name.endswith("_bucket"), s


@pytest.fixture(scope="module")
def served():
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-test-", dir="/dev/shm")
    writer = SegmentWriter(NAME, shm_dir=shm_dir)
    targets = TargetSet(Discovery(shm_dir, prefix="kvsidecar."), polling=Polling(stale_after=3600))
    yield writer, targets, Daemon(targets)
    writer.close()
    shutil.rmtree(shm_dir, ignore_errors=True)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshot=snapshots)
def test_hostile_records_always_give_valid_exposition(served, snapshot: Snapshot) -> None:
    writer, targets, daemon = served
    writer.publish(snapshot)
    targets.poll_all()
    view = targets.targets[NAME].view
    # refused: an over-long label; corrupt: a rank, size, pid or group_id out of range
    # (identity fields, schema.md "Values"): only then.
    allowed = ("refused", "corrupt") if identity_error(snapshot) is not None else ("up", "refused")
    assert view.state in allowed, view.error
    text = daemon.metrics("")[0].decode()
    om = daemon.metrics(OM)[0].decode()
    _check_body(text, om)
    if view.state == "up":
        served_runtime = view.last.snapshot.runtime
        for f in ("step", "requests_running", "device_total_bytes", "publish_errors_total"):
            v = getattr(served_runtime, f)
            assert v is None or 0 <= v < INT_LIMIT, (f, v)
        assert served_runtime.start_time is None or math.isfinite(served_runtime.start_time)


BAD = Snapshot(
    runtime=RuntimeSnapshot(
        engine="buggy",
        model_name='m"\\\n\r\x1b[31m\x00',
        step=-5,
        start_time=float("nan"),
        requests_running=2**64 - 1,
        requests_waiting=3,
        publish_errors_total=-1,
        last_publish_duration_ns=2**63,
        device_total_bytes=-(2**63),
        initialized=True,
    ),
    pools=[
        KVCachePoolSnapshot(pool_name="block_pool", total_blocks=100, allocated_blocks=-1),
        KVCachePoolSnapshot(
            pool_name="block_pool", total_blocks=900, allocated_blocks=10, evictions_total=-7
        ),
        KVCachePoolSnapshot(pool_name="block_pool#2", total_blocks=5, frees_total=2**64 - 1),
    ],
)


def test_buggy_writer_is_served_validated_by_a_real_daemon(shm_dir: str) -> None:
    pid = fork_raw_writer(NAME, shm_dir, msgspec.msgpack.encode(BAD))
    daemon = None
    try:
        daemon, url = start_daemon(shm_dir, "--poll-interval", "0.05")
        assert wait_for(
            lambda: value(fetch(url + "/metrics")[2], "kvsidecar_source_up", segment=NAME) == 1
        )
        text = fetch(url + "/metrics")[2]
        om = fetch(url + "/metrics", {"Accept": OM})[2]
        _check_body(text, om)
        seg = {"segment": NAME}
        # Invalid values: no series; valid neighbours still served.
        assert value(text, "kvsidecar_engine_steps_total", **seg) is None
        assert value(text, "kvsidecar_engine_start_time_seconds", **seg) is None
        assert value(text, "kvsidecar_requests_running", **seg) is None
        assert value(text, "kvsidecar_requests_waiting", **seg) == 3
        rejected = "kvsidecar_source_rejected_values_total"
        assert value(text, rejected, field="runtime.step", **seg) == 1
        assert value(text, rejected, field="runtime.start_time", **seg) == 1
        assert value(text, rejected, field="pool.allocated_blocks", **seg) == 1
        assert value(text, rejected, field="pool.frees_total", **seg) == 1
        # Duplicate (pool_name, group_id): disambiguated, never a duplicate series; the
        # engine's own "block_pool#2" keeps its name.
        blocks = "kvsidecar_kv_pool_total_blocks"
        assert value(text, blocks, pool="block_pool", **seg) == 100
        assert value(text, blocks, pool="block_pool#2", **seg) == 5
        assert value(text, blocks, pool="block_pool#3", **seg) == 900
        assert value(text, "kvsidecar_source_duplicate_pools", **seg) == 1
        if shutil.which("promtool"):
            r = subprocess.run(
                ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
            )
            assert r.returncode == 0, r.stdout + r.stderr
    finally:
        if daemon is not None:
            daemon.kill()
            daemon.wait()
        stop(pid)


def _deferring(dp: int, *stamps: int) -> bytes:
    """A vLLM-named rank whose pools each hold 3 blocks deferred since a stamp."""
    return msgspec.msgpack.encode(
        Snapshot(
            runtime=RuntimeSnapshot(engine="vllm", model_name="m", dp_rank=dp, dp_size=2),
            pools=[
                KVCachePoolSnapshot(
                    pool_name=f"p{i}",
                    total_blocks=100,
                    allocated_blocks=10,
                    deferred_free_requests=1,
                    deferred_free_blocks=3,
                    oldest_deferred_free_mono_ns=stamp,
                )
                for i, stamp in enumerate(stamps)
            ],
        )
    )


def test_a_deferral_stamped_in_the_future_has_no_age(shm_dir: str) -> None:
    """A stamp later than now (2^62: in range, but 146 years of uptime; or an hour ahead)
    read as an age of 0.0 in /metrics and in the gateway body: a transfer stuck since then
    looked just begun. Now it is rejected like an out-of-range value (schema.md, "Values"):
    no age series, counted; a good stamp beside it keeps its age."""
    now = time.monotonic_ns()
    far, ahead, held = 2**62, now + 3600 * 10**9, now - 2 * 10**9
    names = ["kvsidecar.vllm.dp0.tp0.pp0", "kvsidecar.vllm.dp1.tp0.pp0"]
    pids = [
        fork_raw_writer(names[0], shm_dir, _deferring(0, far, ahead, held)),
        fork_raw_writer(names[1], shm_dir, _deferring(1, far)),
    ]
    port = free_port_run(2)
    daemon = None
    try:
        daemon, url = start_daemon(
            shm_dir, "--poll-interval", "0.05",
            "--gateway.listen-address", f"127.0.0.1:{port}", "--gateway.ranks", "2",
        )  # fmt: skip
        assert wait_for(
            lambda: all(
                value(fetch(url + "/metrics")[2], "kvsidecar_source_up", segment=n) == 1
                for n in names
            )
        )
        text = fetch(url + "/metrics")[2]
        age = "kvsidecar_kv_pool_oldest_deferred_free_age_seconds"
        seg = {"segment": names[0]}
        assert value(text, age, pool="p0", **seg) is None  # was 0.0
        assert value(text, age, pool="p1", **seg) is None  # was 0.0
        assert value(text, age, pool="p2", **seg) >= 2.0
        assert value(text, "kvsidecar_kv_pool_deferred_free_blocks", pool="p0", **seg) == 3
        field = "pool.oldest_deferred_free_mono_ns"
        rejected = "kvsidecar_source_rejected_values_total"
        assert value(text, rejected, field=field, **seg) == 2
        assert value(text, rejected, field=field, segment=names[1]) == 1
        # The gateway: the rank's oldest known deferral, and none where none is known.
        bodies = [fetch(f"http://127.0.0.1:{port + r}/metrics")[2] for r in (0, 1)]
        held_age = "kvsidecar_rank_oldest_deferred_free_age_seconds"
        assert value(bodies[0], held_age) >= 2.0
        assert value(bodies[1], held_age) is None, bodies[1]  # was 0.0
        assert value(bodies[1], "kvsidecar_rank_kv_blocks_deferred_free") == 3
    finally:
        if daemon is not None:
            daemon.kill()
            daemon.wait()
        for pid in pids:
            stop(pid)
