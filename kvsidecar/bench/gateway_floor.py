"""The gateway poll's floor, design candidates side by side (issue 44 item 1).

``python -m kvsidecar.bench.gateway_floor [--seconds S] [--hz HZ] [--steps-per-s N]``: one
process holds what the daemon holds for the gateway (a `TargetSet` polled every 0.25 s in
the background, a `Gateway`, a `PollServer` thread), a writer process publishes a realistic
snapshot (4 pools) N times a second, and a picker process polls at HZ over 20 kept-alive
connections (`gateway._PICKER`, which also counts freshness: the served step against the
step the segment held just before the request). Counted: the poll server thread's own CPU
(its CPU-time clock, `time.pthread_getcpuclockid`, in nanoseconds; the kernel's share from
/proc/self/task/TID/stat, in 10 ms ticks: the listener's work, not the background
poller's) per poll answered, and the share of polls that were fresh. Candidates, each in
turn, same writer:

* ``full``: every poll a full check (the target's poll: trust, budgets, identity,
  liveness, progress) and the body cached per (incarnation, seq), as main did;
* ``word``: the published sequence word loaded, the bytes built at the last full check
  re-sent while it is unchanged (a full check at least every `gateway.FULL_CHECK_EVERY`),
  every poll on the Python path;
* ``compiled``: the same, the polls of an unchanged step served by the listener's
  compiled path (`kvsidecar.web._pollfast`: the wait, recv, compare, word, send in C),
  and a new step whose bytes moved only in counts answered in C too
  (`kvsidecar.daemon.gateway_step`), everything else by the Python path (measured only
  where the extensions are built);
* ``compiled_python_steps``: the same without `gateway_step`: each new step a Python full
  check, as before it;
* ``floor``: the compiled path serving one constant answer (no segment, no check): what a
  poll costs this host's listener thread at the least (a wake-up, a read, a compare, a
  write), the bound under any design of the checks;
* ``native``: no listener of ours at all: `_pollfast.native_floor`, a pure-C epoll loop with
  the GIL released for its whole run (accept, recv, send the floor's answer bytes for each
  head read: no parse, no counts, no checks), on its own thread, same picker: what ANY
  listener costs a poll on this host (the wake-up, the read, the write), the floor under
  ``floor``.

Both with the shared parser's verdict kept per distinct head, and the same answer tuple's
bytes re-sent (`poll_server`): the parse and the head are a lookup in both.

Each candidate also reports the full check's own cost on the listener thread
(`time.thread_time_ns` around `Gateway._answer`, and within it the target's poll and the
body: ``full_check_us``, ``target_poll_us``, ``body_us``, per full check), so the same
module run against another checkout's code (a worktree of main) compares the full check.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from kvsidecar.bench import fleet
from kvsidecar.bench.gateway import _PICKER, PICKERS
from kvsidecar.daemon import gateway as gw
from kvsidecar.daemon.config import Discovery, Polling
from kvsidecar.daemon.target import Target
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.web import poll_server
from kvsidecar.web.poll_server import PollServer

# Run from a checkout of code before the candidates (`Gateway` without the sequence word),
# the one candidate there is that code as it is: "before".
CANDIDATES = ["full", "word"] if hasattr(gw, "FULL_CHECK_EVERY") else ["before"]
COMPILED = getattr(poll_server, "FAST", False)
if COMPILED:
    CANDIDATES.append("compiled")
    if hasattr(gw, "compiled_step"):
        CANDIDATES += ["compiled_python_steps", "floor"]
    if hasattr(poll_server._pollfast, "native_floor"):
        CANDIDATES.append("native")


# Thread CPU ns and calls of the parts of a full check, on the listener's thread only.
PARTS: dict[str, list[int]] = {}


def _timed(key: str, f: Callable) -> Callable:
    def timed(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name != "kvsidecar-gateway":
            return f(*args, **kwargs)
        t0 = time.thread_time_ns()
        try:
            return f(*args, **kwargs)
        finally:
            part = PARTS.setdefault(key, [0, 0])
            part[0] += time.thread_time_ns() - t0
            part[1] += 1

    return timed


def _time_parts() -> None:
    """Time the full check's parts where this checkout's Gateway and Target have them."""
    gw.Gateway._answer = _timed("full_check_us", gw.Gateway._answer)  # type: ignore[method-assign]
    gw.Gateway._body = _timed("body_us", gw.Gateway._body)  # type: ignore[method-assign]
    Target.poll = _timed("target_poll_us", Target.poll)  # type: ignore[method-assign]


def _thread_cpu(tid: int) -> tuple[float, float]:
    """The thread's (user, system) CPU seconds."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def measure(seconds: float, hz: float, steps_per_s: float) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="kvsidecar-gwfloor-", dir="/dev/shm")
    shm = os.path.join(tmp, "shm")
    os.mkdir(shm)
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    writer = ctx.Process(target=fleet.writer_main, args=(shm, 1, 4, steps_per_s, ready, stop))
    writer.start()
    out: dict[str, Any] = {"seconds": seconds, "hz": hz, "steps_per_s": steps_per_s}
    targets = None
    try:
        if not ready.wait(60):
            raise RuntimeError("writer did not start")
        targets = TargetSet(Discovery(shm), polling=Polling(poll_interval=0.25))
        targets.poll_all()
        targets.start()
        segment = os.path.join(shm, sorted(os.listdir(shm))[0])
        for cand in CANDIDATES:
            out[cand] = _one(targets, segment, tmp, cand, seconds, hz)
    finally:
        if targets is not None:
            targets.stop()
        stop.set()
        writer.join(10)
        if writer.is_alive():
            writer.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _one(
    targets: TargetSet, segment: str, tmp: str, cand: str, seconds: float, hz: float
) -> dict[str, Any]:
    every = getattr(gw, "FULL_CHECK_EVERY", None)
    if every is not None:
        gw.FULL_CHECK_EVERY = 0.0 if cand == "full" else every
    stepped = getattr(gw, "compiled_step", None)
    if cand == "compiled_python_steps":
        gw.compiled_step = lambda *args, **kwargs: None
    gateway = gw.Gateway(targets)
    route = constant_route() if cand == "floor" else gateway.route(0)
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    options = {"compiled": cand not in ("word", "full")} if COMPILED else {}
    server: PollServer | NativeFloor
    if cand == "native":
        server = NativeFloor(sock, 2.0 + seconds + 1.0)  # outlasts the window below
    else:
        server = PollServer([(sock, route)], name="kvsidecar-gateway", **options)
    server.start()
    counter = os.path.join(tmp, f"floor-{cand}")
    with open(counter, "wb") as f:
        f.write(bytes(32))
    args = [str(port), "/metrics", str(hz), str(PICKERS), counter, segment]
    picker = subprocess.Popen([sys.executable, "-c", _PICKER, *args])
    try:
        time.sleep(2.0)  # connections made, caches warm
        tid = server._thread.native_id  # type: ignore[union-attr]
        clock = time.pthread_getcpuclockid(server._thread.ident)  # type: ignore[union-attr]
        PARTS.clear()
        c0, n0, f0 = _thread_cpu(tid), _counts(counter), getattr(gateway, "full_checks", 0)
        k0, ns0 = getattr(server, "fast_polls", 0), time.clock_gettime_ns(clock)
        time.sleep(seconds)
        ns1 = time.clock_gettime_ns(clock)
        c1, n1, f1 = _thread_cpu(tid), _counts(counter), getattr(gateway, "full_checks", 0)
        k1 = getattr(server, "fast_polls", 0)
        parts = {k: round(ns / max(1, n) / 1000, 1) for k, (ns, n) in PARTS.items()}
    finally:
        picker.kill()
        picker.wait()
        server.shutdown()
        if every is not None:
            gw.FULL_CHECK_EVERY = every
        if stepped is not None:
            gw.compiled_step = stepped
    polls = n1[0] - n0[0]
    return {
        "polls": polls,
        "polls_per_s": polls / seconds,
        "cpu_ms_per_poll": (ns1 - ns0) / 1e6 / max(1, polls),
        "system_ms_per_poll": 1000 * (c1[1] - c0[1]) / max(1, polls),
        "core_pct": 100 * (ns1 - ns0) / 1e9 / seconds,
        "full_check_share": (f1 - f0) / max(1, polls),
        "compiled_share": (k1 - k0) / max(1, polls),
        # None where no answer says its step (the floor's constant answer).
        "fresh_fraction": (n1[1] - n0[1]) / (n1[2] - n0[2]) if n1[2] > n0[2] else None,
        **parts,
    }


