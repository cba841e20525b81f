"""TEST-ONLY stand-in for SGLang's CPU kernel package ``sgl_kernel`` (never shipped).

What it replaces: ``assign_req_to_token_pool_cpu``, the one function SGLang 0.5.23's CPU path
calls without an AMX gate (``sglang/srt/mem_cache/allocation.py`` imports it when running on
CPU). Why: no CPU build of ``sgl_kernel`` is published (``sgl-kernel``/``sglang-kernel`` on
PyPI are CUDA-only; see shared/research/sglang-cpu.md), so a real SGLang server cannot start
on our CPU hosts without it. This is our own few lines of torch doing what SGLang's Triton
``assign_req_to_token_pool`` does. Every other name raises NotImplementedError, so a call we
did not expect fails loudly instead of computing something wrong (it can be imported, as SGLang
imports ``copy_all_layer_kv_cache_cpu`` at module level, but not called).

Put on the server's PYTHONPATH only by tests/engines/test_sglang_server.py and the dev command
in docs/sglang.md. If a real CPU ``sgl_kernel`` is importable the tests fail (see
``tests/engines/sglang_server.py``), so this file cannot silently outlive its reason.
"""

from __future__ import annotations

from typing import Any

STANDIN = True  # how the tests tell this module from a real sgl_kernel


def assign_req_to_token_pool_cpu(
    req_pool_indices: Any,
    req_to_token: Any,
    start_offset: Any,
    end_offset: Any,
    out_cache_loc: Any,
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th slice of out_cache_loc."""
    del pool_len  # implied by req_to_token's row length
    out = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[out : out + n]
        out += n


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{name}: not in kvsidecar's test-only stand-in")

    missing.__name__ = name
    return missing
