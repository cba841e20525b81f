"""Issue #12 item 7: two pools registered under one (pool_name, group_id) must not give
duplicate series; the agent disambiguates deterministically, logs once, never raises."""

from __future__ import annotations

import logging

from kvsidecar.agent.agent import KVSidecarAgent
from kvsidecar.agent.pool import KVBlockPool
from kvsidecar.daemon.collector import SnapshotCollector
from kvsidecar.daemon.exposition import render_text
from kvsidecar.daemon.target import Target
from kvsidecar.protocol.reader import Reading, read_segment
from tests.support.scrape import samples


def _pool(n: int = 16, **kw) -> KVBlockPool:
    return KVBlockPool(n, 4, num_layers=1, kv_heads=1, head_dim=2, device="cpu", **kw)


def test_pools_with_default_names_get_distinct_series(shm_dir: str, caplog) -> None:
    agent = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu")
    with caplog.at_level(logging.WARNING):
        for n in (100, 900, 50):
            assert agent.register_pool(_pool(n)) is True  # all default "block_pool", group 0
        assert agent.register_pool(_pool(10, pool_name="block_pool_2", group_id=1)) is True
    agent.step()
    r = read_segment(agent.segment_name, shm_dir=shm_dir)
    assert isinstance(r, Reading)
    got = [(p.pool_name, p.group_id, p.total_blocks) for p in r.snapshot.pools]
    assert got == [
        ("block_pool", 0, 100),
        ("block_pool_2", 0, 900),  # the 900-block pool no longer vanishes in Prometheus
        ("block_pool_3", 0, 50),
        ("block_pool_2", 1, 10),  # another group: its name is free there
    ]
    assert sum("already registered" in rec.message for rec in caplog.records) == 2
    view = Target(agent.segment_name, shm_dir, stale_after=60).poll()
    text = render_text(SnapshotCollector(lambda: [view]).collect()).decode()
    keys = [(n, tuple(sorted(lab.items()))) for n, lab, _ in samples(text)]
    dupes = {k for k in keys if keys.count(k) > 1}
    assert not dupes, sorted(dupes)[:3]
    totals = {
        lab["pool"] + "/" + lab["group"]: v
        for n, lab, v in samples(text)
        if n == "kvsidecar_kv_pool_total_blocks"
    }
    assert totals == {
        "block_pool/0": 100,
        "block_pool_2/0": 900,
        "block_pool_3/0": 50,
        "block_pool_2/1": 10,
    }
    agent.step()  # the names stay put from step to step
    again = read_segment(agent.segment_name, shm_dir=shm_dir).snapshot.pools
    assert [p.pool_name for p in again] == [g[0] for g in got]
    agent.close()
