"""Issue #22, the agent's side of the contract: one meaning per field for our pool and the
agent, whatever the sources beside it."""

from __future__ import annotations

import time

import pytest

from kvsidecar.agent.agent import DEFAULT_HEARTBEAT_INTERVAL, KVSidecarAgent
from kvsidecar.agent.pool import KVBlockPool
from kvsidecar.protocol.reader import Reading, read_segment
from kvsidecar.protocol.schema import KVCachePoolSnapshot


def _pool(n: int = 32, **kw) -> KVBlockPool:
    return KVBlockPool(n, 4, num_layers=1, kv_heads=1, head_dim=2, device="cpu", **kw)


def _runtime(agent: KVSidecarAgent, shm_dir: str):
    r = read_segment(agent.segment_name, shm_dir=shm_dir)
    assert isinstance(r, Reading), r
    return r.snapshot


class _Counts:
    """An adapter that reports a deferred count but no request ids (like ATOM's)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def snapshot(self) -> KVCachePoolSnapshot:
        return KVCachePoolSnapshot(pool_name="adapter", deferred_free_requests=self.n)


def test_register_pool_alias_does_not_outlive_the_agent(shm_dir: str) -> None:
    """The alias is the agent's way of publishing a taken name; the pool's own record
    keeps its name, so a second agent (or the engine) sees the pool as it is."""
    first, second = _pool(), _pool()
    agent = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu", heartbeat_interval=0)
    assert agent.register_pool(first) and agent.register_pool(second)
    agent.step()
    assert [p.pool_name for p in _runtime(agent, shm_dir).pools] == ["block_pool", "block_pool_2"]
    assert second.snapshot().pool_name == "block_pool"  # between steps too
    agent.step()
    assert [p.pool_name for p in _runtime(agent, shm_dir).pools] == ["block_pool", "block_pool_2"]
    agent.close()
    assert second.snapshot().pool_name == "block_pool"
    other = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu", heartbeat_interval=0)
    assert other.register_pool(second)
    other.step()
    assert [p.pool_name for p in _runtime(other, shm_dir).pools] == ["block_pool"]
    other.close()


@pytest.mark.parametrize("bad", [1.5, "7", None])
def test_allocate_prompt_refuses_token_ids_append_slots_refuses(bad: object) -> None:
    pool = _pool()
    with pytest.raises(TypeError, match="token id"):
        pool.allocate_prompt("r", [1, 2, bad, 4])
    assert "r" not in pool._requests and pool.snapshot().allocated_blocks == 0
    pool.allocate_prompt("ok", [1, 2, 3])
    with pytest.raises(TypeError, match="token id"):
        pool.append_slots("ok", 1, [bad])


def test_a_deferred_request_holding_no_blocks_is_not_counted() -> None:
    """schema.md: deferral fields count requests holding blocks of the pool. A request
    with an empty table is still deferred (release works), but counts nowhere."""
    pool = _pool()
    pool.allocate_prompt("empty", [])
    assert pool.finish("empty", ["pd"]) is True
    s = pool.snapshot()
    assert (s.deferred_free_requests, s.deferred_free_blocks) == (0, 0)
    assert s.oldest_deferred_free_mono_ns == 0
    assert pool.release("empty", "pd") is True
    pool.allocate_prompt("full", [1, 2, 3, 4, 5])
    pool.finish("full", ["pd"])
    assert pool.snapshot().deferred_free_requests == 1
    assert pool.snapshot().oldest_deferred_free_mono_ns > 0


def test_distinct_count_from_one_adapter_beside_a_pool_deferring_nothing(shm_dir: str) -> None:
    """The docstring's promise: exact from a single pool that reports a count, when the
    pools with ids defer nothing."""
    agent = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu", heartbeat_interval=0)
    pool, adapter = _pool(), _Counts(3)
    agent.register_pool(pool)
    agent.register_pool(adapter)
    agent.step()
    assert _runtime(agent, shm_dir).runtime.requests_deferred_free_distinct == 3
    pool.allocate_prompt("r", [1, 2, 3, 4, 5])
    pool.finish("r", ["pd"])
    agent.step()  # now both defer: a request may be in both, so the agent cannot tell
    assert _runtime(agent, shm_dir).runtime.requests_deferred_free_distinct is None
    adapter.n = 0
    agent.step()  # the adapter defers nothing: the pool's ids are exact
    assert _runtime(agent, shm_dir).runtime.requests_deferred_free_distinct == 1
    agent.close()


def test_default_heartbeat_keeps_an_idle_rank_fresh(shm_dir: str) -> None:
    """The default: a heartbeat every DEFAULT_HEARTBEAT_INTERVAL s while no step happens,
    so an idle engine with a stuck transfer stays up and its deferral age stays served."""
    agent = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu")
    try:
        pool = _pool()
        agent.register_pool(pool)
        pool.allocate_prompt("stuck", [1, 2, 3, 4, 5])
        pool.finish("stuck", ["pd"])
        agent.step()
        first = read_segment(agent.segment_name, shm_dir=shm_dir)
        deadline = time.monotonic() + 30 * DEFAULT_HEARTBEAT_INTERVAL  # generous: loaded host
        while time.monotonic() < deadline:
            now = read_segment(agent.segment_name, shm_dir=shm_dir)
            if now.heartbeat_mono_ns > first.heartbeat_mono_ns:
                break
            time.sleep(0.05)
        assert now.heartbeat_mono_ns > first.heartbeat_mono_ns, "no idle heartbeat by default"
        assert now.seq == first.seq  # no publish: only the heartbeat moved
    finally:
        agent.close()
    off = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu", heartbeat_interval=0)
    off.step()
    before = read_segment(off.segment_name, shm_dir=shm_dir).heartbeat_mono_ns
    time.sleep(3 * DEFAULT_HEARTBEAT_INTERVAL)
    assert read_segment(off.segment_name, shm_dir=shm_dir).heartbeat_mono_ns == before
    off.close()


def test_pool_publishes_both_prefix_units_and_their_ratios_differ() -> None:
    """schema.md: block counters stop at the first miss, token counters count the whole
    prompt; our pool publishes both, and one prompt shows they are not one ratio."""
    pool = _pool(64)
    first = list(range(80))  # 20 full blocks of 4
    pool.allocate_prompt("a", first)
    pool.allocate_prompt("b", first[:20] + [999] * 60)  # 5 blocks hit, then a miss
    s = pool.snapshot()
    # a: one block looked up (a miss); b: 5 hits and the miss that stopped the lookup.
    assert (s.prefix_queries_total, s.prefix_hits_total) == (7, 5)
    assert (s.prefix_query_tokens_total, s.prefix_hit_tokens_total) == (160, 20)
    assert 5 / 7 != 20 / 160  # the block ratio is not the token ratio


def test_a_writer_keeps_within_a_default_daemons_label_budget(shm_dir: str) -> None:
    """segment-format.md section 8: a long pool name and a long model name are shortened
    with a marker (issue 24: never refused); a default daemon serves the rank."""
    from kvsidecar.agent.agent import shorten
    from kvsidecar.daemon.config import Discovery, Polling
    from kvsidecar.daemon.targets import TargetSet
    from kvsidecar.protocol.schema import MAX_LABEL_LENGTH

    long = "m" * 300
    agent = KVSidecarAgent("t", long, shm_dir=shm_dir, device="cpu", heartbeat_interval=0)
    try:
        assert agent.register_pool(_pool(pool_name="p" * (MAX_LABEL_LENGTH + 1))) is True
        assert agent.register_pool(_pool(pool_name="q" * MAX_LABEL_LENGTH)) is True
        agent.step()
        targets = TargetSet(
            Discovery(shm_dir, names=(agent.segment_name,)), polling=Polling(stale_after=3600)
        )
        targets.poll_all()
        view = targets.targets[agent.segment_name].view
        targets.stop()
        assert view.state == "up", view.error
        assert view.last.snapshot.runtime.model_name == shorten(long)
        assert len(shorten(long).encode()) == MAX_LABEL_LENGTH and "\u2026" in shorten(long)
        names = [p.pool_name for p in view.last.snapshot.pools]
        assert names[1] == "q" * MAX_LABEL_LENGTH
        assert len(names[0].encode()) == MAX_LABEL_LENGTH and "\u2026" in names[0]
    finally:
        agent.close()


class _Raising:
    """A pool source that works at registration, then raises once ``broken``, or makes
    the payload too large for its slot once ``huge``."""

    broken = huge = False

    def snapshot(self) -> KVCachePoolSnapshot:
        if self.broken:
            raise RuntimeError("pool source broken")
        return KVCachePoolSnapshot(pool_name="flaky", pool_type="x" * (20_000 * self.huge))


def test_step_counts_what_the_documents_say(shm_dir: str) -> None:
    """Issue 30 item 7: schema.md's step row said calls with a raising pool source or a
    refused argument do not count, and segment-format.md section 6 that a bad count keeps
    its previous value; both publish and count a step, and a bad deferred count is null."""
    import os

    from tests.conftest import REPO

    agent = KVSidecarAgent("e", "m", shm_dir=shm_dir, device="cpu")
    agent.register_pool(_pool())
    agent.step(3, 2, 1)
    assert _runtime(agent, shm_dir).runtime.step == 1
    flaky = _Raising()
    agent.register_pool(flaky)
    flaky.broken = True
    agent.step(4, 2)  # a pool left out: published, counted
    r = _runtime(agent, shm_dir).runtime
    assert (r.step, r.requests_running, r.publish_errors_total) == (2, 4, 1)
    agent.step("x", float("nan"), "y")  # no value is a count: published, counted
    r = _runtime(agent, shm_dir).runtime
    assert (r.step, r.requests_running, r.requests_waiting) == (3, 4, 2)  # previous values
    assert r.requests_deferred_free_distinct is None  # null for that step
    assert r.requests_deferred_free == 0  # v1.0: the largest pool count (none deferred)
    assert r.publish_errors_total == 2  # once per call, however many parts it dropped
    flaky.broken, flaky.huge = False, True
    agent.step(5, 2)  # reached the publish, which failed (too_large): counted
    flaky.huge = False
    agent.step(6, 2)
    assert _runtime(agent, shm_dir).runtime.step == 5
    agent.close()
    flat = {}
    for doc in ("schema.md", "segment-format.md"):
        with open(os.path.join(REPO, "docs", doc)) as f:
            flat[doc] = " ".join(f.read().split())
    assert "whose arguments were refused do not count" not in flat["schema.md"]
    assert (
        "it counts the calls that reached the publish, those with a pool source that raised "
        "or a value that was not a count included" in flat["schema.md"]
    )
    section6 = flat["segment-format.md"]
    assert "a step() value that is not a count keeps its previous value" not in section6
    for rule in (
        "a `requests_running` or `requests_waiting` that is not a count keeps its previous "
        "value; a `requests_deferred_free` that is not a count reads as null for that step",
        "Each such call still publishes, counts a step and counts once in `publish_errors_total`",
    ):
        assert rule in section6, rule
