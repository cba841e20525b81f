"""The engine process of ``bench cost`` and of the structural observer test.

``python -m kvsidecar.agent.bench.cost_engine SHM_DIR [--exporter] [--matmul N] [--device D]``
prints one JSON line (segment, exporter port, step), then serves commands on stdin, one a line:
``CONDITION STEPS HZ``. It runs STEPS engine steps of `observer.Engine` under CONDITION
and answers one JSON line; between commands it is blocked reading stdin, so it does
nothing unless something wakes it (what the structural test relies on).

* ``none``: the steps only;
* ``kvsidecar``: plus ``agent.step()`` each step (the daemon reads the segment elsewhere);
* ``prometheus_client``: plus the in-process exporter's gauges set each step (needs
  ``--exporter``: its HTTP server thread lives in this process for the whole run);
* ``locked_snapshot``: the allocator under a lock, and a thread here takes it HZ times
  a second to snapshot every field (kvcached style); the answer says how many it took.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch

from kvsidecar.agent.agent import KVSidecarAgent
from kvsidecar.agent.bench.observer import Engine, InProcessExporter, _locked_snapshot

CONDITIONS = ("none", "kvsidecar", "prometheus_client", "locked_snapshot")


class Poller:
    """The kvcached-style snapshot thread; blocked (no wake-ups) while inactive."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.active = threading.Event()
        self.hz = 20.0
        self.taken = 0
        threading.Thread(target=self._run, name="locked-snapshot", daemon=True).start()

    def _run(self) -> None:
        while self.active.wait():
            _locked_snapshot(self.engine)
            self.taken += 1
            time.sleep(1 / self.hz)


def run_steps(
    cond: str,
    steps: int,
    engine: Engine,
    agent: KVSidecarAgent,
    exporter: InProcessExporter | None,
    poller: Poller,
) -> int:
    """STEPS steps under ``cond``; returns the locked snapshots taken meanwhile."""
    taken = poller.taken
    if cond == "locked_snapshot":
        engine.use_lock = True
        poller.active.set()
    for i in range(steps):
        engine.step()
        if cond == "kvsidecar":
            agent.step(len(engine.running), 0)
        elif cond == "prometheus_client" and exporter is not None:
            exporter.update(i)
    if cond == "locked_snapshot":
        poller.active.clear()
        engine.use_lock = False
        time.sleep(1.5 / poller.hz)  # the poller's last snapshot lands in this round
    return poller.taken - taken


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shm_dir")
    ap.add_argument("--exporter", action="store_true")
    ap.add_argument("--matmul", type=int, default=192)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = Engine(args.matmul, device=args.device)
    agent = KVSidecarAgent("bench", "m", shm_dir=args.shm_dir, device=args.device)
    for p in engine.pools:
        agent.register_pool(p)
    agent.step(0, 0)  # a first snapshot, so the daemon has a source at once
    exporter = InProcessExporter(engine) if args.exporter else None
    poller = Poller(engine)
    for _ in range(50):
        engine.step()  # warm-up
    hello = {
        "segment": agent.segment_name,
        "exporter_port": exporter.port if exporter else None,
        "step": agent.runtime.step,
    }
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        cond, steps, hz = line.split()
        if cond not in CONDITIONS:
            print(json.dumps({"error": f"unknown condition {cond!r}"}), flush=True)
            continue
        poller.hz = float(hz) or poller.hz
        taken = run_steps(cond, int(steps), engine, agent, exporter, poller)
        print(json.dumps({"snapshots": taken, "step": agent.runtime.step}), flush=True)
    agent.close()


if __name__ == "__main__":
    main()
