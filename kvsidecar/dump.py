"""``kvsidecar dump`` and ``kvsidecar ls``: look at segments without the daemon.

Both read through the daemon's own `TargetSet`, so what they show is what
``serve`` would export (same states, same freshness rule). Exit codes: 0 ok,
1 no target (or none up), 2 usage. Only data goes to stdout; diagnostics go to
stderr.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

import click
import msgspec

from kvsidecar.cli_options import EXIT_NO_TARGET, EXIT_OK, prefix_option, shm_dir_option
from kvsidecar.daemon.app import view_record
from kvsidecar.daemon.targets import UP, TargetSet, TargetView

_JSON = msgspec.json.Encoder()


def _targets(
    shm_dir: str, prefix: str, pattern: str | None, stale_after: float, allow_any_uid: bool
) -> TargetSet:
    allowed = None if allow_any_uid else frozenset({os.getuid()})
    ts = TargetSet(
        shm_dir,
        prefix=prefix if pattern is None else "",
        pattern=pattern,
        stale_after=stale_after,
        allowed_uids=allowed,
    )
    ts.poll_all()
    for name, why in sorted(ts.refused.items()):
        click.echo(f"kvsidecar: refused {name}: {why}", err=True)
    return ts


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


def render_table(views: list[TargetView], width: int = 160) -> str:
    """A top-style text table: one line per rank, one indented line per pool."""
    now = time.monotonic_ns()
    lines = [
        f"{'SEGMENT':<34} {'STATE':<9} {'AGE':>6} {'ENGINE':<14} {'ROLE':<7} {'DP/TP/PP':<8} "
        f"{'STEP':>9} {'RUN':>5} {'WAIT':>5} {'DEFER':>5}"
    ]
    for v in views:
        age = v.age_seconds(now)
        age_s = "-" if age is None else f"{age:.1f}s"
        if v.last is None:
            lines.append(f"{v.name:<34} {v.state:<9} {age_s:>6}  {v.error}"[:width])
            continue
        r = v.last.snapshot.runtime
        lines.append(
            f"{v.name[:34]:<34} {v.state:<9} {age_s:>6} {r.engine[:14]:<14} {r.role[:7]:<7} "
            f"{f'{r.dp_rank}/{r.tp_rank}/{r.pp_rank}':<8} {r.step:>9} {r.requests_running:>5} "
            f"{r.requests_waiting:>5} {r.requests_deferred_free:>5}"
        )
        if v.state != UP:
            lines.append(f"  ! {v.error} (values below are the last good snapshot)"[:width])
        lines.append(
            f"  {'POOL':<12} {'TOTAL':>8} {'ALLOC':>8} {'RESV':>6} {'AVAIL':>8} {'CACHED':>7} "
            f"{'DEFER_BLK':>9} {'USAGE':>6} {'TOKENS':>9} {'ALLOC_B':>10} {'EVICT':>8}"
        )
        for p in v.last.snapshot.pools:
            usage = p.allocated_blocks / p.total_blocks if p.total_blocks else 0.0
            lines.append(
                f"  {p.pool_name[:12]:<12} {p.total_blocks:>8} {p.allocated_blocks:>8} "
                f"{p.reserved_blocks:>6} {p.available_blocks:>8} {_n(p.cached_blocks):>7} "
                f"{_n(p.deferred_free_blocks):>9} {usage:>6.1%} {_n(p.tokens_used):>9} "
                f"{_fmt_bytes(p.allocated_bytes):>10} {_n(p.evictions_total):>8}"
            )
    return "\n".join(line[:width] for line in lines)


def _exit_code(views: list[TargetView]) -> int:
    return EXIT_OK if any(v.up for v in views) else EXIT_NO_TARGET


@click.command()
@shm_dir_option
@prefix_option
@click.option("--json", "as_json", is_flag=True, help="JSON on stdout (only JSON).")
@click.option(
    "--watch",
    "watch",
    type=float,
    default=None,
    is_flag=False,
    flag_value=1.0,
    help="Refresh every SEC seconds (default 1): a live view on a terminal, "
    "newline-delimited JSON otherwise.",
)
@click.option("--count", type=int, default=0, help="With --watch: stop after N refreshes.")
@click.option(
    "--stale-after",
    type=float,
    default=5.0,
    show_default=True,
    envvar="KVSIDECAR_STALE_AFTER",
    help="Heartbeat age that makes a writer stale.",
)
@click.option(
    "--allow-any-uid",
    is_flag=True,
    envvar="KVSIDECAR_ALLOW_ANY_UID",
    help="Read segments of any owner (default: own uid only).",
)
@click.argument("pattern", required=False)
def dump(
    shm_dir: str,
    prefix: str,
    as_json: bool,
    watch: float | None,
    count: int,
    stale_after: float,
    allow_any_uid: bool,
    pattern: str | None,
) -> None:
    """Show every segment's runtime and pools (PATTERN: a segment name or glob)."""
    ts = _targets(shm_dir, prefix, pattern, stale_after, allow_any_uid)
    try:
        if watch is None:
            views = ts.views()
            if not views:
                click.echo(
                    f"kvsidecar: no segments in {shm_dir} matching {pattern or prefix + '*'}",
                    err=True,
                )
                sys.exit(EXIT_NO_TARGET)
            _emit(views, as_json)
            sys.exit(_exit_code(views))
        _watch(ts, watch, count, as_json)
    finally:
        ts.stop()


