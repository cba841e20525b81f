"""Starts the P/D pair (no torch here: only the two workers import it)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from multiprocessing.connection import Connection

from kvsidecar.agent.demo.options import Options
from kvsidecar.agent.demo.procutil import install_stop_handlers, log, set_pdeathsig


def _worker(role: str, opts: Options, conn: Connection, parent: int) -> None:
    # Before the slow torch import, so a signal in that window is neither lost nor fatal.
    stop = install_stop_handlers()
    set_pdeathsig(parent)
    from kvsidecar.agent.demo import pd  # only the workers load torch

    (pd.prefill_main if role == "prefill" else pd.decode_main)(opts, conn, stop)


def run_pd(opts: Options) -> int:
    """Run the prefill and decode processes; SIGINT/SIGTERM stop both; 0 if both exit 0."""
    ctx = mp.get_context("spawn")  # fresh interpreters: no torch/OpenMP state across fork
    a, b = ctx.Pipe(duplex=True)
    me = os.getpid()
    procs = [
        ctx.Process(target=_worker, args=(role, opts, c, me), name=f"kvsidecar-demo-{role}")
        for role, c in (("prefill", a), ("decode", b))
    ]
    stopping = False

    def stop_all(_signum: int = 0, _frame: object = None) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    signal.signal(signal.SIGTERM, stop_all)
    signal.signal(signal.SIGINT, stop_all)
    for p in procs:
        p.start()
    a.close()  # the workers hold the ends now: EOF reaches one when the other exits
    b.close()
    # No line of its own here: it came above `kvsidecar demo`'s banner (which names this
    # process); each worker logs its pid once it is up.
    while any(p.is_alive() for p in procs):
        for p in procs:
            p.join(0.1)
            if p.exitcode not in (None, 0) and not stopping:
                # One side failed: stop the other rather than leave half a pair running.
                log("pd", f"{p.name} exited with {p.exitcode}; stopping the pair")
                stop_all()
    return 0 if all(p.exitcode == 0 for p in procs) else 1
