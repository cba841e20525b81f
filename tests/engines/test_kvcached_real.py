"""Our kvcached adapter against kvcached 0.1.6's real observability code (its own env).

The helper (kvcached_helpers/check_real.py) drives kvcached's ``build_kv_cache_pool_snapshot``
and ``get_capabilities`` from the unpacked sdist, reads our records back from shared memory,
and runs kvcached's own tests/test_observability.py on the same source; see its docstring.
Built by ``bash .ci/engine-env kvcached``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines.envs import run_json_helper

HELPER = str(Path(__file__).parent / "kvcached_helpers" / "check_real.py")


@pytest.fixture(scope="module")
def checked() -> dict:
    # One interpreter for every test here: importing torch (for kvcached) is most of it.
    return run_json_helper(
        "kvcached", HELPER, ["--cases", "500", "--broken-cases", "20", "--own-tests"], timeout=240
    )


def test_every_kvcached_field_equal_or_explained(checked):
    out = checked
    print(
        f"\nkvcached {out['kvcached_schema']}: {out['cases']} snapshots from its real builder, "
        f"{out['checks']} field checks, {out['mismatches']} mismatches; "
        f"{out['equal']} fields equal, explained: {', '.join(out['explained'])}"
    )
    assert out["problems"] == [] and out["mismatches"] == 0 and out["rc"] == 0
    assert out["kvcached_fields"] == out["equal"] + len(out["explained"])
    assert out["operation_counters"] is False  # so our counters stay null
    assert out["checks"] >= 500 * out["kvcached_fields"]


def test_the_check_catches_a_broken_adapter(checked):
    # The adapter with effective_free_pages dropped: the same check must fail.
    broken = checked["broken"]
    assert broken["mismatches"] == broken["cases"] == 20
    assert any("effective_free_pages" in p for p in broken["problems"])


def test_kvcached_own_observability_tests_pass_on_this_source(checked):
    # The source we test against is kvcached 0.1.6's, and its own tests pass on it here.
    assert checked["kvcached_version"] == "0.1.6"
    assert checked["own_tests_rc"] == 0, checked["stdout"][-3000:]
    assert " passed" in checked["stdout"]
