"""The demo's two engines share one stderr: each log line is one write, so lines never
glue together (issue #23 item 3: ``...pp0kvsidecar-demo[prefill] pid...`` under
PYTHONUNBUFFERED=1). Two real processes, one real pipe."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

from tests.conftest import REPO

SCRIPT = """
import sys, time
from kvsidecar.agent.demo.procutil import log
start = float(sys.argv[3])
while time.time() < start:  # both start together, after their imports: they overlap
    pass
for i in range(int(sys.argv[2])):
    log(sys.argv[1], f"step {i} segment kvsidecar.demo.{sys.argv[1]}.dp0.tp0.pp0")
"""
N = 20000


def test_two_engines_lines_never_glue() -> None:
    r, w = os.pipe()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = str(time.time() + 3.0)  # generous: two interpreters start on a loaded host
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, role, str(N), start], stderr=w, cwd=REPO, env=env
        )
        for role in ("prefill", "decode")
    ]
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    assert [p.wait(60) for p in procs] == [0, 0]
    lines = out.splitlines()
    good = re.compile(
        r"kvsidecar-demo\[(prefill|decode)\] step \d+ segment kvsidecar\.demo\.\1\.dp0\.tp0\.pp0"
    )
    bad = [ln for ln in lines if not good.fullmatch(ln)]
    assert not bad and len(lines) == 2 * N, (len(lines), bad[:3])


NO_NUMPY = """
import sys
sys.modules["numpy"] = None  # as after `make run`: torch's CPU wheel brings no numpy
import hashlib, torch
from kvsidecar.agent.demo.pd import kv_digest, raw_bytes
kv = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)[:, 1:]  # not contiguous
data = raw_bytes(kv)
assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(2, 2, 4), kv)
assert kv_digest(kv) == hashlib.sha256(data).hexdigest()[:16]
print("ok")
"""


def test_the_pd_transfer_needs_no_numpy() -> None:
    """`make run` installs the agent extra only; the P/D demo moved K/V through .numpy() and
    died with "Numpy is not available" (found walking a fresh clone, issue #23 item 3)."""
    r = subprocess.run(
        [sys.executable, "-c", NO_NUMPY], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
