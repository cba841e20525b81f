"""The demo engine in-process: paged attention through a KVBlockPool reproduces plain
causal attention, token for token, under prefix reuse, batching and evictions."""

from __future__ import annotations

from collections import deque

import pytest

from kvsidecar.agent.demo.engine import Engine
from kvsidecar.agent.demo.model import dense_generate
from kvsidecar.agent.demo.options import Options
from kvsidecar.agent.demo.workload import Request, Workload, WorkloadConfig

pytestmark = pytest.mark.timeout(60)


def test_paged_engine_matches_dense_attention() -> None:
    # A small pool: the scheduler must queue requests, and cached prefixes get evicted.
    opts = Options(num_blocks=24, max_batch=6, device="cpu")
    engine = Engine(opts)
    workload = Workload(WorkloadConfig(seed=3))
    queue: deque[Request] = deque(workload.make(i) for i in range(14))
    done: list[Request] = []
    while queue or engine.running:
        done += engine.decode_step()
        done += engine.start_decoding(engine.prefill(queue))
        assert engine.running or done or not queue, "admission stalled with an idle engine"
    assert len(done) == 14
    for r in done:
        assert len(r.output) == r.max_new
        assert r.output == dense_generate(engine.model, r.prompt, r.max_new), r.req_id
    s = engine.pool.stats
    assert s.prefix_hits_total > 0 and s.evictions_total > 0
    assert any(r.cached_tokens for r in done)
    assert s.allocated_blocks == 0 and s.cached_blocks > 0  # idle level
    assert s.alloc_failures_total == 0  # admission kept room: decode never ran short


def test_workload_is_a_function_of_seed_and_index() -> None:
    a = Workload(WorkloadConfig(seed=1, rate=5))
    b = Workload(WorkloadConfig(seed=1, rate=500))
    assert [a.make(i).prompt for i in range(5)] == [b.make(i).prompt for i in range(5)]
    assert a.make(0).prompt != Workload(WorkloadConfig(seed=2)).make(0).prompt
    capped = Workload(WorkloadConfig(rate=1000, max_requests=3), start=0.0)
    assert [r.req_id for r in capped.poll(100.0)] == ["req-0", "req-1", "req-2"]
    assert capped.exhausted and capped.next_arrival() == float("inf")
