"""Collector and exposition: unsupported fields give no series; our text == prometheus_client."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import CollectorRegistry, generate_latest

from kvsidecar.daemon.collector import SnapshotCollector
from kvsidecar.daemon.exposition import render_text
from kvsidecar.daemon.target import DEAD, UP, TargetView
from kvsidecar.protocol.reader import Reading
from kvsidecar.protocol.schema import KVCachePoolSnapshot, RuntimeSnapshot, Snapshot
from tests.support.scrape import samples, value


def _view(
    name: str,
    pools: list[KVCachePoolSnapshot],
    state: str = UP,
    dp: int = 0,
    model: str = 'm"x\\y\nz',
) -> TargetView:
    snap = Snapshot(
        runtime=RuntimeSnapshot(
            engine="e",
            model_name=model,
            dp_rank=dp,
            requests_deferred_free=dp + 1,
            requests_deferred_free_distinct=dp + 1,
        ),
        pools=pools,
    )
    reading = Reading(
        snapshot=snap,
        seq=9,
        incarnation=1,
        generation=1,
        heartbeat_mono_ns=0,
        heartbeat_wall_ns=0,
        start_wall_ns=0,
        writer_pid=1,
        attempts=1,
        state=1,
    )
    return TargetView(name=name, state=state, last=reading)


def test_unsupported_fields_have_no_series() -> None:
    kvcached_like = KVCachePoolSnapshot(
        pool_name="block_pool", total_blocks=100, allocated_blocks=10, block_size_tokens=16
    )
    text = render_text(SnapshotCollector(lambda: [_view("s", [kvcached_like])]).collect()).decode()
    assert value(text, "kvsidecar_kv_pool_allocated_blocks", segment="s") == 10
    for name in (
        "kvsidecar_kv_pool_cached_blocks",
        "kvsidecar_kv_pool_deferred_free_blocks",
        "kvsidecar_kv_pool_tokens_used",
        "kvsidecar_kv_pool_evictions_total",
        "kvsidecar_kv_pool_token_usage_ratio",
        "kvsidecar_kv_pool_shrink_target_blocks",
    ):
        assert value(text, name, segment="s") is None, name
    # No pool supports deferral: unsupported, so no DP sum either (not a fake 0).
    assert value(text, "kvsidecar_dp_kv_blocks_deferred_free", engine="e") is None


def test_not_up_targets_export_health_only() -> None:
    pool = KVCachePoolSnapshot(total_blocks=100, allocated_blocks=10, deferred_free_blocks=4)
    views = [_view("a", [pool]), _view("b", [pool], state=DEAD, dp=1)]
    text = render_text(SnapshotCollector(lambda: views).collect()).decode()
    assert value(text, "kvsidecar_kv_pool_allocated_blocks", segment="a") == 10
    assert value(text, "kvsidecar_kv_pool_allocated_blocks", segment="b") is None
    assert value(text, "kvsidecar_source_up", segment="b") == 0
    assert value(text, "kvsidecar_source_state", segment="b", state="dead") == 1
    # DP sums only count fresh data.
    assert value(text, "kvsidecar_dp_requests_deferred_free", engine="e") == 1
    assert value(text, "kvsidecar_dp_kv_blocks_deferred_free", engine="e") == 4


def test_fast_renderer_matches_prometheus_client() -> None:
    pools = [
        KVCachePoolSnapshot(
            pool_name=f"p{i}",
            total_blocks=10**i + 1,
            allocated_blocks=i,
            tokens_used=3 * i,
            block_size_tokens=16,
            cached_blocks=0,
            allocs_total=2**40 + i,
            mapped_bytes=123456789012345,
        )
        for i in range(4)
    ]
    views = [_view(f"seg{d}", pools, dp=d) for d in range(3)]
    views.append(replace(_view("dead", pools), state=DEAD))
    collector = SnapshotCollector(lambda: views)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ours = render_text(collector.collect())
    theirs = generate_latest(registry)

    def stable(body: bytes) -> list[bytes]:  # the age moves between the two renders
        return [line for line in body.splitlines() if b"snapshot_age_seconds{" not in line]

    assert stable(ours) == stable(theirs)
    assert len(samples(ours.decode())) > 200


def test_oldest_deferral_age_is_computed_at_scrape_time() -> None:
    import time

    since = time.monotonic_ns() - 3_000_000_000  # deferred 3 s ago
    pools = [
        KVCachePoolSnapshot(pool_name="held", oldest_deferred_free_mono_ns=since),
        KVCachePoolSnapshot(pool_name="idle", oldest_deferred_free_mono_ns=0),
        KVCachePoolSnapshot(pool_name="unsupported"),
    ]
    collector = SnapshotCollector(lambda: [_view("s", pools)])
    name = "kvsidecar_kv_pool_oldest_deferred_free_age_seconds"
    first = value(render_text(collector.collect()).decode(), name, pool="held")
    assert 3.0 <= first < 60.0
    time.sleep(0.05)
    text = render_text(collector.collect()).decode()
    assert value(text, name, pool="held") > first  # grows without a new snapshot
    assert value(text, name, pool="idle") == 0
    assert value(text, name, pool="unsupported") is None


def test_pool_fields_in_another_unit_are_scaled_to_the_metric_unit() -> None:
    """Hold times are published in ns and exported in seconds (MetricDef.scale), for pool
    fields as for runtime ones."""
    from kvsidecar.daemon import metric_defs as md

    scaled = [m for m in md.POOL if m.scale != 1.0]
    assert {m.field for m in scaled} >= {"deferred_free_ended_ns_total"}
    pools = [KVCachePoolSnapshot(**{m.field: 2_500_000_000 for m in scaled})]
    text = render_text(SnapshotCollector(lambda: [_view("s", pools)]).collect()).decode()
    for m in scaled:
        assert value(text, m.name) == 2_500_000_000 * m.scale, m.name


def test_duplicate_pools_never_give_duplicate_series() -> None:
    """Two pools with the same (pool_name, group_id): disambiguated in payload order."""
    pools = [
        KVCachePoolSnapshot(pool_name="block_pool", total_blocks=100),
        KVCachePoolSnapshot(pool_name="block_pool", total_blocks=900),
        KVCachePoolSnapshot(pool_name="block_pool#2", total_blocks=5),  # a real pool's name
        KVCachePoolSnapshot(pool_name="block_pool", group_id=1, total_blocks=7),  # other group
        KVCachePoolSnapshot(pool_name="block_pool", total_blocks=1),
    ]
    collector = SnapshotCollector(lambda: [_view("s", pools)])
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    for body in (render_text(collector.collect()), generate_latest(registry)):
        text = body.decode()
        keys = [(n, tuple(sorted(lab.items()))) for n, lab, _ in samples(text)]
        assert len(keys) == len(set(keys)), "duplicate series"
        name = "kvsidecar_kv_pool_total_blocks"
        assert value(text, name, pool="block_pool", group="0") == 100
        assert value(text, name, pool="block_pool#2", group="0") == 5
        assert value(text, name, pool="block_pool#3", group="0") == 900
        assert value(text, name, pool="block_pool#4", group="0") == 1
        assert value(text, name, pool="block_pool", group="1") == 7
        assert value(text, "kvsidecar_source_duplicate_pools", segment="s") == 2


def test_label_cache_is_bounded_in_bytes() -> None:
    """A writer churning a 2 KB model_name must not grow the renderer's memory (it did by
    ~220 MB in 60 s): every distinct label set used to be cached up to 65,536 entries."""
    import gc
    import tracemalloc

    from kvsidecar.daemon import exposition

    pool = KVCachePoolSnapshot(pool_name="p", total_blocks=10, allocated_blocks=1)
    exposition._label_cache.clear()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(600):
            view = _view("s", [pool], model="m" * 2000 + str(i))
            render_text(SnapshotCollector(lambda v=view: [v]).collect())
            del view
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        exposition._label_cache.clear()
    assert retained < 8 * 1024 * 1024, retained  # cap 4 MiB (+ slack); unbounded: ~40 MB
