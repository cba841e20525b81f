"""``kvsidecar selfcheck``: a writer and a reader process exercising one segment."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import time

import click

from kvsidecar.bench import torn


@click.command()
@click.option("--seconds", default=2.0, show_default=True, help="How long to stress.")
def selfcheck(seconds: float) -> None:
    """Run a full-speed writer against two reader processes and report torn reads."""
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-selfcheck-", dir="/dev/shm")
    t0 = time.monotonic()
    try:
        result = torn.run(seconds=seconds, readers=2, shm_dir=shm_dir)
    finally:
        os.rmdir(shm_dir)
    click.echo(
        f"selfcheck: {result['reads']:,} reads, {result['retries']:,} retries, "
        f"{result['torn_accepted']} torn accepted in {time.monotonic() - t0:.1f}s"
    )
    sys.exit(0 if result["torn_accepted"] == 0 and result["reads"] > 0 else 1)


if __name__ == "__main__":  # pragma: no cover
    mp.freeze_support()
