"""Our kvcached adapter against kvcached 0.1.6's real observability code (its own env).

The helper (kvcached_helpers/check_real.py) drives kvcached's ``build_kv_cache_pool_snapshot``
and ``get_capabilities`` from the unpacked sdist, and reads our records back from shared
memory; see its docstring. Built by ``bash .ci/engine-env kvcached``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.engines.envs import run_in_engine_env

HELPER = str(Path(__file__).parent / "kvcached_helpers" / "check_real.py")


def _run(shm_dir: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
    proc = run_in_engine_env("kvcached", [HELPER, shm_dir, *args], timeout=240, env=env)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-2000:]
    return proc.returncode, json.loads(lines[-1])


def test_every_kvcached_field_equal_or_explained(shm_dir):
    rc, out = _run(shm_dir, "--cases", "500")
    print(
        f"\nkvcached {out['kvcached_schema']}: {out['cases']} snapshots from its real builder, "
        f"{out['checks']} field checks, {out['mismatches']} mismatches; "
        f"{out['equal']} fields equal, explained: {', '.join(out['explained'])}"
    )
    assert out["problems"] == [] and out["mismatches"] == 0 and rc == 0
    assert out["kvcached_fields"] == out["equal"] + len(out["explained"])
    assert out["operation_counters"] is False  # so our counters stay null
    assert out["checks"] >= 500 * out["kvcached_fields"]


def test_the_check_catches_a_broken_adapter(shm_dir):
    # The adapter with effective_free_pages dropped: the same check must fail.
    rc, out = _run(shm_dir, "--cases", "20", env={"KVSIDECAR_BREAK_ADAPTER": "1"})
    assert rc == 1 and out["mismatches"] == 20
    assert any("effective_free_pages" in p for p in out["problems"])


def test_kvcached_own_observability_tests_pass_on_this_source():
    # The source we test against is kvcached's: its own tests pass on it here.
    # One interpreter: find kvcached's source (PKG-INFO says 0.1.6), run its test file.
    code = (
        "import os, sys, kvcached, pytest; src = os.path.dirname(kvcached.__path__[0]); "
        "assert 'Version: 0.1.6' in open(os.path.join(src, 'PKG-INFO')).read(); "
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', "
        "os.path.join(src, 'tests', 'test_observability.py')]))"
    )
    proc = run_in_engine_env("kvcached", ["-c", code], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
