"""Work counters of a process tree from /proc: what an observer costs, without a clock.

A wall-clock ratio cannot show that a scrape leaves the engine alone on a host whose
cores the daemon, the scraper and other tenants share. The work the engine's processes
do can: CPU time, context switches, read/write syscalls and sockets come from /proc and
count only that process, whatever else the host is doing.

* CPU: ``/proc/PID/stat`` utime + stime, which include threads that have exited;
* context switches: ``/proc/PID/task/*/status`` summed over live threads (a thread
  that has exited takes its count with it: an under-count, never an over-count);
* ``/proc/PID/io`` syscr, syscw, rchar, wchar: the read/write family only, so socket
  send/recv do not appear there (context switches and CPU do);
* sockets: ``socket:[...]`` links in ``/proc/PID/fd``.

Torch-free: the daemon's side of the benchmarks and the structural test use it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterable, Iterator

FIELDS = (
    "cpu_ms",
    "voluntary_ctxt",
    "nonvoluntary_ctxt",
    "syscr",
    "syscw",
    "rchar",
    "wchar",
)
_TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """pid and every descendant (through /proc/PID/task/*/children), parents first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        for tid in _tasks(p):
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except OSError:
                pass
    return out


def _tasks(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def counters(pid: int) -> dict[str, float]:
    """FIELDS for one process (all its threads); zeros for one that has gone."""
    out = dict.fromkeys(FIELDS, 0.0)
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out["cpu_ms"] = (int(fields[11]) + int(fields[12])) * _TICK_MS
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key in out:
                    out[key] = float(val)
    except OSError:
        return out
    for tid in _tasks(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")):
                        key, _, val = line.partition(":")
                        out[key.removesuffix("_switches")] += float(val)
        except OSError:
            pass  # the thread ended meanwhile
    return out


def fd_targets(pid: int) -> Iterator[str]:
    """What each open descriptor of `pid` points at (a path, ``socket:[inode]``, ...);
    nothing for a process that is gone or not ours to read."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return
    for fd in fds:
        try:
            yield os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass  # closed meanwhile


def sockets(pids: Iterable[int]) -> int:
    """Open sockets held by these processes (fd links to ``socket:[inode]``)."""
    return sum(t.startswith("socket:") for pid in pids for t in fd_targets(pid))


def tree_counters(pid: int) -> dict[str, float]:
    """FIELDS summed over the process tree, plus its process and socket counts."""
    pids = tree(pid)
    total = dict.fromkeys(FIELDS, 0.0)
    for p in pids:
        for k, v in counters(p).items():
            total[k] += v
    total["processes"] = len(pids)
    total["sockets"] = sockets(pids)
    return total


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in FIELDS}


def observer_violations(
    pid: int, scrape: Callable[[], bytes | None], n: int, expect: bytes
) -> list[str]:
    """How scraping an observer of engine ``pid`` touches the engine; [] when it does not.

    Timing-free. Call it while the engine is idle (blocked waiting for work, so it runs
    only if something wakes it). Three facts are checked, each exact:

    1. the engine's process tree holds no socket;
    2. over ``n`` scrapes, its counters (CPU, context switches, read/write syscalls
       and bytes) do not move at all;
    3. with the engine SIGSTOPped (a stopped process executes nothing), every one of
       ``n`` scrapes is answered with the engine's last snapshot (``expect`` in the body).

    ``scrape`` returns the body, or None when there was no answer.
    """
    out = []
    held = sockets(tree(pid))
    if held:
        out.append(f"the engine's processes hold {held} socket(s)")
    before = tree_counters(pid)
    answered = sum(scrape() is not None for _ in range(n))
    moved = {k: v for k, v in delta(tree_counters(pid), before).items() if v}
    if moved:
        out.append(f"engine counters moved over {answered} scrapes: {moved}")
    os.kill(pid, signal.SIGSTOP)
    try:
        for i in range(n):
            body = scrape()
            if body is None or expect not in body:
                state = "unanswered" if body is None else "answered without the last snapshot"
                out.append(f"scrape {i + 1}/{n} {state} while the engine was stopped")
                break  # one is proof enough; the rest would only wait out their timeouts
    finally:
        os.kill(pid, signal.SIGCONT)
    return out


def blocked_reading(pid: int, fd: int = 0) -> bool:
    """True when pid's main thread sleeps inside a read of ``fd`` (/proc/PID/syscall: the
    syscall's first argument), i.e. it has finished what it was doing and waits for input."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/syscall") as f:
            call = f.read().split()
    except OSError:
        return False
    return state == "S" and len(call) > 1 and call[0] != "running" and int(call[1], 16) == fd
