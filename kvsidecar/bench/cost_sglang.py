"""``bench cost --sglang``: what a scrape costs the real SGLang server, and what it does to
SGLang's health checks (sglang #28157).

A real SGLang 0.5.23 server on CPU (`kvsidecar.bench.sglang`: its own Scheduler, radix cache,
HTTP server and /metrics; the test-only ``sgl_kernel`` stand-in from the checkout) with
kvsidecar's plugin, answering the same fixed ``/generate`` requests every round (the vLLM
benchmark's 64-token prompts, ``max_new_tokens``, ``ignore_eos``, 4 at a time); conditions,
controls and pairing: `kvsidecar.bench.cost_server`. Through every round a
`health_probe.HealthProber` fetches ``/health`` at 20 Hz (answered by the event loop alone:
see `_launch`) and ``/health_generate`` back to back (SGLang's default health check), so the
health latencies of every condition come from the same interleaved rounds.

SGLang's launcher process is its API server (HTTP, tokenizer manager, and the
``/metrics`` render), so the first-process CPU column is the API server's, as for vLLM.
"""

from __future__ import annotations

from typing import Any

from kvsidecar.bench import cost_server, sglang

MAX_TOTAL_TOKENS = 8192  # the workload's 4 x (64 + 32) tokens never retract or wait on KV


def _launch(tmp: str, shm: str, port: int, model: str) -> tuple[list[str], dict[str, str]]:
    python = sglang.sglang_python()
    assert python is not None  # run() checked
    # SGLang 0.5.23's /health is /health_generate by default: a 1-token generation whose
    # answer waits on a 1 s poll. With generation off (a documented SGLang setting) /health
    # is answered by the API server's event loop alone, the loop that renders /metrics: the
    # prober times that at 20 Hz, and the default check's path as /health_generate.
    env = sglang.server_env(shm, SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION="0")
    return sglang.server_command(python, model, port, MAX_TOTAL_TOKENS), env


def run(quick: bool = False) -> dict[str, Any]:
    try:
        python = sglang.sglang_python()
    except RuntimeError as e:  # the env runs another checkout: say so
        return {"skipped": str(e)}
    if python is None:
        return {
            "skipped": "no SGLang environment or no checkout stand-in "
            "(build it: bash .ci/engine-env sglang, from a checkout)"
        }
    return cost_server.run(
        "sglang",
        _launch,
        lambda port, prompt, n: sglang.generate_request(port, [prompt], n),
        b'"output_ids"',
        quick=quick,
        probe_health=True,
        start_timeout=420,
        requests=48,  # rounds of ~8 s: several /health_generate answers (>= 1 s each) per round
    )
