"""One bad value or one failing pool drops that value or that pool, not the snapshot;
long honest names are shortened with a marker, not refused (issue 24 item 6). Real
agent, real segment, read back with the daemon's reader and checked against its budget."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("torch")

from kvsidecar.agent import KVBlockPool, KVSidecarAgent
from kvsidecar.daemon import budget
from kvsidecar.protocol.reader import Reading, read_segment


def read(agent: KVSidecarAgent):
    r = read_segment(agent.segment_name, shm_dir=agent.shm_dir)
    assert isinstance(r, Reading), r
    return r.snapshot


class Broken:
    """A pool source that worked at registration and fails afterwards."""

    def __init__(self, pool: KVBlockPool) -> None:
        self.pool, self.fail = pool, False

    def snapshot(self):
        if self.fail:
            raise RuntimeError("device lost")
        return self.pool.snapshot()


@pytest.fixture
def agent(tmp_path: Path):
    a = KVSidecarAgent("vllm", "m", shm_dir=str(tmp_path), enabled=True)
    yield a
    a.close()


def pool(name: str) -> KVBlockPool:
    return KVBlockPool(8, 16, num_layers=1, kv_heads=1, head_dim=8, device="cpu", pool_name=name)


def test_one_failing_pool_drops_that_pool_only(agent: KVSidecarAgent) -> None:
    bad = Broken(pool("bad"))
    assert agent.register_pool(pool("good")) and agent.register_pool(bad)
    agent.step(3, 1)
    bad.fail = True
    agent.step(4, 2)
    snap = read(agent)
    assert snap.runtime.requests_running == 4, "the step was published"
    assert [p.pool_name for p in snap.pools] == ["good"]
    bad.fail = False
    agent.step(5, 2)
    assert [p.pool_name for p in read(agent).pools] == ["good", "bad"], "it comes back"


@pytest.mark.parametrize("bad", [math.nan, "3", object()])
def test_one_bad_value_drops_that_value_only(agent: KVSidecarAgent, bad: object) -> None:
    assert agent.register_pool(pool("p"))
    agent.step(3, 1)
    agent.step(bad, 7)  # type: ignore[arg-type]
    snap = read(agent)
    assert snap.runtime.step == 2, "the snapshot was published"
    assert snap.runtime.requests_waiting == 7
    assert snap.runtime.requests_running == 3, "the bad value kept its previous one"
    agent.step(2, 7, requests_deferred_free=bad)  # type: ignore[arg-type]
    assert read(agent).runtime.step == 3


LABEL_MAX = budget.DEFAULT_MAX_LABEL_LENGTH  # the daemon's default --max-label-length


def published_model_name(tmp_path: Path, model: str, dp_rank: int = 0):
    a = KVSidecarAgent("vllm", model, dp_rank=dp_rank, shm_dir=str(tmp_path), enabled=True)
    try:
        assert a.register_pool(pool("p" * 300))
        a.step(1, 0)
        return read(a)
    finally:
        a.close()


def test_long_model_name_is_shortened_not_refused(tmp_path: Path) -> None:
    model = "/models/" + "org-" * 60 + "Llama-3.1-8B-Instruct"  # ~270 characters
    snap = published_model_name(tmp_path, model)
    name = snap.runtime.model_name
    assert len(name.encode()) == LABEL_MAX and "\u2026" in name
    assert name.endswith("Llama-3.1-8B-Instruct")
    assert len(snap.pools[0].pool_name.encode()) == LABEL_MAX
    budget.check(snap, budget.Budget())  # the daemon serves it: no OverBudget
    other = published_model_name(tmp_path, "x" + model, dp_rank=1).runtime.model_name
    assert other != name, "two long names stay distinct"


def test_long_non_ascii_model_name_is_shortened_in_bytes(tmp_path: Path) -> None:
    """The daemon counts UTF-8 bytes (issue 31 item 2): 100 emoji are 100 characters but
    400 bytes, and were published whole, then refused by every default daemon."""
    snap = published_model_name(tmp_path, "\U0001f600" * 100 + "-8B")
    name = snap.runtime.model_name
    assert len(name.encode()) <= LABEL_MAX and "\u2026" in name and name.endswith("-8B")
    budget.check(snap, budget.Budget())  # the daemon serves it: no OverBudget
