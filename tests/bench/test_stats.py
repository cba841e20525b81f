"""The comparison method every benchmark uses: paired per-round ratios + bootstrap interval."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.bench import stats


def _rounds(n: int, slowdown: float, noise: float, seed: int = 0) -> list[dict[str, list[float]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        drift = rng.uniform(0.5, 2.0)  # the whole host gets slower or faster per round
        base = [drift * (1 + noise * rng.random()) for _ in range(200)]
        cond = [drift * slowdown * (1 + noise * rng.random()) for _ in range(200)]
        out.append({"none": base, "cond": cond})
    return out


def test_identical_conditions_meet_a_tight_target_despite_round_drift() -> None:
    rounds = [{"none": [1.0, 2.0, 3.0] * 50, "cond": [1.0, 2.0, 3.0] * 50} for _ in range(8)]
    cmp = stats.compare(rounds, "cond", "none", target=1.05)
    assert cmp["ci95"] == [1.0, 1.0]
    assert cmp["met"] is True


def test_a_real_slowdown_is_not_met_and_the_interval_brackets_it() -> None:
    cmp = stats.compare(_rounds(12, 1.3, 0.05), "cond", "none", target=1.05)
    lo, hi = cmp["ci95"]
    assert 1.2 < lo <= cmp["geomean"] <= hi < 1.4
    assert cmp["met"] is False
    assert cmp["min"] <= cmp["median"] <= cmp["max"]


def test_round_drift_cancels_because_ratios_are_paired_within_a_round() -> None:
    # Pooled p99s would mix the slow and fast rounds; paired ratios stay near 1.
    cmp = stats.compare(_rounds(12, 1.0, 0.02, seed=3), "cond", "none", target=1.05)
    assert cmp["ci95"][1] <= 1.05
    assert cmp["met"] is True


def test_an_upper_bound_above_target_is_not_met_even_when_the_median_is_under() -> None:
    # Ratios around 1.0 but wildly spread: one run's median is not a proof.
    ratios_rounds = []
    for r in (0.7, 1.6, 0.8, 1.5, 1.0, 0.9):
        ratios_rounds.append({"none": [1.0] * 100, "cond": [r] * 100})
    cmp = stats.compare(ratios_rounds, "cond", "none", target=1.05)
    assert cmp["median"] < 1.05
    assert cmp["ci95"][1] > 1.05
    assert cmp["met"] is False


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.2, 5.0), min_size=2, max_size=30), st.integers(0, 2**16))
def test_interval_lies_within_the_rounds_and_is_reproducible(
    ratios: list[float], seed: int
) -> None:
    lo, hi = stats.bootstrap_interval(ratios, resamples=500, seed=seed)
    tol = 1e-9
    assert min(ratios) - tol <= lo <= hi <= max(ratios) + tol
    assert math.isfinite(stats.geometric_mean(ratios))
    assert stats.bootstrap_interval(ratios, resamples=500, seed=seed) == (lo, hi)


def test_mean_interval_takes_differences_of_any_sign() -> None:
    # Per-round deltas (bench cost) can be zero or negative; ratios' log would fail there.
    r = stats.mean_interval([-1.0, 0.0, 1.0, 2.0])
    assert r["mean"] == 0.5 and r["rounds"] == 4
    lo, hi = r["ci95"]
    assert -1.0 <= lo < 0.5 < hi <= 2.0
    assert stats.mean_interval([3.0] * 5)["ci95"] == [3.0, 3.0]
    assert stats.mean_interval([float("nan")])["rounds"] == 0
