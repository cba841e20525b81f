"""Shared by the vLLM helper scripts (run inside the vLLM env): a tiny random-weight model
from a local config.json (no hub access) and the environment vLLM needs on this CPU host."""

from __future__ import annotations

import json
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Llama with CPU-attention-friendly shapes: head_dim 32, block size 32 (a multiple of 32).
TINY_LLAMA = {
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


def write_model(directory: str | os.PathLike[str], **over: object) -> str:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**TINY_LLAMA, **over}))
    return str(d)


def engine_env(cache_root: str | None = None) -> dict[str, str]:
    """Environment for a vLLM process here: offline, CPU, small KV space, our connector."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    if cache_root:
        env["VLLM_CACHE_ROOT"] = cache_root
    return env