def _emit(views: list[TargetView], as_json: bool) -> None:
    if as_json:
        now = time.monotonic_ns()
        data = _JSON.encode({"targets": [view_record(v, now) for v in views]})
        sys.stdout.buffer.write(msgspec.json.format(data) + b"\n")
    else:
        click.echo(render_table(views, shutil.get_terminal_size((160, 40)).columns))


def _watch(ts: TargetSet, interval: float, count: int, as_json: bool) -> None:
    live = sys.stdout.isatty() and not as_json
    n = 0
    try:
        while True:
            views = ts.views()
            if live:
                # Clear and redraw, like top.
                sys.stdout.write("\x1b[H\x1b[2J")
                click.echo(
                    f"kvsidecar dump --watch {interval}s   {time.strftime('%H:%M:%S')}"
                    f"   ({len(views)} segments, Ctrl-C to quit)"
                )
                click.echo(render_table(views, shutil.get_terminal_size((160, 40)).columns))
            else:
                now = time.monotonic_ns()
                line = _JSON.encode(
                    {"time": time.time(), "targets": [view_record(v, now) for v in views]}
                )
                sys.stdout.buffer.write(line + b"\n")
                sys.stdout.flush()
            n += 1
            if count and n >= count:
                return
            time.sleep(interval)
            ts.poll_all()
    except KeyboardInterrupt:
        return


@click.command(name="ls")
@shm_dir_option
@prefix_option
@click.option(
    "--stale-after", type=float, default=5.0, show_default=True, envvar="KVSIDECAR_STALE_AFTER"
)
@click.option("--allow-any-uid", is_flag=True, envvar="KVSIDECAR_ALLOW_ANY_UID")
def ls(shm_dir: str, prefix: str, stale_after: float, allow_any_uid: bool) -> None:
    """List segments with their state, age and size."""
    ts = _targets(shm_dir, prefix, None, stale_after, allow_any_uid)
    views = ts.views()
    ts.stop()
    if not views:
        click.echo(f"kvsidecar: no segments in {shm_dir} with prefix {prefix!r}", err=True)
        sys.exit(EXIT_NO_TARGET)
    now = time.monotonic_ns()
    click.echo(f"{'SEGMENT':<40} {'STATE':<10} {'AGE':>8} {'GEN':>4} {'BYTES':>8}  ERROR")
    for v in views:
        age = v.age_seconds(now)
        try:
            size = os.stat(os.path.join(shm_dir, v.name), follow_symlinks=False).st_size
        except OSError:
            size = 0
        gen = v.last.generation if v.last else "-"
        click.echo(
            f"{v.name:<40} {v.state:<10} {'-' if age is None else f'{age:.1f}s':>8} "
            f"{gen:>4} {size:>8}  {v.error}"
        )
    sys.exit(_exit_code(views))
