"""Shared by the vLLM helper scripts (run inside the vLLM env): the tiny model and the
environment, from kvsidecar.bench.vllm (pure Python, no vLLM import)."""

from kvsidecar.bench.vllm import TINY_LLAMA, engine_env, llm_kwargs, write_model

__all__ = ["TINY_LLAMA", "engine_env", "llm_kwargs", "write_model"]