def constant_route() -> Callable[[str], tuple]:
    """A route with one answer, kept current for ever in its slot: the compiled path's
    floor (its word a constant 0 in a buffer of our own)."""
    answer = (200, b"# TYPE floor gauge\nfloor 1.0\n", "text/plain; version=0.0.4", b"")
    slot = poll_server.FastSlot()
    slot.mm, slot.off, slot.seq, slot.until = bytearray(16), 0, 0, float("inf")
    slot.answer = answer

    def route(path: str) -> tuple:
        return answer

    route.fast_slot = slot  # type: ignore[attr-defined]
    return route


class NativeFloor:
    """`_pollfast.native_floor` serving the floor's answer bytes on `sock` for `seconds`
    (or until `most` answers, where given), on a thread of its own (started by `start`);
    `result` is its (answers, thread CPU ns)."""

    def __init__(self, sock: socket.socket, seconds: float, most: int = 0) -> None:
        status, body, ctype, extra = constant_route().fast_slot.answer  # type: ignore[attr-defined]
        self.answer = b"%s%d\r\n%s\r\n%s" % (
            poll_server.response_start(status, ctype),
            len(body),
            extra,
            body,
        )
        self.sock, self.seconds, self.most = sock, seconds, most
        self.result: tuple[int, int] | None = None
        self._thread = threading.Thread(target=self._serve, name="kvsidecar-native-floor")

    def _serve(self) -> None:
        self.result = poll_server._pollfast.native_floor(
            self.sock.fileno(), self.answer, self.seconds, self.most
        )

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._thread.join()
        self.sock.close()


def _counts(path: str) -> tuple[int, ...]:
    with open(path, "rb") as f:
        raw = f.read(32)
    return tuple(int.from_bytes(raw[k : k + 8], "little") for k in range(0, 32, 8))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--hz", type=float, default=400.0)
    p.add_argument("--steps-per-s", type=float, default=50.0)
    p.add_argument(
        "--candidates", default=",".join(CANDIDATES), help="which, comma-separated (all)"
    )
    a = p.parse_args()
    CANDIDATES[:] = [c for c in CANDIDATES if c in a.candidates.split(",")]
    _time_parts()
    json.dump(measure(a.seconds, a.hz, a.steps_per_s), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
