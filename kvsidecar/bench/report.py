"""Shared benchmark plumbing: timing statistics, tables, JSON results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import click


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summarize(samples_ns: Sequence[float]) -> dict[str, float]:
    return {
        "n": len(samples_ns),
        "median_ns": statistics.median(samples_ns) if samples_ns else float("nan"),
        "p99_ns": percentile(samples_ns, 99),
        "max_ns": max(samples_ns) if samples_ns else float("nan"),
    }


def timer_overhead_ns(rounds: int = 20000) -> float:
    """Median cost of an empty perf_counter_ns pair, subtracted from per-call timings."""
    clock = time.perf_counter_ns
    samples = []
    for _ in range(rounds):
        t0 = clock()
        samples.append(clock() - t0)
    return statistics.median(samples)


def time_calls(fn: Callable[[], object], n: int, overhead_ns: float) -> list[float]:
    """Time each of n calls individually (so p99 sees the spikes), minus timer overhead."""
    clock = time.perf_counter_ns
    out = [0.0] * n
    for i in range(n):
        t0 = clock()
        fn()
        out[i] = max(0.0, clock() - t0 - overhead_ns)
    return out


def host_description() -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": model or platform.processor(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "kernel": platform.release(),
    }


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    click.echo(f"\n{title}")
    click.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    click.echo("  ".join("-" * w for w in widths))
    for r in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def write_json(out_dir: str | None, name: str, result: dict[str, Any]) -> str | None:
    if not out_dir:
        return None
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    payload = {"benchmark": name, "host": host_description(), "time": time.time(), **result}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
    return path
