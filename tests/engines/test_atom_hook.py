"""The ATOM start-up hook: inert unless KVSIDECAR_ATOM is set, active in a real interpreter.

ATOM is not installable here (not on PyPI), so these run a stand-in package built by the test:
``atom.model_engine.scheduler`` with a ``Scheduler`` that has the hook points the adapter reads
(the trigger is the module name; ATOM's real scheduler was checked by hand, docs/atom.md).
Each case is a fresh interpreter that processes our ``.pth`` line exactly as ``site`` does at
start-up (``site.addsitedir``), imports the stand-in and reports what it sees. What this shows:
with the variable unset (or ``0``, or ``KVSIDECAR_DISABLE=1``) the process is the same as with
no ``.pth`` at all (no kvsidecar module imported, ``sys.meta_path`` unchanged, ATOM's methods
and its ``deferred_free_blocks`` dict untouched, no segment); with it set, the scheduler
publishes, after ``postprocess`` and after a KV-transfer completion.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvsidecar.agent.engines import atom_hook

STAND_IN = """
from types import SimpleNamespace


class Scheduler:
    def __init__(self, config):
        self.config = config
        kv = SimpleNamespace(num_used=0, num_free=config.num_kvcache_blocks,
                             num_blocks=config.num_kvcache_blocks, _cached={})
        self.block_manager = SimpleNamespace(kv=kv)
        self.deferred_free_blocks = {}
        self.cache_stats = None
        self.running = []

    def get_request_counts(self):
        return len(self.running), 0

    def postprocess(self, seqs, fwd_output=None, stream_output_queue=None, batch=None):
        for seq in seqs:  # a P/D producer: finished requests keep their blocks
            self.deferred_free_blocks[seq.id] = seq
        return list(seqs)

    def _update_from_kv_xfer_finished(self, out):
        for req_id in out.finished_sending:
            self.deferred_free_blocks.pop(req_id)  # ATOM then deallocates its blocks
"""

PROBE = """
import json, os, site, sys
from types import SimpleNamespace
if os.environ.get("PROBE_SITE"):
    site.addsitedir(os.environ["PROBE_SITE"])  # what site does at start-up with our .pth
meta = [type(f).__name__ for f in sys.meta_path]
import atom.model_engine.scheduler as m
s = m.Scheduler(SimpleNamespace(num_kvcache_blocks=16, kv_cache_block_size=4))
kv = s.block_manager.kv
kv.num_used, kv.num_free = 5, 11
seqs = [SimpleNamespace(id=1, block_table=[0, 1, 2]),
        SimpleNamespace(id=2, block_table=[0, 1, 3, 4])]
s.postprocess(seqs)
report = {
    "meta_path": meta,
    "kvsidecar_modules": sorted(n for n in sys.modules if n.startswith("kvsidecar")),
    "wrapped": sorted(n for n in ("__init__", "postprocess", "_update_from_kv_xfer_finished")
                      if hasattr(getattr(m.Scheduler, n), "__wrapped__")),
    "deferred_type": type(s.deferred_free_blocks).__name__,
    "attrs": sorted(s.__dict__),
    "segments": sorted(os.listdir(os.environ["KVSIDECAR_SHM_DIR"])),
}
sidecar = s.__dict__.get("_kvsidecar")
if sidecar is not None:
    from kvsidecar.protocol.reader import SegmentReader
    r = SegmentReader(path=sidecar.agent.segment_path)
    r.attach()
    def read():
        snap = r.read().snapshot
        p = snap.pools[0]
        return [snap.runtime.step, p.allocated_blocks, p.deferred_free_requests,
                p.deferred_free_blocks, snap.runtime.engine]
    report["after_postprocess"] = read()
    kv.num_used, kv.num_free = 2, 14
    s._update_from_kv_xfer_finished(SimpleNamespace(finished_sending={2}))
    report["after_xfer"] = read()
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("atom_stand_in")
    pkg = root / "atom" / "model_engine"
    pkg.mkdir(parents=True)
    (root / "atom" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "scheduler.py").write_text(textwrap.dedent(STAND_IN))
    site_dir = tmp_path_factory.mktemp("site")
    assert atom_hook.install_pth(site_dir).read_text() == atom_hook.PTH_LINE
    (root / "site").symlink_to(site_dir)
    return root


def _probe(root: Path, tmp_path: Path, pth: bool, **env: str) -> dict:
    shm = tmp_path / f"shm{len(list(tmp_path.iterdir()))}"
    shm.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSIDECAR_")}
    run_env = {**base, "PYTHONPATH": str(root), "KVSIDECAR_SHM_DIR": str(shm), **env}
    if pth:
        run_env["PROBE_SITE"] = str(root / "site")
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=run_env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_pth_line_is_one_import_line() -> None:
    # site runs a .pth line only if it starts with "import"; one line, no newline inside.
    assert atom_hook.PTH_LINE.startswith("import ") and atom_hook.PTH_LINE.count("\n") == 1
    assert "KVSIDECAR_ATOM" in atom_hook.PTH_LINE


@pytest.mark.parametrize(
    "env",
    [{}, {"KVSIDECAR_ATOM": "0"}, {"KVSIDECAR_ATOM": "1", "KVSIDECAR_DISABLE": "1"}],
    ids=["unset", "zero", "disabled"],
)
def test_inactive_hook_changes_nothing(stand_in: Path, tmp_path: Path, env: dict) -> None:
    without = _probe(stand_in, tmp_path, pth=False)
    with_pth = _probe(stand_in, tmp_path, pth=True, **env)
    assert with_pth == without
    assert without["kvsidecar_modules"] == [] and without["wrapped"] == []
    assert without["deferred_type"] == "dict" and without["segments"] == []
    assert "_kvsidecar" not in without["attrs"]


def test_active_hook_publishes_after_postprocess_and_transfers(stand_in, tmp_path) -> None:
    without = _probe(stand_in, tmp_path, pth=False)
    active = _probe(stand_in, tmp_path, pth=True, KVSIDECAR_ATOM="1")
    assert active["meta_path"] == ["AtomImportHook", *without["meta_path"]]
    assert active["wrapped"] == ["__init__", "_update_from_kv_xfer_finished", "postprocess"]
    assert active["deferred_type"] == "DeferredFrees"
    assert active["segments"] == ["kvsidecar.atom.dp0.tp0.pp0"]
    # Step 1 after postprocess: 2 deferred requests holding 5 distinct blocks (0, 1 shared).
    assert active["after_postprocess"] == [1, 5, 2, 5, "atom"]
    # Request 2's send completed: republished, same step number, its blocks released.
    assert active["after_xfer"] == [1, 2, 1, 3, "atom"]


def test_install_status_uninstall_cli(tmp_path: Path) -> None:
    def run(*args: str) -> str:
        cmd = [sys.executable, "-m", "kvsidecar.agent.engines.atom_hook", *args]
        env = {k: v for k, v in os.environ.items() if k != "KVSIDECAR_ATOM"}
        return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout

    site = ["--site-dir", str(tmp_path)]
    assert "wrote" in run("install", *site)
    assert (tmp_path / atom_hook.PTH_NAME).read_text() == atom_hook.PTH_LINE
    assert "installed; KVSIDECAR_ATOM is unset" in run("status", *site)
    run("uninstall", *site)
    assert not (tmp_path / atom_hook.PTH_NAME).exists()
    assert "not installed" in run("status", *site)
