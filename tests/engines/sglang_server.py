"""A real SGLang 0.5.23 server on CPU for the tests (tests/engines/test_sglang_server.py).

How to start it (command, environment, the test-only `sgl_kernel` stand-in) is shared with
the benchmarks: `kvsidecar.bench.sglang`. Here: reading both sides' metrics, comparing them,
and the server's processes. kvsidecar's plugin is found by its entry point alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from pathlib import Path

from kvsidecar.bench import vllm as vb
from kvsidecar.bench.sglang import STANDIN


def standin_problem(python: str) -> str | None:
    """Why the stand-in must go, or None: a real CPU `sgl_kernel` in the env makes it moot."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = "import sgl_kernel; print(getattr(sgl_kernel, 'STANDIN', False))"
    proc = subprocess.run(
        [python, "-c", probe], env=env, capture_output=True, text=True, timeout=120, cwd="/"
    )
    if proc.returncode != 0:
        return None  # not importable: the stand-in is still needed
    return (
        "a real sgl_kernel is importable in the SGLang env: remove the test-only stand-in "
        f"({STANDIN}) and run the server on the real kernel"
    )


def abort(port: int, rid: str) -> None:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/abort_request",
        data=json.dumps({"rid": rid}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30):
        pass


def sglang_values(port: int) -> dict[str, float]:
    """SGLang's own gauges (one scheduler: tp_rank 0)."""
    m = vb.scrape(f"http://127.0.0.1:{port}/metrics")
    names = (
        "num_used_tokens", "kv_used_tokens", "kv_available_tokens", "kv_evictable_tokens",
        "token_usage", "num_running_reqs", "num_queue_reqs", "max_total_num_tokens",
    )  # fmt: skip
    return {n: vb.value(m, f"sglang:{n}", tp_rank="0") for n in names}


def kvsidecar_values(url: str) -> dict[str, float]:
    """kvsidecar's fields for the same quantities, in SGLang's units (page size 1)."""
    m = vb.scrape(f"{url}/metrics")

    def pool(name: str) -> float:
        return vb.value(m, f"kvsidecar_kv_pool_{name}", pool="mha")

    return {
        "total": pool("total_blocks"),
        "allocated": pool("allocated_blocks"),
        "available": pool("available_blocks"),
        "cached": pool("cached_blocks"),
        "protected": pool("protected_blocks"),
        "tokens_used": pool("tokens_used"),
        "usage": pool("block_usage_ratio"),
        "running": vb.value(m, "kvsidecar_requests_running"),
        "waiting": vb.value(m, "kvsidecar_requests_waiting"),
        "preemptions": vb.value(m, "kvsidecar_preemptions_total"),
    }


def mismatches(theirs: dict[str, float], ours: dict[str, float]) -> list[str]:
    """Every kvsidecar field against SGLang's series; [] when all agree exactly."""
    pairs = [
        ("max_total_num_tokens", theirs["max_total_num_tokens"], ours["total"]),
        ("num_used_tokens", theirs["num_used_tokens"], ours["allocated"]),
        ("kv_used_tokens", theirs["kv_used_tokens"], ours["allocated"]),
        ("num_used_tokens/tokens_used", theirs["num_used_tokens"], ours["tokens_used"]),
        ("kv_evictable_tokens", theirs["kv_evictable_tokens"], ours["cached"]),
        ("kv_available_tokens", theirs["kv_available_tokens"], ours["available"] - ours["cached"]),
        ("num_running_reqs", theirs["num_running_reqs"], ours["running"]),
        ("num_queue_reqs", theirs["num_queue_reqs"], ours["waiting"]),
        # SGLang rounds token_usage to 2 decimals.
        ("token_usage", theirs["token_usage"], round(ours["usage"], 2)),
    ]
    return [f"{n}: sglang {a} kvsidecar {b}" for n, a, b in pairs if a != b]


def scheduler_pids(server_pid: int) -> list[int]:
    """The server's scheduler processes (SGLang titles them ``sglang::scheduler``)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == server_pid and "scheduler" in cmd:
            out.append(int(d.name))
    return out


def model_dir(directory: Path) -> str:
    return vb.write_model(directory)


def stop(proc: subprocess.Popen) -> None:
    vb.stop_server(proc, timeout=60)
