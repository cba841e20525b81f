"""The vLLM plugin's entry point and version tolerance.

Without vLLM (the main venv) ``register()`` is a no-op; against the real vLLM
(tests/engines/vllm_helpers/tolerance_driver.py in the vLLM env) a missing hook point
disables the plugin with one log line naming the version and the attribute while the
engine generates as usual, and KVSIDECAR_DISABLE=1 patches nothing.
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from tests.engines.envs import ROOT, run_in_engine_env

DRIVER = ROOT / "tests" / "engines" / "vllm_helpers" / "tolerance_driver.py"


def test_entry_point_and_engine_table_name_the_plugin():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    eps = meta["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {"kvsidecar": "kvsidecar.agent.engines.vllm:register"}
    from kvsidecar.agent.engines import ENGINES, load

    assert ENGINES["vllm"] == "kvsidecar.agent.engines.vllm:register"
    assert callable(load("vllm"))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_register_without_vllm_is_a_no_op():
    from kvsidecar.agent.engines import vllm as plugin

    plugin.register()
    plugin.register()  # idempotent
    assert importlib.util.find_spec("vllm") is None


@pytest.mark.timeout(300)
def test_missing_hook_point_disables_with_one_line_and_engine_runs(tmp_path, tmp_path_factory):
    shm = tmp_path / "shm"
    shm.mkdir()
    proc = run_in_engine_env(
        "vllm",
        [str(DRIVER), str(tmp_path / "model"), str(shm)],
        timeout=280,
        env={"VLLM_CACHE_ROOT": str(tmp_path_factory.getbasetemp() / "vllm-cache")},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-3000:], proc.stderr[-6000:])
    r = json.loads(lines[-1][len("RESULT ") :])
    assert r["disabled_patched"] is False
    assert r["generated"] == 6  # the engine served as if the plugin were not there
    assert r["sidecar"] is False and r["segments"] == []
    out = proc.stdout + proc.stderr
    lines = [ln for ln in out.splitlines() if "kvsidecar" in ln and "disabled" in ln]
    assert len(lines) == 1, lines
    assert lines[0].endswith(
        "kvsidecar disabled for vLLM 0.32.0: hook point BlockPool.unpin_blocks is missing "
        "(tested: 0.32.0, 0.33.0)"
    ), lines


def _config(kv_role=None, connector="HoldConnector", served=("m",), **par):
    # Only the attributes identity() reads (the real config is exercised by the
    # accounting and server tests, which check engine, version, role and model_name).
    from types import SimpleNamespace as NS

    parallel = {"data_parallel_size": 1, "tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    kv = NS(kv_role=kv_role, kv_connector=connector) if kv_role else None
    return NS(
        parallel_config=NS(**{**parallel, **par}),
        kv_transfer_config=kv,
        model_config=NS(served_model_name=list(served), model="/models/x"),
        device_config=NS(device_type="cpu"),
    )


@pytest.mark.parametrize(
    ("kv_role", "role"),
    [("kv_producer", "prefill"), ("kv_consumer", "decode"), ("kv_both", "both"), (None, "both")],
)
def test_identity_role_from_kv_role(kv_role, role):
    from kvsidecar.agent.engines.vllm import identity

    ident = identity(_config(kv_role))
    assert ident["role"] == role and ident["engine"] == "vllm" and ident["model_name"] == "m"


def test_identity_dense_dp_rank_survives_vllms_reconfiguration():
    from kvsidecar.agent.engines.vllm import identity

    # A dense DP rank 3 of 4 after vLLM's reconfigure_for_independent_dp_rank().
    ident = identity(
        _config(
            data_parallel_size=1,
            data_parallel_rank=0,
            data_parallel_index=3,
            tensor_parallel_size=2,
        )
    )
    assert (ident["dp_rank"], ident["tp_rank"], ident["tp_size"]) == (3, 0, 2)
    assert ident["dp_size"] >= 4
    assert identity(_config(served=()))["model_name"] == "/models/x"


def _fake_scheduler(**override):
    """A class with every Scheduler hook point at the tested signatures (plus overrides)."""
    from kvsidecar.agent.engines import vllm as plugin

    ns = {}
    for name, params in plugin.HOOK_SIGNATURES["Scheduler"].items():
        args = ", ".join(("self", *params))
        exec(f"def {name}({args}): return None", ns)
    ns.update(override)
    return type("Scheduler", (), {k: v for k, v in ns.items() if k != "__builtins__"})


def test_tested_signatures_pass_the_check():
    from kvsidecar.agent.engines import vllm as plugin

    assert plugin.signature_mismatch(_fake_scheduler(), "Scheduler") is None


def test_changed_hook_signature_disables_with_one_line(caplog):
    from kvsidecar.agent.engines import vllm as plugin

    def _free_blocks(self, request, fence_seq):  # a vLLM that grew a parameter
        return None

    base = _fake_scheduler(_free_blocks=_free_blocks)
    assert plugin.signature_mismatch(base, "Scheduler") == (
        "Scheduler._free_blocks(request, fence_seq) instead of (request)"
    )
    plugin._logged.discard("hook")
    with caplog.at_level("WARNING", logger="vllm.kvsidecar"):
        assert plugin.sidecar_scheduler_class(base) is base  # vLLM's own class, unpatched
        assert plugin.sidecar_scheduler_class(base) is base
    lines = [r.getMessage() for r in caplog.records if "kvsidecar disabled" in r.getMessage()]
    assert lines == [
        f"kvsidecar disabled for vLLM {plugin.vllm_version()}: hook point signature changed: "
        "Scheduler._free_blocks(request, fence_seq) instead of (request) "
        "(tested: 0.32.0, 0.33.0)"
    ]
    plugin._logged.discard("hook")


def test_renamed_parameter_and_unreadable_signature_are_changes():
    from kvsidecar.agent.engines import vllm as plugin

    def update_from_output(self, output, runner_output):
        return None

    renamed = _fake_scheduler(update_from_output=update_from_output)
    assert plugin.signature_mismatch(renamed, "Scheduler").startswith(
        "Scheduler.update_from_output(output, runner_output) instead of"
    )
    unreadable = _fake_scheduler(shutdown=None)  # not a function: no signature to compare
    assert (
        plugin.signature_mismatch(unreadable, "Scheduler") == "Scheduler.shutdown(?) instead of ()"
    )


def test_pass_through_override_is_checked_at_the_method_it_forwards_to():
    from kvsidecar.agent.engines import vllm as plugin

    class Custom(_fake_scheduler()):  # a user's --scheduler-cls
        def update_from_output(self, *args, **kwargs):
            return super().update_from_output(*args, **kwargs)

    assert plugin.signature_mismatch(Custom, "Scheduler") is None

    def _free_blocks(self, request, fence_seq):
        return None

    class Forwards(_fake_scheduler(_free_blocks=_free_blocks)):
        def _free_blocks(self, *args, **kwargs):
            return super()._free_blocks(*args, **kwargs)

    assert plugin.signature_mismatch(Forwards, "Scheduler").startswith(
        "Scheduler._free_blocks(request, fence_seq)"
    )


_DISABLED_LINE = """
import logging, sys
import vllm.logger
from vllm.config.logging import LoggingConfig
vllm.logger.configure_logging(LoggingConfig())  # what every vLLM process does at start
from kvsidecar.agent.engines import vllm as plugin
plugin.register()
from kvsidecar.agent import KVSidecarAgent
agent = KVSidecarAgent("vllm", "m", shm_dir=sys.argv[1])
print("ENABLED", agent.enabled, flush=True)
"""


@pytest.mark.timeout(300)
def test_agent_lines_go_through_vllms_logger(tmp_path):
    """The agent's own lines (here "agent disabled": its directory is a file) come out
    through ``vllm.kvsidecar`` in vLLM's format, once, not bare from ``kvsidecar.agent``."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    proc = run_in_engine_env(
        "vllm",
        ["-c", _DISABLED_LINE, str(not_a_dir)],
        timeout=280,
        env={"VLLM_CONFIGURE_LOGGING": "1"},
    )
    assert "ENABLED False" in proc.stdout, (proc.stdout[-2000:], proc.stderr[-4000:])
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "agent disabled" in ln]
    assert len(lines) == 1, lines
    # vLLM's format: "(<process> pid=N) WARNING mm-dd hh:mm:ss [file.py:line] message".
    assert re.search(
        r"WARNING \d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+:\d+\] kvsidecar agent disabled", lines[0]
    ), lines


