"""``kvsidecar bench scaling``: agent publish time vs pool size and deferred requests.

The claim is O(1): counters are kept at mutation time, so a step costs the
same for 10^3 or 10^6 blocks and for 0 or 10^4 deferred requests. Each point
is timed in interleaved rounds against the smallest configuration; its ratio is the
per-round median ratio with a bootstrap 95 % interval over rounds (`kvsidecar.bench.stats`).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from kvsidecar.agent.agent import KVSidecarAgent
from kvsidecar.agent.bench.agent import build_big
from kvsidecar.bench import stats
from kvsidecar.bench.report import summarize, time_calls, timer_overhead_ns


def run(quick: bool = False) -> dict[str, Any]:
    sizes = [10**3, 10**4, 10**5] + ([] if quick else [10**6])
    deferrals = [0, 10, 100, 1000] + ([] if quick else [10**4])
    deferred_pool = 10**5 if quick else 10**6
    configs = [(n, 0) for n in sizes] + [(deferred_pool, d) for d in deferrals if d]
    rounds, per_round = (4, 2000) if quick else (10, 10000)
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-scaling-", dir="/dev/shm")
    agents = {}
    try:
        for n, d in configs:
            agent = KVSidecarAgent(
                "bench",
                "m",
                shm_dir=shm_dir,
                device="cpu",
                segment_name=f"kvsidecar.scaling.{n}.{d}.{os.getpid()}",
            )
            for p in build_big(n, d):
                agent.register_pool(p)
            agents[(n, d)] = agent
        overhead = timer_overhead_ns()
        per_rounds: list[dict[tuple[int, int], list[float]]] = []
        for _ in range(rounds):
            per_rounds.append(
                {
                    key: time_calls(lambda a=agent: a.step(1, 0), per_round, overhead)
                    for key, agent in agents.items()
                }
            )
        samples = {k: [x for r in per_rounds for x in r[k]] for k in agents}
    finally:
        for agent in agents.values():
            agent.close()
        os.rmdir(shm_dir)
    smallest = (sizes[0], 0)
    base = summarize(samples[smallest])["median_ns"]
    points = []
    for (n, d), s in samples.items():
        st = summarize(s)
        cmp = stats.compare(per_rounds, (n, d), smallest, statistic=stats.p50)  # type: ignore[arg-type]
        points.append(
            {
                "blocks": n,
                "deferred_requests": d,
                **st,
                "ratio_to_smallest": st["median_ns"] / base,
                "round_ratio": cmp,
            }
        )
    return {
        "points": points,
        "max_ratio": max(p["ratio_to_smallest"] for p in points),
        "max_ci95_upper": max(p["round_ratio"]["ci95"][1] for p in points),
    }
