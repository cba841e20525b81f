"""KVSIDECAR_SHM_DIR naming a directory that does not exist (issue #23, item 4): the docs
say it must exist, and the code does what they say: the agent creates only the default
(a missing other directory disables it with one line naming the directory, the engine
runs on) and `serve` exits 2 naming it."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO
from tests.test_operator_cli import cli


def test_docs_say_a_non_default_directory_must_exist() -> None:
    for doc in ("docs/vllm.md", "docs/operations.md"):
        text = re.sub(r"\s+", " ", (Path(REPO) / doc).read_text())
        assert re.search(r"KVSIDECAR_SHM_DIR`?,? .{0,200}must exist", text), doc


def test_agent_and_serve_do_what_the_docs_say(tmp_path) -> None:
    from kvsidecar.agent import KVSidecarAgent

    missing = str(tmp_path / "not-created")
    agent = KVSidecarAgent("vllm", "m", shm_dir=missing)
    assert not agent.enabled and missing in str(agent.error)
    agent.step(0, 0)  # a disabled agent is a no-op, never an exception in the engine
    assert not (tmp_path / "not-created").exists()
    r = cli("serve", "--shm-dir", missing, "--web.listen-address", "127.0.0.1:0")
    assert r.returncode == 2 and missing in r.stderr, r.stderr


def test_troubleshooting_quotes_the_message_serve_prints(tmp_path) -> None:
    """The troubleshooting row for a daemon that exits at start quotes what serve really
    prints for a missing directory (it quoted a message that never occurs for that)."""
    text = (Path(REPO) / "docs" / "operations.md").read_text()
    row = next(ln for ln in text.splitlines() if ln.startswith("| The daemon exits at start"))
    quoted = re.search(r"`([^`]*\.\.\.[^`]*)`", row).group(1)
    r = cli("serve", "--shm-dir", str(tmp_path / "missing"), "--web.listen-address", "127.0.0.1:0")
    assert r.returncode == 2
    pattern = ".*".join(re.escape(part.strip()) for part in quoted.split("..."))
    assert re.search(pattern, r.stderr), (quoted, r.stderr)