def _expiry_sidecar():
    """A sidecar of one pool source with only the deferral bookkeeping set up (no vLLM)."""
    from types import SimpleNamespace as NS

    from kvsidecar.agent.engines.vllm import VllmPoolSource, VllmSidecar

    src = VllmPoolSource.__new__(VllmPoolSource)
    src.stats = NS(deferred_free_ended_total=None, deferred_free_expired_total=None)
    src._holders, src.deferred_blocks, src.deferred_requests = {}, 0, 0
    src._since = {}
    src.start_deferral_counters(tracks_expiry=True)
    return src, VllmSidecar(agent=None, sources=[src], tracks_expiry=True)


def test_expiry_is_told_from_completed_reads_by_the_steps_own_count():
    """One step's finished_sending mixing a lease expiry and completed READs (NixlConnector
    reports only how many expired): counts exact, the expired blocks are the oldest
    deferral's; a step without an expiry count marks none; the real pair covers the rest
    (tests/engines/test_vllm_pd.py)."""
    from types import SimpleNamespace as NS

    src, sidecar = _expiry_sidecar()
    blocks = {"old": [1, 2, 3], "mid": [4], "new": [5, 6]}
    for t, (rid, ids) in enumerate(blocks.items()):
        src._request_block_ids = lambda _rid, ids=ids: ids
        sidecar._deferred[rid] = (t, [src.defer(rid, t)])  # deferred at t: "old" first

    def step(ids: set[str], expired: int) -> None:
        stats = NS(data={"num_kv_expired_reqs": [1] * expired}) if expired else None
        out = NS(kv_connector_output=NS(finished_sending=ids, kv_connector_stats=stats))
        sidecar.note_connector_output(out)
        for rid in ids:
            sidecar.before_free_blocks(NS(request_id=rid))

    step({"new", "old"}, expired=1)  # mixed: the oldest is taken as the expired one
    s = src.stats
    assert (s.deferred_free_ended_total, s.deferred_free_ended_blocks_total) == (2, 5)
    assert (s.deferred_free_expired_total, s.deferred_free_expired_blocks_total) == (1, 3)
    step({"mid"}, expired=0)  # a completed READ
    assert (s.deferred_free_ended_total, s.deferred_free_expired_total) == (3, 1)
    assert src.deferred_requests == src.deferred_blocks == 0 and not sidecar._deferred


