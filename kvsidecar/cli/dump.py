"""``kvsidecar dump`` and ``kvsidecar ls``: look at segments without the daemon.

Both read through the daemon's own `TargetSet`, so what they show is what
``serve`` would export (same states, same freshness rule), except a writer's age at first
sight: its own heartbeat's in full, where serve caps it (segment-format.md section 6).
Exit codes: 0 ok,
1 no target (or none up), 2 usage. Only data goes to stdout; diagnostics go to
stderr.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import time
from typing import TYPE_CHECKING

import click

from kvsidecar import settings
from kvsidecar.cli.options import (
    EXIT_NO_TARGET,
    EXIT_OK,
    allowed_uids,
    prefix_option,
    printable,
    require_dir,
    shm_dir_option,
    trust_options,
)

if TYPE_CHECKING:
    from kvsidecar.daemon.target import TargetView
    from kvsidecar.daemon.targets import TargetSet

# The daemon's modules (prometheus_client, msgspec) are imported when a command runs, not
# when the CLI loads: `kvsidecar --help` stays light.
MIN_WATCH = 0.1
_NEGATIVE = re.compile(r"-[0-9.]+(e[-+]?[0-9]+)?", re.I)


def _targets(
    shm_dir: str,
    prefix: str,
    pattern: str | None,
    stale_after: float,
    allowed: frozenset[int] | None,
    report_refused: bool = True,
) -> TargetSet:
    from kvsidecar.daemon.config import Discovery, Polling, Tuning
    from kvsidecar.daemon.targets import TargetSet

    require_dir(shm_dir)
    _quiet_per_target_lines()
    ts = TargetSet(
        Discovery(
            shm_dir,
            prefix=prefix if pattern is None else "",
            pattern=pattern,
            allowed_uids=allowed,
        ),
        # One look: a writer's heartbeat age is its own clock's, in full (segment-format.md
        # section 6), not capped just past --stale-after as serve's first sight is.
        polling=Polling(stale_after=stale_after, true_first_age=True),
        tuning=Tuning(summary_interval=float("inf")),
    )
    ts.poll_all()
    for name, why in sorted(ts.refused.items()) if report_refused else ():
        click.echo(f"kvsidecar: refused {printable(name)}: {printable(why)}", err=True)
    if ts.unremembered:  # a flood of refused files: the listing stays bounded
        click.echo(
            f"kvsidecar: {ts.unremembered} more refused file(s) not listed "
            f"(beyond the first {ts.max_refused})",
            err=True,
        )
    return ts


def _drop_per_target(record: logging.LogRecord) -> bool:
    # Only while nothing set up logging (the bare CLI, where Python's last-resort handler
    # would print it): a process with handlers (a test, an embedding program) keeps them.
    return bool(logging.getLogger().handlers) or not getattr(record, "per_target", False)


def _quiet_per_target_lines() -> None:
    """ls and dump print each segment once, as a row: the daemon's per-segment log lines
    (found, corrupt, gone) would reach a terminal too (Python's last-resort handler), so
    every bad file showed twice (issue 33 item 7)."""
    from kvsidecar.daemon.target import log as target_log  # NameThrottle's lines

    if _drop_per_target not in target_log.filters:
        target_log.addFilter(_drop_per_target)


def _none_found(shm_dir: str, which: str) -> str:
    """'no segments in DIR <which>', or that DIR does not exist: yet, for the default one
    (the agent creates it); any other is someone's to create (the agent does not)."""
    from kvsidecar import discovery

    if not os.path.lexists(shm_dir):
        if shm_dir == discovery.DEFAULT_SHM_DIR:  # as dir_problem tells them apart
            return (
                f"no segments: {printable(shm_dir)} does not exist yet (the agent creates it "
                "when the first engine starts)"
            )
        return (
            f"no segments: {printable(shm_dir)} does not exist (the agent creates only the "
            f"default {discovery.DEFAULT_SHM_DIR}: create it, or point --shm-dir at the engines' "
            "directory)"
        )
    return f"no segments in {printable(shm_dir)} {which}"


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
    """A top-style text table: one line per rank, one indented line per pool.

    Every engine-supplied string is passed through `printable` (no raw ESC/CR reaches the
    terminal), and the name column is as wide as the longest name: names differ at the end
    (``...pp0``/``...pp1``), so they are never cut.
    """
    from kvsidecar.daemon.target import UP

    now = time.monotonic_ns()
    w = max([34, *(len(printable(v.name)) for v in views)])
    lines = [
        f"{'SEGMENT':<{w}} {'STATE':<9} {'AGE':>6} {'ENGINE':<14} {'ROLE':<7} {'DP/TP/PP':<8} "
        f"{'STEP':>9} {'RUN':>5} {'WAIT':>5} {'DEFER':>5}"
    ]
    for v in views:
        name = printable(v.name)
        age = v.age_seconds(now)
        age_s = "-" if age is None else f"{age:.1f}s"
        if v.last is None:
            lines.append(f"{name:<{w}} {v.state:<9} {age_s:>6}  {printable(v.error)}")
            continue
        r = v.last.snapshot.runtime
        lines.append(
            f"{name:<{w}} {v.state:<9} {age_s:>6} {printable(r.engine)[:14]:<14} "
            f"{printable(r.role)[:7]:<7} "
            f"{f'{r.dp_rank}/{r.tp_rank}/{r.pp_rank}':<8} {r.step:>9} {r.requests_running:>5} "
            f"{r.requests_waiting:>5} {r.requests_deferred_free:>5}"
        )
        if v.state != UP:
            lines.append(f"  ! {printable(v.error)} (values below are the last good snapshot)")
        if not v.last.snapshot.pools:
            lines.append("  (no pools registered)")
            continue
        lines.append(
            f"  {'POOL':<12} {'TOTAL':>8} {'ALLOC':>8} {'RESV':>6} {'AVAIL':>8} {'CACHED':>7} "
            f"{'DEFER_BLK':>9} {'USAGE':>6} {'TOKENS':>9} {'ALLOC_B':>10} {'EVICT':>8}"
        )
        for p in v.last.snapshot.pools:
            usage = p.allocated_blocks / p.total_blocks if p.total_blocks else 0.0
            lines.append(
                f"  {printable(p.pool_name)[:12]:<12} {p.total_blocks:>8} {p.allocated_blocks:>8} "
                f"{p.reserved_blocks:>6} {p.available_blocks:>8} {_n(p.cached_blocks):>7} "
                f"{_n(p.deferred_free_blocks):>9} {usage:>6.1%} {_n(p.tokens_used):>9} "
                f"{_fmt_bytes(p.allocated_bytes):>10} {_n(p.evictions_total):>8}"
            )
    out = [line[:width] for line in lines]
    cut = max(len(line) for line in lines) - width
    if cut > 0:  # never drop columns silently
        out.append(
            f"({cut} more characters per line at {width} columns: widen the terminal or use --json)"
        )
    return "\n".join(out)


_stale_after_option = click.option(
    "--stale-after",
    type=click.FloatRange(0, min_open=True),  # as serve: a negative age would mean "never up"
    default=settings.STALE_AFTER.default,
    show_default=True,
    envvar=settings.STALE_AFTER.name,
    help="Heartbeat age that makes a writer stale.",
)


class _DumpCommand(click.Command):
    """``--watch -1`` is a range error, as ``--watch 0`` is: click would otherwise take
    ``-1`` (after an option whose value is optional) for an unknown option ``-1``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        for i, arg in enumerate(args):
            value = args[i + 1] if arg == "--watch" and i + 1 < len(args) else arg[8:]
            if arg.startswith("--watch") and _NEGATIVE.fullmatch(value):
                raise click.BadParameter(
                    f"{value} is not in the range x>={MIN_WATCH} (seconds between refreshes)",
                    ctx=ctx,
                    param_hint="'--watch'",
                )
        return super().parse_args(ctx, args)


def _exit_code(views: list[TargetView]) -> int:
    return EXIT_OK if any(v.up for v in views) else EXIT_NO_TARGET


@click.command(cls=_DumpCommand)
@shm_dir_option
@prefix_option
@click.option("--json", "as_json", is_flag=True, help="JSON on stdout (only JSON).")
@click.option(
    "--watch",
    "watch",
    # At least 0.1 s: 0 would redraw in a busy loop.
    type=click.FloatRange(MIN_WATCH),
    default=None,
    is_flag=False,
    flag_value=1.0,
    metavar="SEC",
    help=f"Refresh every SEC seconds (default 1, at least {MIN_WATCH}): a live view on a "
    "terminal, newline-delimited JSON otherwise.",
)
@click.option(
    "--count",
    type=click.IntRange(0),
    default=0,
    help="With --watch: stop after N refreshes (0 = until Ctrl-C).",
)
@_stale_after_option
@trust_options
@click.argument("pattern", required=False)
def dump(
    shm_dir: str,
    prefix: str,
    as_json: bool,
    watch: float | None,
    count: int,
    stale_after: float,
    allow_uids: tuple[int, ...],
    allow_any_uid: bool,
    pattern: str | None,
) -> None:
    """Show every segment's runtime and pools (PATTERN: a segment name or glob)."""
    ts = _targets(shm_dir, prefix, pattern, stale_after, allowed_uids(allow_uids, allow_any_uid))
    try:
        if watch is None:
            views = ts.views()
            if not views:
                click.echo(
                    f"kvsidecar: "
                    f"{_none_found(shm_dir, 'matching ' + printable(pattern or prefix + '*'))}",
                    err=True,
                )
                sys.exit(EXIT_NO_TARGET)
            _emit(views, as_json)
            sys.exit(_exit_code(views))
        _watch(ts, shm_dir, watch, count, as_json)
    finally:
        ts.stop()


def _emit(views: list[TargetView], as_json: bool) -> None:
    if as_json:
        import msgspec

        from kvsidecar.daemon.app import view_record

        now = time.monotonic_ns()
        data = msgspec.json.encode({"targets": [view_record(v, now) for v in views]})
        sys.stdout.buffer.write(msgspec.json.format(data) + b"\n")
    else:
        click.echo(render_table(views, shutil.get_terminal_size((160, 40)).columns))


def _watch(ts: TargetSet, shm_dir: str, interval: float, count: int, as_json: bool) -> None:
    import msgspec

    from kvsidecar.daemon.app import view_record

    encoder = msgspec.json.Encoder()
    live = sys.stdout.isatty() and not as_json
    n = 0
    try:
        while True:
            views = ts.views()
            if live:
                # Clear and redraw, like top.
                sys.stdout.write("\x1b[H\x1b[2J")
                # A directory removed under the watch says so, as plain dump does, rather
                # than "0 segments" forever (issue 33 item 7).
                # A directory that became unreadable says so too (the scan keeps the
                # segments it knew: their rows go stale).
                what = (
                    _none_found(shm_dir, "")
                    if not views and not os.path.isdir(shm_dir)
                    else getattr(ts, "discovery_error", "") or f"{len(views)} segments"
                )
                click.echo(
                    f"kvsidecar dump --watch {interval}s   {time.strftime('%H:%M:%S')}"
                    f"   ({what}, Ctrl-C to quit)"
                )
                click.echo(render_table(views, shutil.get_terminal_size((160, 40)).columns))
            else:
                now = time.monotonic_ns()
                line = encoder.encode(
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
@_stale_after_option
@trust_options
def ls(
    shm_dir: str,
    prefix: str,
    stale_after: float,
    allow_uids: tuple[int, ...],
    allow_any_uid: bool,
) -> None:
    """List segments with their state, age and size, and the files refused (with why)."""
    ts = _targets(
        shm_dir, prefix, None, stale_after, allowed_uids(allow_uids, allow_any_uid), False
    )
    views = ts.views()
    # Refused files are rows too (the reason names the versions of a newer major): an engine
    # upgraded before the daemon must not vanish from the list.
    refused = sorted(ts.refused.items())
    ts.stop()
    if not views and not refused:
        click.echo(
            f"kvsidecar: {_none_found(shm_dir, 'with prefix ' + printable(repr(prefix)))}",
            err=True,
        )
        sys.exit(EXIT_NO_TARGET)
    now = time.monotonic_ns()
    w = max(
        [40, *(len(printable(v.name)) for v in views), *(len(printable(n)) for n, _ in refused)]
    )
    click.echo(f"{'SEGMENT':<{w}} {'STATE':<10} {'AGE':>8} {'GEN':>4} {'BYTES':>8}  ERROR")
    for v in views:
        age = v.age_seconds(now)
        try:
            size = os.stat(os.path.join(shm_dir, v.name), follow_symlinks=False).st_size
        except OSError:
            size = 0
        gen = v.last.generation if v.last else "-"
        click.echo(
            f"{printable(v.name):<{w}} {v.state:<10} {'-' if age is None else f'{age:.1f}s':>8} "
            f"{gen:>4} {size:>8}  {printable(v.error)}"
        )
    for name, why in refused:
        try:
            size = os.stat(os.path.join(shm_dir, name), follow_symlinks=False).st_size
        except OSError:
            size = 0
        click.echo(
            f"{printable(name):<{w}} {'refused':<10} {'-':>8} {'-':>4} {size:>8}  {printable(why)}"
        )
    # What a --gateway.listen-address listener would answer 503 for (docs/gateway.md).
    from kvsidecar.daemon.gateway_ranks import rank_problems

    problems = rank_problems(views)
    if problems:
        click.echo("\nGATEWAY (ranks a gateway listener would answer 503)")
        for line in problems:
            click.echo(line)
    sys.exit(_exit_code(views))
