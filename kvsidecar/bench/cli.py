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
@click.option("--seconds", type=float, default=None, help="Duration (default 60, quick 2).")
@click.option("--readers", type=int, default=2, show_default=True)
def torn_cmd(quick: bool, out: str, seconds: float | None, readers: int) -> None:
    """Full-speed writer vs reader processes: reads, retries, torn accepted."""
    from kvsidecar.bench import torn

    secs = seconds if seconds is not None else (2.0 if quick else 60.0)
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
    from kvsidecar.agent import bench_agent

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
