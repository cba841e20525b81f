"""The seqlock's fences in GCC's optimized IR of _seqlock.c, on the host and on aarch64.

On x86-64 the fences compile to no instruction at all (TSO): what they do there is
forbid the compiler to reorder, and that is visible only in the compiler's IR. The
IR check also sees the C memory order itself, so it catches the one mutation the
aarch64 assembly cannot (an acquire fence made a release fence: both `dmb ish`).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.protocol import fence_check as fc
from tests.protocol.test_fences_aarch64 import require

COMPILERS = ["gcc", fc.AARCH64_CC]


@pytest.fixture(params=COMPILERS)
def cc(request) -> str:
    require(shutil.which(request.param) is not None, f"{request.param} not installed")
    if request.param == "gcc":  # the host build includes Python.h, the aarch64 one does not
        require(fc.python_include() is not None, "Python.h not found (python3-dev)")
    return request.param


@pytest.fixture
def work_dir():
    d = tempfile.mkdtemp(prefix="kvsidecar-fences-ir-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_shipped_latch_has_every_fence(cc: str, work_dir: str) -> None:
    assert fc.check_ir(fc.gimple(cc, fc.SOURCE, work_dir)) == []


@pytest.mark.parametrize("mutation", list(fc.MUTATIONS))
def test_each_dropped_or_weakened_fence_is_caught(mutation: str, work_dir: str) -> None:
    require(shutil.which("gcc") is not None, "gcc not installed")
    require(fc.python_include() is not None, "Python.h not found (python3-dev)")
    with open(fc.SOURCE) as f:
        mutated = fc.mutate(f.read(), mutation)
    src = os.path.join(work_dir, "_seqlock.c")
    with open(src, "w") as f:
        f.write(mutated)
    assert fc.check_ir(fc.gimple("gcc", src, work_dir)), f"{mutation}: the IR check did not notice"
