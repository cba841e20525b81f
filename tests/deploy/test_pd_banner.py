"""deploy/vllm-pd/run.sh's ready banner says what to check in the completion's answer: the
dummy model has no tokenizer, so "text" is empty and usage.completion_tokens is the check
(issue 33 item 9)."""

from __future__ import annotations

import subprocess
from pathlib import Path

RUN_SH = Path(__file__).resolve().parents[2] / "deploy" / "vllm-pd" / "run.sh"


def _banner() -> str:
    lines = RUN_SH.read_text().splitlines()
    start = lines.index('echo "run.sh: ready"')
    end = next(i for i in range(start, len(lines)) if "Ctrl-C" in lines[i])
    script = "\n".join(
        [
            "proxy_port=8000 metrics_port=19440 prefill_port=8100",
            "decode_port=8200 REPO=/repo shm=/dev/shm/x",
            *lines[start : end + 1],
        ]
    )
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_banner_names_the_check() -> None:
    banner = _banner()
    assert "/v1/completions" in banner
    assert "usage.completion_tokens" in banner and '"text" is empty' in banner, banner
