"""``bench cost --vllm``: what a scrape costs the real vLLM server's processes.

The server (API server, EngineCore, and whatever they spawn: its process tree) answers
the same fixed completions every round (fixed prompts, ``max_tokens``, ``ignore_eos``,
4 at a time); conditions, controls and pairing: `kvsidecar.bench.cost_server`.
"""

from __future__ import annotations

import os
from typing import Any

from kvsidecar import settings
from kvsidecar.bench import cost_server, vllm


def _launch(tmp: str, shm: str, port: int, model: str) -> tuple[list[str], dict[str, str]]:
    env = vllm.engine_env(cache_root=os.path.join(tmp, "vllm-cache"))
    env[settings.SHM_DIR.name] = shm
    python = vllm.vllm_python()
    assert python is not None  # run() checked
    return vllm.server_command(python, model, port, num_gpu_blocks=512), env


def run(quick: bool = False) -> dict[str, Any]:
    if vllm.vllm_python() is None:
        return {"skipped": "no vLLM environment (build it: bash .ci/engine-env vllm)"}
    return cost_server.run(
        "vllm",
        _launch,
        lambda port, prompt, n: vllm.complete(port, prompt, n),
        b'"choices"',
        quick=quick,
    )
