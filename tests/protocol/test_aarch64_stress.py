"""The real latch code paths, built for aarch64, under qemu: one full-speed writer, 2 readers.

tests/protocol/aarch64/stress.c includes _seqlock.c without Python and checks
every accepted payload against its sequence number. Under qemu on an x86-64 host
this proves the aarch64 build builds and runs correctly; it cannot show weak
memory ordering (qemu's translated code keeps the host's TSO order), which is
why the fence checks in test_fences_*.py exist. Skips without the cross compiler
or qemu-user, except in CI (see test_fences_aarch64.require).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile

import pytest

from tests.protocol import fence_check as fc
from tests.protocol.test_fences_aarch64 import require

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "aarch64", "stress.c")
SECONDS = os.environ.get("KVSIDECAR_QEMU_SECONDS", "3")
QEMU = next((q for q in ("qemu-aarch64", "qemu-aarch64-static") if shutil.which(q)), None)

# A latch with its lap re-check, slot-seq check and CRC check switched off: torn
# snapshots must get through, or the oracle would prove nothing.
NO_CHECKS = [
    ("if (s2 != s) {", "if (0 && s2 != s) {"),
    ("if (ld64(scratch) != s) {", "if (0) {"),
    ("if (crc32_ieee(scratch + SLOT_HEADER_LEN, n) != ld32(scratch + 12)) {", "if (0) {"),
]


@pytest.fixture(scope="module")
def work_dir():
    require(
        fc.have_aarch64_cc(), f"{fc.AARCH64_CC} not installed (apt install gcc-aarch64-linux-gnu)"
    )
    require(QEMU is not None, "qemu-aarch64 not installed (apt install qemu-user)")
    d = tempfile.mkdtemp(prefix="kvsidecar-qemu-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def build(work_dir: str, name: str, latch_source: str = fc.SOURCE) -> str:
    out = os.path.join(work_dir, name)
    cmd = [fc.AARCH64_CC, "-O2", "-std=c11", "-static", "-pthread"]
    cmd += [f'-DLATCH_SOURCE="{latch_source}"', HARNESS, "-o", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def run(binary: str, seconds: str = SECONDS) -> dict[str, int]:
    proc = subprocess.run(
        [QEMU, binary, seconds, "2"], capture_output=True, text=True, timeout=float(seconds) + 60
    )
    m = re.search(r"reads=(\d+) ok=(\d+) retries=(\d+) torn=(\d+) published=(\d+)", proc.stdout)
    assert m is not None, (proc.returncode, proc.stdout, proc.stderr)
    keys = ("reads", "ok", "retries", "torn", "published")
    return dict(zip(keys, map(int, m.groups()))) | {"rc": proc.returncode}


def test_aarch64_latch_under_qemu_accepts_no_torn_snapshot(work_dir: str) -> None:
    result = run(build(work_dir, "stress"))
    print(f"\nqemu-aarch64 stress: {result}")
    assert result["torn"] == 0 and result["rc"] == 0
    assert result["ok"] > 1000 and result["published"] > 1000  # it really ran


def test_the_oracle_sees_torn_snapshots_when_the_checks_are_off(work_dir: str) -> None:
    with open(fc.SOURCE) as f:
        source = f.read()
    for old, new in NO_CHECKS:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    mutated = os.path.join(work_dir, "_seqlock_no_checks.c")
    with open(mutated, "w") as f:
        f.write(source)
    binary = build(work_dir, "stress_no_checks", mutated)
    torn = 0
    for _ in range(5):  # laps are a race: usually a few in the first run
        torn += run(binary)["torn"]
        if torn:
            break
    assert torn > 0
