"""``kvsidecar bench kvevents --quick``, small: the shape of what it reports, and what must
hold whatever the host's load (no wall-clock bounds): the agent's recorder makes no
system call on the engine thread, every condition ran the same workload, the bulk
snapshot gave the per-block path's bytes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("zmq", reason="pyzmq (the kvevents extra, in the dev set) is missing")
pytest.importorskip("torch", reason="the demo engine needs torch")

from kvsidecar.bench import kvevents

ROUNDS, STEPS = 2, 40


def test_bench_kvevents_quick_shape_and_zero_syscalls(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvsidecar", "bench", "kvevents", "--quick", "--rounds",
         str(ROUNDS), "--steps", str(STEPS), "--snapshot-blocks", "3000", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    for title in ("engine CPU ms per 1,000 block changes", "system calls per engine step",
                  "full state (snapshot)", "daemon and segment"):  # fmt: skip
        assert title in r.stdout
    out = json.loads((tmp_path / "kvevents.json").read_text())
    e = out["engine"]
    assert set(e["conditions"]) == set(kvevents.CONDITIONS)
    assert len(e["raw"]) == ROUNDS
    for rnd in e["raw"]:
        # the same workload in every condition: the in-engine publisher's event builder
        # and our recorder saw the same block changes, and there were some
        assert rnd["kvsidecar"]["changes"] == rnd["publisher"]["changes"] > 0
        assert rnd["kvsidecar+nosub"]["changes"] == rnd["kvsidecar"]["changes"]
        assert rnd["none"]["changes"] == 0
        assert rnd["kvsidecar+nosub"]["received"] == 0
        for cond in ("kvsidecar", "publisher"):
            assert 0 < rnd[cond]["received"] <= rnd[cond]["changes"]
        # the sidecar's engine runs no publisher thread; the in-engine one does
        assert rnd["kvsidecar"]["publisher_ms"] == 0
    for cond, v in e["conditions"].items():
        if cond != "none":
            assert {"engine_thread_ms_per_1k", "process_ms_per_1k"} <= set(v)
            assert len(v["process_ms_per_1k"]["ci95"]) == 2
    assert e["daemon"]["rss_kib"] > 0
    assert out["segment_bytes_per_1m_blocks"] == 122_101_760  # segment-format.md, Sizes
    snap = out["snapshot"]["3000"]
    assert snap["same_bytes"] is True and snap["batches"] == 3
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed: the system-call count cannot be checked")
    calls = e["syscalls"]
    assert calls["kvsidecar"]["engine_thread_per_step"] == 0, calls["kvsidecar"]
    assert calls["none"]["engine_thread_per_step"] == 0, calls["none"]
    # the in-engine publisher's thread sends on sockets: the trace does see system calls
    assert calls["publisher"]["other_threads_per_step"] > 0


def test_count_syscalls_counts_the_engine_thread_between_markers(tmp_path: Path) -> None:
    log = tmp_path / "strace.txt"
    log.write_text(
        "7 futex(0x1, FUTEX_WAKE_PRIVATE, 1) = 0\n"
        "7 getpgid(0) = 7\n"
        '7 write(1, "x", 1 <unfinished ...>\n'
        '9 sendto(3, "", 0, 0, NULL, 0) = 0\n'
        "7 <... write resumed>) = 1\n"
        "7 mmap(NULL, 4096, PROT_READ, MAP_PRIVATE, -1, 0) = 0x1\n"
        "7 getpgid(0) = 7\n"
        '7 read(0, "", 1) = 0\n'
    )
    c = kvevents.count_syscalls(str(log), 7, 2)
    assert c["engine_thread_per_step"] == 1.0  # write and mmap, over 2 steps
    assert c["engine_thread_calls"] == {"write": 1, "mmap": 1}
    assert c["other_threads_per_step"] == 0.5
