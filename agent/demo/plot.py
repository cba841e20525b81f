"""Plot a bounded P/D demo run: deferred blocks and pool usage, from the daemon's JSON API.

``python -m kvsidecar.agent.demo.plot --out docs/img/pd-deferred.png`` runs
``kvsidecar demo --pd`` with arrivals that stop part-way, polls ``/api/v1/snapshots`` every
100 ms and plots each rank's pool. Needs matplotlib (the ``dev`` extra); no torch in this
process (the demo's engines load it).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

Series = dict[str, list[float]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll(
    url: str, proc: subprocess.Popen, interval: float, duration: float = float("inf")
) -> dict[str, Series]:
    """role -> field -> samples, until the demo exits or `duration` seconds after the
    engines are up (both ranks publishing: their start-up, seconds of torch import on a
    slow host, never eats into the run). ``t``: wall-clock seconds; ``start``: the engine's
    start (its agent's start_time, when its arrivals start too)."""
    data: dict[str, Series] = defaultdict(lambda: defaultdict(list))
    up_at: float | None = None
    while proc.poll() is None:
        if up_at is None and {"prefill", "decode"} <= data.keys():
            up_at = time.monotonic()
        if up_at is not None and time.monotonic() - up_at >= duration:
            break
        tick = time.monotonic()
        now = time.time()
        try:
            with urllib.request.urlopen(url + "/api/v1/snapshots", timeout=1) as r:
                targets = json.load(r)["targets"]
        except (OSError, ValueError):
            targets = []
        for tgt in targets:
            snap = tgt.get("snapshot")
            if snap is None or not snap["pools"]:
                continue
            rt, pool = snap["runtime"], snap["pools"][0]
            s = data[rt["role"]]
            s["t"].append(now)
            s["start"] = [rt["start_time"]]
            for key in (
                "allocated_blocks",
                "deferred_free_blocks",
                "cached_blocks",
                "total_blocks",
                "deferred_free_requests",
            ):
                s[key].append(pool[key])
            for key in ("requests_running", "requests_waiting"):
                s[key].append(rt[key])
        time.sleep(max(0.0, interval - (time.monotonic() - tick)))
    return data


def plot(data: dict[str, Series], out: str, title: str, arrivals_stop: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles = [r for r in ("prefill", "decode", "both") if r in data]
    t0 = min(data[r]["start"][0] for r in roles)  # x = 0: the first engine started
    fig, axes = plt.subplots(
        len(roles), 1, figsize=(11, 3.0 * len(roles)), sharex=True, squeeze=False
    )
    for ax, role in zip(axes[:, 0], roles):
        s = data[role]
        t = [x - t0 for x in s["t"]]
        ax.fill_between(
            t,
            s["deferred_free_blocks"],
            step="post",
            color="tab:red",
            alpha=0.35,
            label="deferred-free blocks\n(held until the KV is pulled)",
        )
        ax.step(t, s["allocated_blocks"], where="post", color="tab:blue", label="allocated blocks")
        ax.step(
            t,
            s["cached_blocks"],
            where="post",
            color="tab:green",
            linestyle=":",
            label="cached blocks\n(prefix cache, evictable)",
        )
        ax.step(
            t,
            s["total_blocks"],
            where="post",
            color="black",
            linewidth=0.8,
            linestyle="--",
            label="total blocks",
        )
        if arrivals_stop:
            ax.axvline(arrivals_stop, color="grey", linewidth=0.8)
        ax.set_ylim(0, max(s["total_blocks"]) * 1.08)
        ax.set_ylabel("blocks")
        if role == "decode":
            label = "decode rank: pulled K/V is written into these blocks"
        else:
            label = (
                f"{role} rank: up to {max(s['deferred_free_requests'])} finished requests "
                f"({max(s['deferred_free_blocks'])} blocks) waiting for their pull"
            )
        ax.set_title(label, fontsize=10, loc="left")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if arrivals_stop:
        # Inside the top panel, in the band above its total-blocks line (the y limit is 8 %
        # over it): above the panel it ran across the panel's title.
        axes[0, 0].text(
            arrivals_stop,
            0.99,
            " arrivals stop",
            transform=axes[0, 0].get_xaxis_transform(),
            va="top",
            fontsize=8,
            color="grey",
        )
    axes[-1, 0].set_xlabel("seconds")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvsidecar.agent.demo.plot", description=__doc__)
    p.add_argument("--out", default="docs/img/pd-deferred.png")
    p.add_argument("--rate", type=float, default=8.0)
    p.add_argument("--transfer-delay", type=float, default=1.0)
    p.add_argument("--arrivals", type=float, default=10.0, help="seconds of arrivals")
    p.add_argument(
        "--duration", type=float, default=16.0, help="seconds of the run, once the engines are up"
    )
    p.add_argument("--interval", type=float, default=0.1, help="seconds between polls")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # `make run` alone does not install it
        print(
            "python -m kvsidecar.agent.demo.plot: matplotlib is not installed: run `make venv` "
            "(the dev extra) first",
            file=sys.stderr,
        )
        return 2

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "kvsidecar",
        "demo",
        "--pd",
        "--rate",
        str(args.rate),
        "--transfer-delay",
        str(args.transfer_delay),
        "--seed",
        str(args.seed),
        "--stop-arrivals-after",
        str(args.arrivals),
        "--web.listen-address",
        f"127.0.0.1:{port}",
        "--poll-interval",
        "0.05",
        "--report-interval",
        "0",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # before a minute-long run
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        data = poll(url, proc, args.interval, args.duration)
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait()
    if not data:
        print("no samples: did the demo start?", file=sys.stderr)
        return 1
    title = (
        f"kvsidecar demo --pd: {args.rate:g} req/s, transfer delay {args.transfer_delay:g}"
        f" s, {args.interval * 1000:.0f} ms samples of /api/v1/snapshots"
    )
    plot(data, args.out, title, args.arrivals)
    for role, s in data.items():
        print(
            f"{role}: {len(s['t'])} samples, peak allocated {max(s['allocated_blocks'])}"
            f"/{s['total_blocks'][-1]}, peak deferred {max(s['deferred_free_blocks'])} "
            f"blocks / {max(s['deferred_free_requests'])} requests, final allocated "
            f"{s['allocated_blocks'][-1]}, final deferred {s['deferred_free_blocks'][-1]}"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
