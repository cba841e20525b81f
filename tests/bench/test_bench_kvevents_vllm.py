"""``bench kvevents --vllm``'s parts that can be checked without a server: the thread-name
shim the engine runs with, the thread roles, ``strace -c``'s table, the pairing of rounds.
(The run itself needs the vLLM env and three server starts: docs/benchmarks.md.)"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from kvsidecar.bench import kvevents_vllm as kv

STRACE_C = """\
% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 60.00    0.000600           2       300           sched_yield
 30.00    0.000300           3       100        12 recvfrom
 10.00    0.000100           1        50           poll
------ ----------- ----------- --------- --------- ----------------
100.00    0.001000           2       450        12 total
"""


def test_parse_strace_c_counts_calls_by_name_without_the_total() -> None:
    assert kv.parse_strace_c(STRACE_C) == {"sched_yield": 300, "recvfrom": 100, "poll": 50}


def test_the_shim_names_each_python_thread_in_proc() -> None:
    code = (
        "import threading,time\n"
        "e=threading.Event()\n"
        "t=threading.Thread(target=e.wait,name='zmq-publisher-and-more')\n"
        "t.start();time.sleep(0.2)\n"
        "print(open(f'/proc/self/task/{t.native_id}/comm').read().strip())\n"
        "e.set();t.join()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(kv.THREADNAMES)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "zmq-publisher-a"  # comm holds 15 bytes
    assert kv.role(5, 4, out.stdout.strip()) == "publisher"


def test_roles_and_this_process_cpu_by_role() -> None:
    assert kv.role(4, 4, "VLLM::EngineCor") == "main"
    assert kv.role(5, 4, "ZMQbg/IO/0") == "zmq_io"
    assert kv.role(6, 4, "python") == "other"
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        cpu = kv.cpu_by_role(os.getpid())
    finally:
        stop.set()
        t.join()
    parts = sum(cpu[k] for k in ("main", "publisher", "zmq_io", "other"))
    assert abs(cpu["process"] - parts) < 1e-6 and cpu["main"] > 0


def _row(wall: float, changes: int, main: float, publisher: float = 0.0) -> dict:
    row = {f"{k}_ms": 0.0 for k in kv.ROLES}
    row.update(main_ms=main, publisher_ms=publisher, process_ms=main + publisher)
    return {**row, "wall_s": wall, "requests": 24, "steps": 100, "changes": changes}


def test_summarize_pairs_rounds_by_number_and_counts_per_1000_changes() -> None:
    per_mode = {
        "none": {"live": [_row(1.0, 0, 100.0), _row(2.0, 0, 200.0)]},
        "publisher": {
            "live": [_row(1.0, 500, 110.0, 20.0), _row(2.0, 1000, 220.0, 40.0)],
            "stalled": [_row(2.0, 500, 110.0, 60.0), _row(4.0, 1000, 220.0, 80.0)],
        },
        "kvsidecar": {"live": [_row(1.0, 500, 101.0), _row(2.0, 1000, 202.0)]},
    }
    c = kv.summarize(per_mode)
    assert c["publisher"]["publisher_per_1k"]["mean"] == 40.0
    assert c["publisher"]["main_over_none_per_1k"]["mean"] == 20.0
    assert c["kvsidecar"]["main_over_none_per_1k"]["mean"] == 2.0
    assert c["kvsidecar"]["publisher_per_1k"]["mean"] == 0.0
    s = c["publisher+stalled"]["vs_live"]
    assert s["throughput"]["mean"] == 0.5  # the stalled rounds took twice as long
    assert s["publisher_ms_per_round"]["mean"] == 40.0
    assert "kvsidecar+stalled" not in c
