"""Issue #12 item 17: deferred-request numbers that are what they say.

* unsupported (no pool reports deferral) = null = no series, per rank and in DP sums;
* the runtime count is the number of *distinct* deferred requests, not the max over pools;
* DP sums add only the DP ranks of one engine instance, never two look-alike engines.
"""

from __future__ import annotations

import socket
import subprocess
import sys

from kvsidecar.agent.agent import KVSidecarAgent
from kvsidecar.agent.engines.kvcached import KvcachedDictAdapter
from kvsidecar.agent.pool import KVBlockPool
from kvsidecar.daemon.collector import SnapshotCollector
from kvsidecar.daemon.exposition import render_text
from kvsidecar.daemon.target import Target
from kvsidecar.protocol.reader import read_segment
from tests.conftest import REPO
from tests.support.scrape import samples, value


def _pool(**kw) -> KVBlockPool:
    return KVBlockPool(32, 4, num_layers=1, kv_heads=1, head_dim=2, device="cpu", **kw)


def _defer(pool: KVBlockPool, rid: str) -> None:
    pool.allocate_prompt(rid, list(range(6)))
    pool.finish(rid, ["pd"])


def _scrape(shm_dir: str, *agents: KVSidecarAgent) -> str:
    views = [Target(a.segment_name, shm_dir, stale_after=60).poll() for a in agents]
    assert all(v.state == "up" for v in views), views
    return render_text(SnapshotCollector(lambda: views).collect()).decode()


def test_a_deferred_request_without_blocks_is_neither_running_nor_deferred() -> None:
    """Issue 30 item 3: it was counted as running (num_running 1, expected 0)."""
    pool = _pool()
    pool.allocate_prompt("z", [])
    assert pool.num_running == 1
    assert pool.finish("z", "pd") is True
    assert (pool.num_running, pool.stats.deferred_free_requests) == (0, 0)
    _defer(pool, "r")
    assert (pool.num_running, pool.stats.deferred_free_requests) == (0, 1)
    assert pool.release("z", "pd") and pool.release("r", "pd")
    assert (pool.num_running, pool.stats.deferred_free_requests) == (0, 0)


KVCACHED = {"total_blocks": 100, "allocated_blocks": 10, "num_layers": 2}


def test_pools_without_deferral_export_no_deferred_series(shm_dir: str) -> None:
    agent = KVSidecarAgent("e", "m", shm_dir=shm_dir, device="cpu")
    agent.register_pool(KvcachedDictAdapter(lambda: KVCACHED))
    agent.step(3, 1)
    rt = read_segment(agent.segment_name, shm_dir=shm_dir).snapshot.runtime
    assert rt.requests_deferred_free_distinct is None  # cannot tell: null, not 0
    text = _scrape(shm_dir, agent)
    assert value(text, "kvsidecar_requests_running", segment=agent.segment_name) == 3
    for name in (
        "kvsidecar_requests_deferred_free",
        "kvsidecar_dp_requests_deferred_free",
        "kvsidecar_dp_kv_blocks_deferred_free",
    ):
        assert value(text, name, engine="e") is None, name
    agent.close()


