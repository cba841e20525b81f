"""KVSidecarAgent: real two-process publishing, and never raising into the engine."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from kvsidecar.agent.agent import KVSidecarAgent
from kvsidecar.agent.pool import KVBlockPool
from kvsidecar.protocol.reader import Reading, SegmentReader, read_segment
from tests.conftest import REPO
from tests.support.procs import wait_for


def _pool(**kw) -> KVBlockPool:
    return KVBlockPool(64, 16, num_layers=2, kv_heads=2, head_dim=8, device="cpu", **kw)


def test_two_processes_step_and_deferred_gauges_move(shm_dir: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.agent_loop", shm_dir, "500"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready"), line
        name = line.split()[1]
        reader = SegmentReader(name, shm_dir=shm_dir)
        assert reader.attach() is None
        steps, deferred_reqs, deferred_blocks = [], set(), set()

        def observe() -> bool:
            r = reader.read()
            if isinstance(r, Reading):
                steps.append(r.snapshot.runtime.step)
                deferred_reqs.add(r.snapshot.runtime.requests_deferred_free)
                p = r.snapshot.pools[0]
                deferred_blocks.add(p.deferred_free_blocks)
                assert p.deferred_free_blocks <= p.allocated_blocks <= p.total_blocks
                assert r.snapshot.runtime.requests_deferred_free == p.deferred_free_requests
            return len(deferred_reqs) > 5 and 0 in deferred_reqs and len(deferred_blocks) > 5

        assert wait_for(observe, timeout=20, interval=0.005)
        assert steps == sorted(steps) and steps[-1] > steps[0]  # the step counter moves
        assert max(deferred_blocks) > 0
        reader.close()
    finally:
        proc.kill()
        proc.wait()


def test_agent_survives_a_sigkilled_reader(shm_dir: str) -> None:
    agent = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu")
    agent.register_pool(_pool())
    agent.step()
    script = (
        "import sys,time\nfrom kvsidecar.protocol.reader import SegmentReader\n"
        "r=SegmentReader(sys.argv[1],shm_dir=sys.argv[2]);assert r.attach() is None\n"
        "print('attached',flush=True)\nwhile True: r.read()\n"
    )
    reader = subprocess.Popen(
        [sys.executable, "-c", script, agent.segment_name, shm_dir],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert reader.stdout.readline().startswith("attached")
    for _ in range(1000):
        agent.step(1, 0)
    reader.send_signal(signal.SIGKILL)
    reader.wait()
    for _ in range(1000):
        agent.step(2, 0)
    result = read_segment(agent.segment_name, shm_dir=shm_dir)
    assert isinstance(result, Reading) and result.snapshot.runtime.step == 2001
    assert agent.runtime.publish_errors_total == 0
    agent.close()
    assert os.listdir(shm_dir) == []


def test_missing_shm_dir_disables_without_raising(tmp_path, caplog) -> None:
    agent = KVSidecarAgent("t", "m", shm_dir=str(tmp_path / "missing"), device="cpu")
    assert not agent.enabled and "does not exist" in agent.error
    agent.register_pool(_pool())
    agent.step(1, 2)  # a no-op, not an exception
    assert any("agent disabled" in r.message for r in caplog.records)
    agent.close()


def test_full_tmpfs_disables_without_raising(caplog) -> None:
    mnt = tempfile.mkdtemp(prefix="kvsidecar-full-")
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", mnt], capture_output=True
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
        try:
            agent = KVSidecarAgent("t", "m", shm_dir=mnt, device="cpu")
            assert not agent.enabled and "is full" in agent.error
            agent.step()
            agent.close()
            assert os.listdir(mnt) == []
        finally:
            subprocess.run(["umount", mnt], check=False)
    finally:
        shutil.rmtree(mnt, ignore_errors=True)


def test_publish_failure_is_counted_and_logged_once(shm_dir: str, caplog) -> None:
    agent = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu")
    # Far more pools than a 16 KiB slot holds: every publish fails, the engine does not.
    for i in range(200):
        agent.register_pool(_pool(pool_name=f"pool-with-a-long-name-{i:04d}"))
    for _ in range(5):
        agent.step()
    assert agent.runtime.publish_errors_total == 5
    assert sum("publish failed" in r.message for r in caplog.records) == 1
    agent.close()


def test_env_configuration_and_argument_precedence(shm_dir: str) -> None:
    env = {
        "KVSIDECAR_ENGINE": "vllm",
        "KVSIDECAR_MODEL_NAME": "m",
        "KVSIDECAR_DP_RANK": "3",
        "KVSIDECAR_DP_SIZE": "4",
        "KVSIDECAR_ROLE": "decode",
        "KVSIDECAR_SHM_DIR": shm_dir,
        "KVSIDECAR_TP_RANK": "notanint",
    }
    agent = KVSidecarAgent(tp_size=2, env=env, device="cpu")
    r = agent.runtime
    assert (r.engine, r.model_name, r.dp_rank, r.dp_size, r.role) == ("vllm", "m", 3, 4, "decode")
    assert r.tp_size == 2 and r.tp_rank == 0  # bad value falls back to the default
    assert agent.segment_name == "kvsidecar.vllm.decode.dp3.tp0.pp0"
    agent.close()
    agent = KVSidecarAgent("sglang", dp_rank=1, env=env, device="cpu")  # arguments win
    assert agent.runtime.engine == "sglang" and agent.runtime.dp_rank == 1
    agent.close()
    assert not KVSidecarAgent(
        "x", env={"KVSIDECAR_DISABLE": "1", "KVSIDECAR_SHM_DIR": shm_dir}
    ).enabled


def test_runtime_deferred_is_max_over_pools_not_sum(shm_dir: str) -> None:
    """One request defers in every pool it uses (hybrid groups): count it once."""
    agent = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu")
    pools = [_pool(pool_name="full", group_id=0), _pool(pool_name="swa", group_id=1)]
    for p in pools:
        agent.register_pool(p)
        p.allocate_prompt("req", list(range(40)))
        p.finish("req", connectors=("pd",))
    agent.step()
    snap = read_segment(agent.segment_name, shm_dir=shm_dir).snapshot
    assert snap.runtime.requests_deferred_free == 1
    assert [p.deferred_free_requests for p in snap.pools] == [1, 1]
    agent.close()


def test_segment_truncated_under_the_engine_disables_not_crashes(shm_dir: str, caplog) -> None:
    """Only the owner can truncate a 0640 segment, but even then the engine must live."""
    agent = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu")
    agent.register_pool(_pool())
    agent.step()
    os.truncate(agent.segment_path, 0)
    agent.step()  # would be SIGBUS without the guard: the test process would die here
    agent.step()
    assert not agent.enabled and "truncated" in agent.error
    assert agent.runtime.publish_errors_total == 1
    assert any("agent disabled" in r.message for r in caplog.records)
    agent.close()


def test_idle_heartbeat_comes_one_interval_after_the_last_step(shm_dir: str) -> None:
    """The first idle heartbeat comes one interval after the last step, not at the thread's
    next wake after that: on a fixed grid, a step just after a wake left the segment without
    a heartbeat for almost two intervals, and the gateway (--gateway.stale-after 1.5 s, the
    heartbeat 1 s) answered an idle engine 503."""
    interval = 2.0
    agent = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu", heartbeat_interval=interval)
    try:
        time.sleep(interval / 10)  # the step comes just after the thread began waiting
        agent.step()
        stepped = read_segment(agent.segment_name, shm_dir=shm_dir)
        assert isinstance(stepped, Reading)

        seen = [stepped.heartbeat_mono_ns]

        def beat() -> bool:
            seen.append(read_segment(agent.segment_name, shm_dir=shm_dir).heartbeat_mono_ns)
            return seen[-1] > stepped.heartbeat_mono_ns

        assert wait_for(beat, timeout=60)
        gap = (seen[-1] - stepped.heartbeat_mono_ns) / 1e9  # the first beat, as stamped
        # One interval after the step; the grid made it 1.9 intervals. The half interval
        # (1 s) of slack is for a loaded host waking the thread late.
        assert gap < 1.5 * interval, f"first idle heartbeat {gap:.2f} s after the step"
    finally:
        agent.close()


def test_idle_heartbeat_keeps_the_segment_fresh_without_steps(shm_dir: str) -> None:
    agent = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu", heartbeat_interval=0.05)
    agent.step()
    first = read_segment(agent.segment_name, shm_dir=shm_dir)
    assert isinstance(first, Reading)
    assert wait_for(
        lambda: (
            read_segment(agent.segment_name, shm_dir=shm_dir).heartbeat_mono_ns
            > first.heartbeat_mono_ns
        ),
    )
    assert read_segment(agent.segment_name, shm_dir=shm_dir).seq == first.seq  # no new step
    agent.close()
