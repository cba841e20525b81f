"""Synthetic requests: Poisson arrivals, prompts sharing a few "system prompt" prefixes.

A request's content (prefix, suffix, length to generate) depends only on the seed and its
index, never on timing or rate, so two runs with the same seed (single process vs P/D pair)
serve the same requests and, with greedy decoding, must generate the same tokens.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field


@dataclass
class Request:
    req_id: str
    prompt: list[int]
    max_new: int
    arrival: float  # time.monotonic() of arrival
    output: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens found in this engine's prefix cache
    first_token_at: float | None = None

    @property
    def final_tokens(self) -> int:
        """Tokens that will have K/V when done (the last generated one is never fed)."""
        return len(self.prompt) + self.max_new - 1


@dataclass(frozen=True)
class WorkloadConfig:
    seed: int = 0
    rate: float = 20.0  # mean arrivals per second
    vocab: int = 256
    num_prefixes: int = 4
    prefix_len: tuple[int, int] = (32, 64)
    suffix_len: tuple[int, int] = (4, 48)
    max_new: tuple[int, int] = (16, 96)
    max_requests: int = 0  # 0 = no limit
    stop_arrivals_after: float = 0.0  # seconds; 0 = never


class Workload:
    """Hands out requests as their (Poisson) arrival times pass."""

    def __init__(self, cfg: WorkloadConfig, start: float | None = None) -> None:
        self.cfg = cfg
        rng = random.Random(f"prefixes:{cfg.seed}")
        self.prefixes = [
            [rng.randrange(cfg.vocab) for _ in range(rng.randint(*cfg.prefix_len))]
            for _ in range(cfg.num_prefixes)
        ]
        self._gaps = random.Random(f"arrivals:{cfg.seed}")
        self.start = time.monotonic() if start is None else start
        self.issued = 0
        self._next_at = self.start + self._gap()

    def _gap(self) -> float:
        return self._gaps.expovariate(self.cfg.rate) if self.cfg.rate > 0 else float("inf")

    def make(self, i: int, arrival: float = 0.0) -> Request:
        """Request number i (deterministic in seed and i)."""
        cfg = self.cfg
        rng = random.Random(f"request:{cfg.seed}:{i}")
        prefix = self.prefixes[rng.randrange(len(self.prefixes))]
        suffix = [rng.randrange(cfg.vocab) for _ in range(rng.randint(*cfg.suffix_len))]
        return Request(f"req-{i}", prefix + suffix, rng.randint(*cfg.max_new), arrival)

    @property
    def exhausted(self) -> bool:
        """No request will arrive any more."""
        cfg = self.cfg
        if cfg.max_requests and self.issued >= cfg.max_requests:
            return True
        return bool(cfg.stop_arrivals_after) and (
            self._next_at > self.start + cfg.stop_arrivals_after
        )

    def next_arrival(self) -> float:
        return float("inf") if self.exhausted else self._next_at

    def poll(self, now: float) -> list[Request]:
        out = []
        while not self.exhausted and self._next_at <= now:
            out.append(self.make(self.issued, self._next_at))
            self.issued += 1
            self._next_at += self._gap()
        return out