def test_runtime_count_is_distinct_requests_not_the_max_over_pools(shm_dir: str) -> None:
    agent = KVSidecarAgent("e", "m", shm_dir=shm_dir, device="cpu")
    full, swa = _pool(pool_name="full"), _pool(pool_name="swa", group_id=1)
    agent.register_pool(full)
    _defer(full, "r1")  # deferred before registration is counted too
    agent.register_pool(swa)
    _defer(swa, "r2")  # a different request in the other pool
    _defer(full, "r3")
    _defer(swa, "r3")  # one request in both pools (hybrid groups): once
    agent.step()
    rt = read_segment(agent.segment_name, shm_dir=shm_dir).snapshot.runtime
    assert (full.stats.deferred_free_requests, swa.stats.deferred_free_requests) == (2, 2)
    assert rt.requests_deferred_free_distinct == 3 and rt.requests_deferred_free == 3
    text = _scrape(shm_dir, agent)
    assert value(text, "kvsidecar_requests_deferred_free", segment=agent.segment_name) == 3
    full.release("r3", "pd")
    agent.step()
    rt = read_segment(agent.segment_name, shm_dir=shm_dir).snapshot.runtime
    assert rt.requests_deferred_free_distinct == 3  # r3 still deferred in swa
    swa.release("r3", "pd")
    swa.release("r2", "pd")
    agent.step()
    rt = read_segment(agent.segment_name, shm_dir=shm_dir).snapshot.runtime
    assert rt.requests_deferred_free_distinct == 1
    agent.step(requests_deferred_free=7)  # the engine's own count wins
    rt = read_segment(agent.segment_name, shm_dir=shm_dir).snapshot.runtime
    assert rt.requests_deferred_free_distinct == 7
    agent.close()


def _rank(shm_dir: str, dp: int, instance: str | None, rid: str) -> KVSidecarAgent:
    agent = KVSidecarAgent(
        "vllm",
        "m",
        dp_rank=dp,
        dp_size=2,
        instance=instance,
        shm_dir=shm_dir,
        device="cpu",
        segment_name=f"kvsidecar.vllm.{instance or 'x'}.{rid}.dp{dp}",
    )
    pool = _pool()
    agent.register_pool(pool)
    _defer(pool, rid)
    agent._keep = pool  # type: ignore[attr-defined]
    agent.step()
    return agent


def test_dp_sums_add_one_instance_only(shm_dir: str) -> None:
    a0, a1 = _rank(shm_dir, 0, "A", "a0"), _rank(shm_dir, 1, "A", "a1")
    b0 = _rank(shm_dir, 0, "B", "b0")  # a second engine instance, same engine/model/role
    text = _scrape(shm_dir, a0, a1, b0)

    def by_instance(name: str) -> dict[str, float]:
        return {lab["engine_instance"]: v for n, lab, v in samples(text) if n == name}

    assert by_instance("kvsidecar_dp_requests_deferred_free") == {"A": 2, "B": 1}  # was 3
    blocks = by_instance("kvsidecar_dp_kv_blocks_deferred_free")
    assert blocks == {"A": 4, "B": 2}
    for a in (a0, a1, b0):
        a.close()


def test_look_alike_engines_without_instance_ids_are_never_added(shm_dir: str) -> None:
    # Both claim dp_rank 0 of the same instance (e.g. an old writer, or ranks that share a
    # process group by accident): no DP sum rather than a wrong one.
    x, y = _rank(shm_dir, 0, "same", "x"), _rank(shm_dir, 0, "same", "y")
    text = _scrape(shm_dir, x, y)
    assert value(text, "kvsidecar_dp_requests_deferred_free", engine="vllm") is None
    assert value(text, "kvsidecar_dp_kv_blocks_deferred_free", engine="vllm") is None
    assert value(text, "kvsidecar_requests_deferred_free", segment=x.segment_name) == 1
    x.close()
    y.close()


_INSTANCE = (
    "from kvsidecar.agent.agent import KVSidecarAgent\n"
    "print(KVSidecarAgent('e', enabled=False, device='cpu').runtime.instance)\n"
)


def test_default_instance_is_the_host_name_whoever_launches_the_engine() -> None:
    """Issue 33 item 6: the default was PID namespace + process group, so every restart of
    an engine (a new process group) minted new kvsidecar_dp_* series."""

    def run(new_session: bool) -> str:
        return subprocess.run(
            [sys.executable, "-c", _INSTANCE],
            capture_output=True,
            text=True,
            cwd=REPO,
            start_new_session=new_session,
            check=True,
        ).stdout.strip()

    assert run(False) == run(True) == run(True) == socket.gethostname()
