"""``python -m kvsidecar.agent.demo``: one demo engine, or (``--pd``) a prefill/decode pair.

Each engine publishes through a `KVSidecarAgent` into ``--shm-dir``; point ``kvsidecar serve``
or ``kvsidecar dump`` at the same directory. ``kvsidecar demo`` runs this plus the daemon.
"""

from __future__ import annotations

import argparse
import sys

from kvsidecar.agent.demo.options import ENGINE_NAME, ModelConfig, Options
from kvsidecar.agent.demo.procutil import install_stop_handlers
from kvsidecar.agent.demo.workload import WorkloadConfig


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 0 < LO <= HI, got {text!r}")
    return a, b


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvsidecar.agent.demo",
        description="A tiny paged-attention LLM engine publishing its KV pool to kvsidecar.",
    )
    w = WorkloadConfig()
    o = Options()
    m = ModelConfig()
    p.add_argument("--pd", action="store_true", help="run a prefill and a decode process")
    p.add_argument("--rate", type=float, default=w.rate, help="mean arrivals/s (Poisson)")
    p.add_argument(
        "--transfer-delay",
        type=float,
        default=0.0,
        metavar="SEC",
        help="P/D: decode waits this long before pulling a request's K/V",
    )
    p.add_argument(
        "--max-requests",
        type=int,
        default=0,
        metavar="N",
        help="stop arrivals after N requests (0 = never)",
    )
    p.add_argument(
        "--stop-arrivals-after",
        type=float,
        default=0.0,
        metavar="SEC",
        help="stop arrivals after SEC seconds (0 = never)",
    )
    p.add_argument(
        "--exit-when-done",
        action="store_true",
        help="exit once arrivals stopped and every request finished",
    )
    p.add_argument("--seed", type=int, default=0, help="model weights and requests")
    p.add_argument("--shm-dir", default=None, help="segment directory (default: the agent's)")
    p.add_argument("--engine-name", default=ENGINE_NAME)
    p.add_argument("--num-blocks", type=int, default=o.num_blocks, help="KV blocks per pool")
    p.add_argument("--block-size", type=int, default=o.block_size, help="tokens per block")
    p.add_argument("--max-batch", type=int, default=o.max_batch, help="running requests at most")
    p.add_argument("--prefix-len", type=_range, default=w.prefix_len, metavar="LO:HI")
    p.add_argument("--suffix-len", type=_range, default=w.suffix_len, metavar="LO:HI")
    p.add_argument(
        "--max-new",
        type=_range,
        default=w.max_new,
        metavar="LO:HI",
        help="tokens generated per request",
    )
    p.add_argument(
        "--num-prefixes", type=int, default=w.num_prefixes, help="distinct shared system prompts"
    )
    p.add_argument("--layers", type=int, default=m.n_layers)
    p.add_argument("--d-model", type=int, default=m.d_model)
    p.add_argument("--heads", type=int, default=m.n_heads)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument(
        "--dtype", default=o.dtype, choices=["float64", "float32", "float16", "bfloat16"]
    )
    p.add_argument(
        "--step-ms",
        type=float,
        default=o.step_ms,
        metavar="MS",
        help="pad each busy step to MS milliseconds (GPU-like pace, less CPU)",
    )
    p.add_argument("--threads", type=int, default=o.threads, help="torch threads per engine")
    p.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="append one JSON line per finished request (and per K/V pull)",
    )
    p.add_argument(
        "--report-interval",
        type=float,
        default=0.0,
        metavar="SEC",
        help="status line on stderr every SEC seconds (0 = none)",
    )
    p.add_argument("--corrupt-transfer", action="store_true", help=argparse.SUPPRESS)
    return p


def options(ns: argparse.Namespace) -> Options:
    return Options(
        model=ModelConfig(n_layers=ns.layers, d_model=ns.d_model, n_heads=ns.heads, seed=ns.seed),
        workload=WorkloadConfig(
            seed=ns.seed,
            rate=ns.rate,
            num_prefixes=ns.num_prefixes,
            prefix_len=ns.prefix_len,
            suffix_len=ns.suffix_len,
            max_new=ns.max_new,
            max_requests=ns.max_requests,
            stop_arrivals_after=ns.stop_arrivals_after,
        ),
        num_blocks=ns.num_blocks,
        block_size=ns.block_size,
        max_batch=ns.max_batch,
        step_ms=ns.step_ms,
        device=ns.device,
        dtype=ns.dtype,
        threads=ns.threads,
        shm_dir=ns.shm_dir,
        engine_name=ns.engine_name,
        transfer_delay=ns.transfer_delay,
        exit_when_done=ns.exit_when_done,
        out=ns.out,
        report_interval=ns.report_interval,
        corrupt_transfer=ns.corrupt_transfer,
    )


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    opts = options(ns)
    if ns.pd:
        from kvsidecar.agent.demo.launch import run_pd

        return run_pd(opts)
    stop = install_stop_handlers()  # before the torch import: a Ctrl-C then exits cleanly
    from kvsidecar.agent.demo.engine import run_single

    return run_single(opts, stop)


if __name__ == "__main__":
    sys.exit(main())
