"""`kvsidecar dump` and `kvsidecar ls`: through click's runner and as real subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kvsidecar.cli.main import main
from tests.conftest import REPO
from tests.support.procs import start_rank
from tests.support.rank_writer import expected_pool


@pytest.fixture
def ranks(shm_dir: str):
    procs = [start_rank(f"kvsidecar.fake.dp{dp}.tp0.pp0", shm_dir, dp=dp)[0] for dp in (0, 1)]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvsidecar", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )


def test_dump_table_shows_every_rank_and_pool(shm_dir: str, ranks) -> None:
    result = CliRunner().invoke(main, ["dump", "--shm-dir", shm_dir])
    assert result.exit_code == 0, result.output
    assert "kvsidecar.fake.dp0.tp0.pp0" in result.output
    assert "kvsidecar.fake.dp1.tp0.pp0" in result.output
    assert result.output.count("pool0") == 2 and result.output.count("pool1") == 2
    assert str(expected_pool(1, 1)["allocated_blocks"]) in result.output


def test_dump_json_is_only_json(shm_dir: str, ranks) -> None:
    proc = _cli("dump", "--shm-dir", shm_dir, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # stdout is nothing but JSON
    by_name = {t["segment"]: t for t in data["targets"]}
    t = by_name["kvsidecar.fake.dp0.tp0.pp0"]
    assert t["state"] == "up"
    assert (
        t["snapshot"]["pools"][0]["deferred_free_blocks"]
        == expected_pool(0, 0)["deferred_free_blocks"]
    )


def test_dump_pattern_selects_one(shm_dir: str, ranks) -> None:
    proc = _cli("dump", "--shm-dir", shm_dir, "--json", "*dp1*")
    assert proc.returncode == 0, proc.stderr
    assert [t["segment"] for t in json.loads(proc.stdout)["targets"]] == [
        "kvsidecar.fake.dp1.tp0.pp0"
    ]


def test_dump_watch_is_ndjson_when_not_a_terminal(shm_dir: str, ranks) -> None:
    proc = _cli("dump", "--shm-dir", shm_dir, "--watch", "0.2", "--count", "3")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 3
    steps = [json.loads(line)["targets"][0]["snapshot"]["runtime"]["step"] for line in lines]
    assert steps[0] < steps[-1]  # live: each line is a fresh read


def test_ls_lists_state_and_age(shm_dir: str, ranks) -> None:
    result = CliRunner().invoke(main, ["ls", "--shm-dir", shm_dir])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("kvsidecar.fake")]
    assert len(lines) == 2 and all(" up " in line for line in lines)


def test_exit_codes_and_one_line_errors(shm_dir: str) -> None:
    proc = _cli("dump", "--shm-dir", shm_dir)
    assert proc.returncode == 1
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
    assert "no segments" in proc.stderr
    assert _cli("ls", "--shm-dir", shm_dir).returncode == 1
    assert _cli("dump", "--no-such-flag").returncode == 2
    proc = _cli("serve", "--shm-dir", shm_dir + "/missing", "--web.listen-address", ":0")
    assert proc.returncode == 2 and "--shm-dir" in proc.stderr and "does not exist" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_dump_dead_writer_is_not_passed_off_as_fresh(shm_dir: str) -> None:
    proc, _ = start_rank("kvsidecar.fake.dp0.tp0.pp0", shm_dir)
    proc.kill()
    proc.wait()
    out = _cli("dump", "--shm-dir", shm_dir, "--json")
    assert out.returncode == 1  # nothing up
    t = json.loads(out.stdout)["targets"][0]
    assert t["state"] == "dead" and "snapshot" not in t and "last_snapshot" in t
