"""Demo engine settings (no torch here: the P/D launcher and the CLI import this)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsidecar.agent.demo.workload import WorkloadConfig

ENGINE_NAME = "demo"


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_mlp: int = 256
    max_pos: int = 1024
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def name(self) -> str:
        return f"tiny-paged-lm-{self.n_layers}l-{self.d_model}d"


@dataclass
class Options:
    """Everything a demo engine process needs (picklable: passed to spawned P/D workers)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    num_blocks: int = 64
    block_size: int = 16
    max_batch: int = 16
    prefill_tokens: int = 256  # prompt tokens prefilled per step at most
    step_ms: float = 0.0  # pad busy steps to this duration (a GPU-like pace, less CPU)
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str = "float64"
    threads: int = 1  # torch intra-op threads per engine process
    shm_dir: str | None = None  # None: the agent's default (KVSIDECAR_SHM_DIR or /dev/shm)
    engine_name: str = ENGINE_NAME
    transfer_delay: float = 0.0  # P/D: seconds decode waits before pulling a request's K/V
    exit_when_done: bool = False  # exit once arrivals stopped and every request finished
    out: str | None = None  # JSONL record of finished requests (and K/V digests in P/D)
    report_interval: float = 0.0  # seconds between status lines on stderr (0 = none)
    corrupt_transfer: bool = False  # test hook: decode zeroes the pulled K/V
