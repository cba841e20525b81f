"""Issue #12 item 13: the agent never raises into the engine, accepts the usual numeric
scalars, and a publisher that keeps failing is visible to the daemon (segment header)."""

from __future__ import annotations

import logging

import numpy as np
import torch

from kvsidecar.agent.agent import KVSidecarAgent
from kvsidecar.agent.pool import KVBlockPool
from kvsidecar.daemon.collector import SnapshotCollector
from kvsidecar.daemon.exposition import render_text
from kvsidecar.daemon.target import Target
from kvsidecar.protocol.reader import Reading, SegmentReader, read_segment
from kvsidecar.protocol.schema import KVCachePoolSnapshot
from tests.support.scrape import value


def _pool(**kw) -> KVBlockPool:
    return KVBlockPool(16, 4, num_layers=1, kv_heads=1, head_dim=2, device="cpu", **kw)


def test_numpy_torch_and_huge_scalars_are_published_not_failed(shm_dir: str) -> None:
    agent = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu")
    agent.register_pool(_pool())
    cases = [
        ((np.int64(3), np.int32(2), np.uint8(1)), (3, 2, 1)),
        ((torch.tensor(5), torch.tensor([4]), torch.tensor(2.0)), (5, 4, 2)),
        ((np.float64(7.9), 6.0, True), (7, 6, 1)),
        ((2**64 + 5, 2**70, -3), (2**63 - 1, 2**63 - 1, 0)),  # clamped to what readers take
        ((float("inf"), np.float32(-1.5), 0), (2**63 - 1, 0, 0)),
    ]
    for args, want in cases:
        agent.step(*args)
        r = read_segment(agent.segment_name, shm_dir=shm_dir)
        assert isinstance(r, Reading), r
        rt = r.snapshot.runtime
        assert (rt.requests_running, rt.requests_waiting, rt.requests_deferred_free) == want
        assert all(type(v) is int for v in want)
    assert agent.runtime.publish_errors_total == 0
    agent.close()


def test_bad_constructor_and_register_pool_arguments_never_raise(shm_dir: str, caplog) -> None:
    agent = KVSidecarAgent(
        123,  # not a str
        None,
        dp_rank="x",
        tp_rank=np.int64(1),
        dp_size=-4,
        device="no-such-device",
        heartbeat_interval="soon",
        shm_dir=shm_dir,
        group=object(),
    )
    # A wrong group disables the segment but nothing is raised; then sane values work.
    assert not agent.enabled and agent.error
    agent.step(1, 2)
    agent.close()
    agent = KVSidecarAgent(
        123, None, dp_rank="x", tp_rank=np.int64(1), device="no-such-device", shm_dir=shm_dir
    )
    assert agent.enabled, agent.error
    assert agent.runtime.engine == "123" and agent.runtime.dp_rank == 0
    assert agent.runtime.tp_rank == 1 and type(agent.runtime.tp_rank) is int

    class Broken:
        def snapshot(self):
            raise RuntimeError("adapter bug")

    class WrongType:
        def snapshot(self):
            return {"pool_name": "x"}

    pool = _pool()
    for bad in (None, object(), Broken(), WrongType(), 42):
        assert agent.register_pool(bad) is False  # refused, not raised
    assert agent.register_pool(pool) is True
    assert agent.register_pool(pool) is False  # the same pool twice would double-count
    agent.step(1, 0)
    r = read_segment(agent.segment_name, shm_dir=shm_dir)
    assert isinstance(r, Reading) and len(r.snapshot.pools) == 1
    assert agent.runtime.publish_errors_total == 0
    agent.close()
    KVSidecarAgent(env=42).close()  # even an env that is not a mapping
    assert any("refusing to publish" in rec.message for rec in caplog.records)


class _FlakySource:
    """A pool source that works at registration and then breaks (an adapter bug)."""

    def __init__(self) -> None:
        self.broken = False

    def snapshot(self) -> KVCachePoolSnapshot:
        if self.broken:
            raise RuntimeError("engine internals changed")
        return KVCachePoolSnapshot(pool_name="flaky", total_blocks=8)


def test_a_pool_failing_from_the_start_is_visible_in_the_header(shm_dir: str) -> None:
    """Issue 24 item 6: the failing pool is left out, the rest is published, and every
    such step is counted in the header with its reason (not a whole failed publish)."""
    agent = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu")
    source = _FlakySource()
    assert agent.register_pool(source)
    source.broken = True
    for _ in range(5):
        agent.step(1, 0)
    with SegmentReader(agent.segment_name, shm_dir=shm_dir) as reader:
        assert reader.attach() is None
        result = reader.read()
        header = reader.header
    assert isinstance(result, Reading) and result.snapshot.pools == [], result
    assert result.snapshot.runtime.publish_errors_total == 5
    assert header is not None and header.publish_errors_total == 5
    # A string where a count belongs: dropped, counted with its own reason.
    source.broken = False
    agent.step("three", 0)
    agent.close()


def test_failing_publishes_after_a_good_one_reach_the_daemon_metric(shm_dir: str) -> None:
    agent = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu")
    source = _FlakySource()
    agent.register_pool(source)
    agent.step(1, 0)
    target = Target(agent.segment_name, shm_dir, stale_after=60)
    assert target.poll().state == "up"
    source.broken = True
    for _ in range(3):
        agent.step(1, 0)
    source.broken = False
    agent.step("not a number", 0)
    view = target.poll()
    assert view.last.publish_errors_total == 4 and view.last.last_publish_error == "bad_argument"
    text = render_text(SnapshotCollector(lambda: [view]).collect()).decode()
    seg = agent.segment_name
    assert value(text, "kvsidecar_source_publish_errors_total", segment=seg) == 4
    agent.close()


def test_unencodable_pool_values_are_counted_with_their_reason(shm_dir: str, caplog) -> None:
    agent = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu")
    rec = KVCachePoolSnapshot(pool_name="p", total_blocks=np.int64(9))  # numpy: encoded fine
    agent.register_pool(type("S", (), {"snapshot": lambda self: rec})())
    agent.step()
    r = read_segment(agent.segment_name, shm_dir=shm_dir)
    assert isinstance(r, Reading) and r.snapshot.pools[0].total_blocks == 9
    rec.allocated_blocks = 2**64  # no reader could take it: a counted, logged failure
    with caplog.at_level(logging.WARNING):
        agent.step()
        agent.step()
    r = read_segment(agent.segment_name, shm_dir=shm_dir)
    assert r.publish_errors_total == 2 and r.last_publish_error == "encode"
    assert sum("publish failed" in m.message for m in caplog.records) == 1
    agent.close()
