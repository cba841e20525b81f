"""``kvsidecar dump`` and ``kvsidecar ls``: look at segments without the daemon."""

from __future__ import annotations

import sys

import click
import msgspec

from kvsidecar.cli import EXIT_NO_TARGET, prefix_option, shm_dir_option
from kvsidecar.discovery import list_segments
from kvsidecar.protocol.reader import ReadError, Reading, read_segment
from kvsidecar.protocol.schema import to_dict


def reading_record(name: str, result: Reading | ReadError) -> dict:
    """A keyed JSON-ready record of one segment read, good or bad."""
    if isinstance(result, Reading):
        return {
            "segment": name,
            "state": "up",
            "seq": result.seq,
            "incarnation": result.incarnation,
            "generation": result.generation,
            "age_seconds": round(result.age_seconds(), 3),
            "snapshot": to_dict(result.snapshot),
        }
    last = getattr(result, "last", None)
    record = {"segment": name, "state": result.kind, "error": str(result)}
    if last is not None:
        record["last_snapshot"] = to_dict(last.snapshot)
        record["age_seconds"] = round(last.age_seconds(), 3)
    return record


@click.command()
@shm_dir_option
@prefix_option
@click.argument("pattern", required=False)
def dump(shm_dir: str, prefix: str, pattern: str | None) -> None:
    """Print every segment's snapshot as JSON (PATTERN: a name or glob)."""
    names = list_segments(shm_dir, prefix if pattern is None else "", pattern)
    if not names:
        click.echo(f"no segments in {shm_dir} matching {pattern or prefix + '*'}", err=True)
        sys.exit(EXIT_NO_TARGET)
    records = [reading_record(n, read_segment(n, shm_dir=shm_dir)) for n in names]
    sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(records)) + b"\n")
    if not any(r["state"] == "up" for r in records):
        sys.exit(EXIT_NO_TARGET)


@click.command(name="ls")
@shm_dir_option
@prefix_option
def ls(shm_dir: str, prefix: str) -> None:
    """List segments with their state and age."""
    names = list_segments(shm_dir, prefix)
    for n in names:
        r = reading_record(n, read_segment(n, shm_dir=shm_dir))
        age = r.get("age_seconds")
        click.echo(f"{n}\t{r['state']}\t{'-' if age is None else f'{age:.1f}s'}")
    if not names:
        click.echo(f"no segments in {shm_dir} with prefix {prefix!r}", err=True)
        sys.exit(EXIT_NO_TARGET)
