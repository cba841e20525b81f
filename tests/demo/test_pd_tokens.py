"""The KV really moves: a P/D pair generates exactly what one process generates."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from .procs import run_engine

N = 16
COMMON = (
    "--max-requests",
    str(N),
    "--rate",
    "40",
    "--seed",
    "7",
    "--exit-when-done",
    "--step-ms",
    "0",
    "--num-blocks",
    "48",
)


def records(path: Path) -> dict[str, dict[str, dict]]:
    """role -> req -> merged fields of that role's lines about the request."""
    out: dict[str, dict[str, dict]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        out.setdefault(r["role"], {}).setdefault(r["req"], {}).update(r)
    return out


@pytest.mark.timeout(120)
def test_decode_generates_what_a_single_process_generates(shm_dir: str, tmp_path: Path) -> None:
    runs = {
        "single": ("--out", str(tmp_path / "single.jsonl")),
        "pd": ("--pd", "--transfer-delay", "0.05", "--out", str(tmp_path / "pd.jsonl")),
        # Negative control: the same pair, but decode zeroes the K/V it pulled.
        "corrupt": ("--pd", "--corrupt-transfer", "--out", str(tmp_path / "corrupt.jsonl")),
    }
    procs = {
        name: run_engine(tmp_path, name, *COMMON, "--shm-dir", shm_dir, *args)
        for name, args in runs.items()
    }
    for name, p in procs.items():
        assert p.wait(100) == 0, (tmp_path / f"{name}.err").read_text()
    assert os.listdir(shm_dir) == []  # every agent closed its segment on the way out

    single = records(tmp_path / "single.jsonl")["both"]
    pd = records(tmp_path / "pd.jsonl")
    corrupt = records(tmp_path / "corrupt.jsonl")["decode"]
    assert len(single) == len(pd["decode"]) == len(pd["prefill"]) == N

    for req, s in single.items():
        d, p = pd["decode"][req], pd["prefill"][req]
        assert d["tokens"] == s["tokens"], req
        assert len(d["tokens"]) >= 16
        # What decode read back from its own blocks is what prefill read from its blocks.
        assert d["pulled_from"] == p["pulled_from"] and d["kv_sha"] == p["kv_sha"], req
    # Decode pulled only what its own prefix cache lacked (a shared system prompt) for some
    # requests, and whole prompts for others: both paths produced the same tokens.
    starts = [d["pulled_from"] for d in pd["decode"].values()]
    assert 0 in starts and any(s > 0 for s in starts)
    # The single process reused cached prefixes too: equality is not by recomputing alike.
    assert any(s["cached"] > 0 for s in single.values())

    wrong = [req for req, s in single.items() if corrupt[req]["tokens"] != s["tokens"]]
    assert len(wrong) >= N // 2, "zeroed K/V should change the generated tokens"
