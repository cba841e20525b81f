"""Where the engines' own environments are, for tests that run real engine code.

`.ci/engine-env NAME` builds NAME's environment from `.ci/locks/NAME.txt` and links it at
`.engine-envs/NAME`; run through that link it imports this clone's kvsidecar (the shim of
kvsidecar/bench/engine_envs.py). Without it a test skips with the command that builds it; with
``KVSIDECAR_REQUIRE_ENGINES=1`` (set by `.ci/run`) a missing environment fails instead,
so CI can never pass by skipping them.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.bench.engine_envs import wrong_checkout

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _wrong_checkout(name: str, python: Path) -> str | None:
    """Asked once per session: it starts the environment's Python (kvsidecar/bench/
    engine_envs.py: which kvsidecar it imports)."""
    return wrong_checkout(name, python, ROOT)


def engine_python(name: str, *, runs_checkout: bool = True) -> str:
    """The Python of engine `name`'s environment, or skip (fail under CI) with the fix.
    ``runs_checkout=False``: the caller runs none of kvsidecar's code in the engine, so the
    environment may be bound to another checkout."""
    override = os.environ.get(f"KVSIDECAR_{name.upper()}_PYTHON")
    python = Path(override) if override else ROOT / ".engine-envs" / name / "bin" / "python"
    if python.exists():
        problem = _wrong_checkout(name, python) if runs_checkout else None
        if problem is not None:
            pytest.fail(problem)  # running another checkout's code would test the wrong thing
        return str(python)
    reason = f"no {name} environment at {python}: build it with `bash .ci/engine-env {name}`"
    if os.environ.get("KVSIDECAR_REQUIRE_ENGINES", "") not in ("", "0"):
        pytest.fail(f"{reason} (KVSIDECAR_REQUIRE_ENGINES is set: CI must not skip this)")
    pytest.skip(reason)


def run_in_engine_env(
    name: str, args: list[str], *, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `python args...` in engine `name`'s environment with a timeout; output captured."""
    python = engine_python(name)
    full_env = {**os.environ, **(env or {})}
    full_env.pop("VIRTUAL_ENV", None)
    return subprocess.run(
        [python, *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_json_helper(name: str, helper: str, args: list[str], *, timeout: float) -> dict:
    """Run `helper <scratch shm dir> args...` in engine `name`'s environment and return the
    JSON object on its last stdout line, plus ``rc`` and ``stdout``. The scratch directory
    (in /dev/shm where there is one, as engines use) is removed afterwards."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    shm_dir = tempfile.mkdtemp(prefix=f"kvsidecar-{name}-", dir=base)
    try:
        proc = run_in_engine_env(name, [helper, shm_dir, *args], timeout=timeout)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    out = json.loads(lines[-1])
    out["rc"], out["stdout"] = proc.returncode, proc.stdout
    return out


def vllm_server_env(shm: Path, tmp_path_factory: Any) -> dict[str, str]:
    """A real vLLM server's environment: offline CPU settings, a model cache shared by the
    session's servers, segments in `shm`, and the plugin found by its entry point alone."""
    from kvsidecar.bench import vllm as vb

    env = {
        **vb.engine_env(cache_root=str(tmp_path_factory.getbasetemp() / "vllm-cache")),
        "KVSIDECAR_SHM_DIR": str(shm),
    }
    env.pop("VLLM_PLUGINS", None)
    return env