def test_a_deferral_holding_no_block_is_not_counted_and_takes_no_expiry():
    """Issue 30 item 3: the runtime deferred count included a deferral holding no block
    (runtime 1, every pool 0), and such a deferral, being the oldest, took the step's
    expiry that no pool then counted. The rule: a deferral counts while it holds a block."""
    from types import SimpleNamespace as NS

    src, sidecar = _expiry_sidecar()
    requests: dict[str, object] = {}
    scheduler = NS(requests=requests)
    for rid, ids in (("empty", []), ("full", [1, 2])):  # "empty" defers first: the oldest
        src._request_block_ids = lambda _rid, ids=ids: ids
        requests[rid] = NS(request_id=rid)
        sidecar.after_free_request(scheduler, requests[rid])
    assert (src.deferred_requests, len(sidecar._deferred)) == (1, 1)  # runtime == pool
    out = NS(
        kv_connector_output=NS(
            finished_sending={"empty", "full"},
            kv_connector_stats=NS(data={"num_kv_expired_reqs": [1]}),
        )
    )
    sidecar.note_connector_output(out)
    for rid in ("empty", "full"):
        sidecar.before_free_blocks(NS(request_id=rid))
    s = src.stats
    assert (s.deferred_free_expired_total, s.deferred_free_expired_blocks_total) == (1, 2)
    assert src.deferred_requests == 0 and not sidecar._deferred


def test_ended_blocks_are_summed_per_request_shared_blocks_once_each():
    """Issue 30 item 8a, as schema.md and metrics.md now say: deferred_free_ended_blocks_total
    adds the blocks each ended deferral held (a shared block once per request), while
    deferred_free_blocks counts a shared block once."""
    from types import SimpleNamespace as NS

    src, sidecar = _expiry_sidecar()
    requests: dict[str, object] = {}
    scheduler = NS(requests=requests)
    for rid, ids in (("a", [1, 2, 3]), ("b", [2, 3, 4])):  # 2 and 3 shared
        src._request_block_ids = lambda _rid, ids=ids: ids
        requests[rid] = NS(request_id=rid)
        sidecar.after_free_request(scheduler, requests[rid])
    assert (src.deferred_requests, src.deferred_blocks) == (2, 4)  # distinct: {1, 2, 3, 4}
    for rid in ("a", "b"):
        sidecar.before_free_blocks(NS(request_id=rid))
    s = src.stats
    assert (s.deferred_free_ended_total, s.deferred_free_ended_blocks_total) == (2, 6)
