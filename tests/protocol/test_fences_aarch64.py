"""The seqlock's fences in the aarch64 assembly of _seqlock.c (issue #15 item 2).

Cross-compiles with Debian's gcc-aarch64-linux-gnu. Skips without it, except in CI
(CI=true or KVSIDECAR_REQUIRE_ENGINES=1), where a missing compiler fails: .ci/run
installs it, so a skip there would hide a dropped fence.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.protocol import fence_check as fc


def require(ok: bool, reason: str) -> None:
    if ok:
        return
    if os.environ.get("CI") == "true" or os.environ.get("KVSIDECAR_REQUIRE_ENGINES") == "1":
        pytest.fail(f"{reason} (required in CI: .ci/run installs it)")
    pytest.skip(reason)


@pytest.fixture
def work_dir():
    require(
        fc.have_aarch64_cc(), f"{fc.AARCH64_CC} not installed (apt install gcc-aarch64-linux-gnu)"
    )
    d = tempfile.mkdtemp(prefix="kvsidecar-fences-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("opt", ["-O2", "-O3", "-Os"])
def test_shipped_latch_has_every_fence(work_dir: str, opt: str, monkeypatch) -> None:
    """W1, W2: `dmb ish` around the slot stores; the sequence load `ldar`; R1 `dmb ishld`."""
    monkeypatch.setattr(fc, "CFLAGS", [opt, *fc.CFLAGS[1:]])
    assert fc.check_aarch64_asm(fc.aarch64_asm(fc.SOURCE, work_dir)) == []


@pytest.mark.parametrize("mutation", [m for m in fc.MUTATIONS if m not in fc.AARCH64_BLIND])
def test_each_dropped_or_weakened_fence_is_caught(work_dir: str, mutation: str) -> None:
    """Mutation test: a copy of _seqlock.c with one fence dropped/weakened/moved must fail."""
    with open(fc.SOURCE) as f:
        mutated = fc.mutate(f.read(), mutation)
    src = os.path.join(work_dir, "_seqlock.c")
    with open(src, "w") as f:
        f.write(mutated)
    problems = fc.check_aarch64_asm(fc.aarch64_asm(src, work_dir))
    assert problems, f"{mutation}: the aarch64 check did not notice"
