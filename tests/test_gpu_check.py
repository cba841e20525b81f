"""`make gpu-check` installs without an index or build isolation (issue #33, item 13).

CI has no GPU, so this is the dry run, with pip's index off. It covers the case that broke
the script on the lent GPU machine, whose python3 is itself a venv (/opt/torch/.venv) holding
torch: as for the suite's .venv here, the venv gpu-check makes from it with
--system-site-packages alone would not see torch, and the venv has no pip of its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# Left out of the copy: environments, build outputs and results (the copy builds its own).
HEAVY = {".git", ".venv", ".venv-py313", ".engine-envs", ".gpu-venv", "gpu-results",
         "gpu-wheels", "build", "dist", "bench-results", ".hypothesis", ".pytest_cache",
         ".ruff_cache", "__pycache__"}  # fmt: skip


def _heavy(_dir: str, names: list[str]) -> list[str]:
    return [n for n in names if n in HEAVY or n.endswith((".so", ".egg-info"))]


@pytest.mark.slow
def test_gpu_check_dry_run_offline_from_a_venv_python(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    clone = tmp_path / "clone"
    # A copy: the editable install compiles _seqlock in place, which must not rewrite the
    # .so that this suite's other processes have mapped.
    shutil.copytree(REPO, clone, ignore=_heavy)
    venv = tmp_path / "gpu-venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "KVSIDECAR_"))}
    # No index and no pip configuration: everything must come from what is installed.
    env.update(PYTHON=sys.executable, GPU_VENV=str(venv), PIP_NO_INDEX="1",
               PIP_CONFIG_FILE=os.devnull, CUDA_VISIBLE_DEVICES="")  # fmt: skip
    r = subprocess.run(
        ["bash", ".ci/gpu-check"], cwd=clone, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "gpu-check: done (cuda=0)" in out, out[-4000:]
    assert out.count("gpu-check: SKIPPED (no CUDA)") == 4, out[-4000:]
    # The extension was compiled in the copy, and the venv saw torch through the .pth.
    assert list((clone / "kvsidecar" / "protocol").glob("_seqlock*.so"))
    assert list(venv.glob("lib/python3.*/site-packages/gpu-check-python.pth"))
    assert not (venv / "bin" / "pip").exists(), "made --without-pip: the machine's pip serves"
    assert (clone / "gpu-results" / "publish.json").is_file()
    assert (clone / "gpu-results" / "cpu" / "agent.json").is_file()
