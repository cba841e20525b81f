"""Start a real SGLang 0.5.23 server on CPU from its own environment, for the server tests
and ``kvsidecar bench cost --sglang``. Nothing here imports SGLang or torch: the server is a
subprocess of the SGLang env's Python (``.engine-envs/sglang``, ``bash .ci/engine-env sglang``).

The server runs SGLang's own Scheduler, token allocator, radix cache, HTTP server and /metrics;
the one thing not SGLang's is ``sgl_kernel``, replaced by the test-only stand-in in
``tests/engines/sglang_helpers/kernel_standin`` (no CPU build of it is published). It lives in
the checkout's tests, never in the wheel: from an installed kvsidecar there is no stand-in,
and the SGLang paths of the benchmarks say so instead of running. Flags:
shared/research/sglang-cpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import urllib.request
from pathlib import Path
from typing import Any

from kvsidecar import settings
from kvsidecar.bench import engine_envs

REPO = Path(__file__).resolve().parents[2]
STANDIN = REPO / "tests" / "engines" / "sglang_helpers" / "kernel_standin"
MODEL = "tiny"


def sglang_python() -> Path | None:
    """The SGLang env's Python, or None when it (or the checkout's stand-in) is missing;
    RuntimeError (with the fix) when the env runs another checkout's kvsidecar."""
    override = settings.SGLANG_PYTHON.get(os.environ)
    python = Path(override) if override else REPO / ".engine-envs" / "sglang" / "bin" / "python"
    if not python.exists() or not STANDIN.is_dir():
        return None
    if (problem := engine_envs.wrong_checkout("sglang", python, REPO)) is not None:
        raise RuntimeError(problem)
    return python


def server_env(shm: str | os.PathLike[str], **extra: str) -> dict[str, str]:
    return {
        "SGLANG_USE_CPU_ENGINE": "1",  # else the scheduler imports vLLM's rotary kernel
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": str(STANDIN),
        settings.SHM_DIR.name: str(shm),
        **extra,
    }


def server_command(
    python: str | os.PathLike[str],
    model_dir: str,
    port: int,
    max_total_tokens: int,
    max_running_requests: int = 4,
) -> list[str]:
    return [
        str(python), "-m", "sglang.launch_server",
        "--model-path", model_dir, "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--load-format", "dummy", "--skip-tokenizer-init",
        "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
        "--disable-overlap-schedule", "--disable-cuda-graph", "--grammar-backend", "none",
        "--dtype", "float32", "--page-size", "1",
        "--max-total-tokens", str(max_total_tokens),
        "--max-running-requests", str(max_running_requests),
        "--enable-metrics",
    ]  # fmt: skip


def generate_request(
    port: int, prompts: list[list[int]], max_new_tokens: int, **extra: Any
) -> urllib.request.Request:
    """SGLang's native ``/generate`` with token ids (the server has no tokenizer)."""
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
        **extra,
    }
    return urllib.request.Request(
        f"http://127.0.0.1:{port}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )


def generate(port: int, prompts: list[list[int]], max_new_tokens: int, **extra: Any) -> Any:
    req = generate_request(port, prompts, max_new_tokens, **extra)
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main(argv: list[str]) -> None:
    """``python -m kvsidecar.bench.sglang --workdir W --shm-dir S --port P``: write the tiny
    model's config to W/model and become the server the tests run (deploy/sglang/run.sh).
    Run it as the SGLang env's Python through this checkout's link
    (``.engine-envs/sglang/bin/python``): the server's plugin then runs this checkout."""
    from kvsidecar.bench.vllm import write_model  # the same tiny Llama config

    parser = argparse.ArgumentParser(prog="python -m kvsidecar.bench.sglang")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--shm-dir", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-total-tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    if not STANDIN.is_dir():
        parser.exit(2, f"{parser.prog}: no sgl_kernel stand-in at {STANDIN}: run it from a "
                    "checkout (the stand-in is in tests/, not in the wheel)\n")  # fmt: skip
    model = write_model(Path(args.workdir) / "model")
    cmd = server_command(sys.executable, model, args.port, args.max_total_tokens)
    env = server_env(args.shm_dir)
    print("+", " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
    sys.stdout.flush()
    os.chdir(args.workdir)  # not a checkout: its kvsidecar.egg-info would hide the plugin
    os.execve(cmd[0], cmd, {**os.environ, **env})


if __name__ == "__main__":
    main(sys.argv[1:])
