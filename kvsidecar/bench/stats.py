"""Ratios between benchmark conditions that hold on a noisy host: rounds, then a bootstrap.

Every benchmark that compares conditions (observer, agent idle/big, scaling, vLLM) runs
them interleaved in *rounds*, so host noise hits each alike, and keeps every round's
samples apart. A ratio is then computed per round (condition vs the baseline measured in
the same round: a paired comparison), and its uncertainty comes from a percentile
bootstrap over rounds: resample the rounds with replacement, take the geometric mean of
their ratios, repeat. The 95 % interval says how far the figure could move on another
run of the same host; a target is "met" only when the interval's upper bound is under it,
so one lucky run cannot confirm a claim the next one refutes.

Pure Python (no numpy): a few dozen rounds and 10,000 resamples take milliseconds.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvsidecar.bench.report import percentile

BOOTSTRAP_RESAMPLES = 10_000


def p99(samples: Sequence[float]) -> float:
    return percentile(samples, 99)


def p50(samples: Sequence[float]) -> float:
    return percentile(samples, 50)


def round_ratios(
    rounds: Sequence[Mapping[str, Sequence[float]]],
    condition: str,
    baseline: str,
    statistic: Callable[[Sequence[float]], float] = p99,
) -> list[float]:
    """statistic(condition) / statistic(baseline), one ratio per round (same-round pairs)."""
    out = []
    for r in rounds:
        base = statistic(r[baseline])
        out.append(statistic(r[condition]) / base if base > 0 else float("nan"))
    return out


def geometric_mean(values: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def bootstrap_interval(
    ratios: Sequence[float],
    *,
    confidence: float = 0.95,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile-bootstrap interval of the geometric mean of per-round ratios."""
    good = [r for r in ratios if r > 0 and math.isfinite(r)]
    if not good:
        return (float("nan"), float("nan"))
    if len(good) == 1:
        return (good[0], good[0])
    rng = random.Random(seed)
    logs = [math.log(r) for r in good]
    n = len(logs)
    means = sorted(math.exp(sum(rng.choices(logs, k=n)) / n) for _ in range(resamples))
    return _tails(means, confidence)


def _tails(sorted_means: Sequence[float], confidence: float) -> tuple[float, float]:
    k, tail = len(sorted_means), (1 - confidence) / 2
    return (sorted_means[min(k - 1, int(tail * k))], sorted_means[min(k - 1, int((1 - tail) * k))])


def compare(
    rounds: Sequence[Mapping[str, Sequence[float]]],
    condition: str,
    baseline: str,
    *,
    target: float | None = None,
    statistic: Callable[[Sequence[float]], float] = p99,
) -> dict[str, Any]:
    """Per-round ratios (min/median/max), their geometric mean, its 95 % interval, verdict.

    ``met`` is True only when the interval's upper bound is <= target (None: no target).
    """
    ratios = round_ratios(rounds, condition, baseline, statistic)
    finite = [r for r in ratios if math.isfinite(r) and r > 0]
    lo, hi = bootstrap_interval(finite)
    return {
        "rounds": len(ratios),
        "ratios": ratios,
        "min": min(finite) if finite else float("nan"),
        "median": statistics.median(finite) if finite else float("nan"),
        "max": max(finite) if finite else float("nan"),
        "geomean": geometric_mean(finite) if finite else float("nan"),
        "ci95": [lo, hi],
        "target": target,
        "met": None if target is None else bool(hi <= target),
    }


def verdict(cmp: Mapping[str, Any]) -> str:
    """'met' / 'NOT met' / '-' for a `compare` result, for tables."""
    if cmp.get("met") is None:
        return "-"
    return "met" if cmp["met"] else "NOT met"


def mean_interval(
    values: Sequence[float],
    *,
    confidence: float = 0.95,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> dict[str, Any]:
    """Mean of per-round *differences* (which may be negative or zero, unlike ratios) and
    its percentile-bootstrap interval over rounds."""
    good = [v for v in values if math.isfinite(v)]
    if not good:
        return {"rounds": 0, "mean": float("nan"), "ci95": [float("nan"), float("nan")]}
    rng = random.Random(seed)
    n = len(good)
    means = sorted(sum(rng.choices(good, k=n)) / n for _ in range(resamples))
    lo, hi = _tails(means, confidence)
    return {"rounds": n, "values": good, "mean": statistics.fmean(good), "ci95": [lo, hi]}
