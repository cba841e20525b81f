"""Plots for docs/benchmarks.md from the JSON that ``kvsidecar bench`` writes.

``python -m kvsidecar.bench.plot [RESULTS_DIR] [OUT_DIR]`` (defaults:
bench-results, docs/img). Needs matplotlib (the ``dev`` extra); each plot is
skipped when its JSON is missing.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _load(results: str, name: str) -> dict[str, Any] | None:
    path = os.path.join(results, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def main(results: str = "bench-results", out: str = "docs/img") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    made = []

    if (obs := _load(results, "observer")) is not None:
        layouts = obs["layouts"]
        conds = [c for c in next(iter(layouts.values()))["conditions"] if c != "none"]
        fig, ax = plt.subplots(figsize=(7, 3.6))
        width = 0.8 / len(layouts)
        for k, (layout, res) in enumerate(layouts.items()):
            cmps = [res["conditions"][c]["p99_vs_none"] for c in conds]
            xs = [i - 0.4 + width * (k + 0.5) for i in range(len(conds))]
            mid = [c["geomean"] for c in cmps]
            err = [
                [m - c["ci95"][0] for m, c in zip(mid, cmps)],
                [c["ci95"][1] - m for m, c in zip(mid, cmps)],
            ]
            ax.bar(xs, mid, width, yerr=err, capsize=3, label=f"{layout} cores")
        ax.axhline(1.05, color="k", ls="--", lw=1, label="target 1.05x (kvsidecar p99)")
        ax.set_xticks(list(range(len(conds))), conds)
        ax.set_ylabel("p99 step time / none (95% CI)")
        ax.set_title("Observer effect on an engine loop (scrapes at 20 Hz)")
        ax.legend(fontsize=8)
        made.append(_save(fig, out, "observer.png"))

    if (sc := _load(results, "scaling")) is not None:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.2))
        size = [p for p in sc["points"] if p["deferred_requests"] == 0]
        dfr = [p for p in sc["points"] if p["deferred_requests"] > 0]
        a1.plot([p["blocks"] for p in size], [p["median_ns"] / 1e3 for p in size], "o-")
        a1.set_xscale("log")
        a1.set_xlabel("pool blocks")
        a1.set_ylabel("agent step median (us)")
        a1.set_ylim(0, None)
        a2.plot([p["deferred_requests"] for p in dfr], [p["median_ns"] / 1e3 for p in dfr], "o-")
        a2.set_xscale("log")
        a2.set_xlabel("deferred requests")
        a2.set_ylim(0, None)
        fig.suptitle("Publish cost is O(1) in pool size and deferred requests")
        made.append(_save(fig, out, "scaling.png"))

    if (sp := _load(results, "scrape")) is not None:
        fig, ax = plt.subplots(figsize=(7, 3.4))
        runs = [r for r in sp["runs"] if r["gzip"]]
        labels = [f"{r['mode'].split()[0]}\n{r['clients']} cl" for r in runs]
        ax.bar(range(len(runs)), [r["p99_ms"] for r in runs], label="p99 ms")
        ax.axhline(10, color="k", ls="--", lw=1, label="target p99 10 ms")
        for i, r in enumerate(runs):
            ax.annotate(
                f"{r['scrapes_per_s']:,.0f}/s",
                (i, r["p99_ms"]),
                ha="center",
                va="bottom",
                fontsize=7,
            )
        ax.set_xticks(range(len(runs)), labels, fontsize=8)
        ax.set_ylabel("p99 latency (ms)")
        ax.set_title("/metrics, 8 ranks x 4 pools (gzip): p99 and scrapes/s")
        ax.legend(fontsize=8)
        made.append(_save(fig, out, "scrape.png"))

    if (soak := _load(results, "soak")) is not None and soak.get("rss_series"):
        fig, ax = plt.subplots(figsize=(7, 3))
        t, rss = zip(*soak["rss_series"])
        ax.plot(t, rss)
        ax.set_xlabel("seconds")
        ax.set_ylabel("daemon RSS (MB)")
        ax.set_ylim(0, max(rss) * 1.2)
        ax.set_title(f"Soak: writer 1 kHz, scrapes 20 Hz, {soak['errors']} errors")
        made.append(_save(fig, out, "soak.png"))
    return made


def _save(fig: Any, out: str, name: str) -> str:
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":  # pragma: no cover
    for p in main(*sys.argv[1:3]):
        print(p)
