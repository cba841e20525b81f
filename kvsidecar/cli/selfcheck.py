"""``kvsidecar selfcheck``: a writer and a reader process exercising one segment."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import sys
import tempfile
import time

import click

from kvsidecar.cli.options import printable

# bench.torn's module constant, spelled here so --help does not import the writer
# (msgspec); tests/test_cli_import.py checks that the two agree.
START_TIMEOUT = 30.0


@click.command()
@click.option(
    "--seconds",
    type=click.FloatRange(0),
    default=2.0,
    show_default=True,
    help="How long to stress (process start-up adds a few seconds). The command ends within "
    f"SECONDS + {2 * START_TIMEOUT:g} s.",
)
def selfcheck(seconds: float) -> None:
    """Run a full-speed writer against two reader processes and report torn reads.

    Exit status 0: reads were made and none was torn; 1 otherwise.
    """
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-selfcheck-", dir="/dev/shm")
    t0 = time.monotonic()
    # Progress on stderr: starting three interpreters takes seconds before the stress does.
    click.echo(
        f"selfcheck: starting a writer and 2 reader processes, then {seconds:g} s of reads...",
        err=True,
    )
    try:
        from kvsidecar.bench import torn

        result = torn.run(seconds=seconds, readers=2, shm_dir=shm_dir)
    except RuntimeError as e:
        click.echo(f"selfcheck: failed: {printable(e)}", err=True)
        sys.exit(1)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)  # a killed writer leaves its segment
    click.echo(
        f"selfcheck: {result['reads']:,} reads, {result['retries']:,} retries, "
        f"{result['torn_accepted']} torn accepted in {seconds:g} s of reads "
        f"({time.monotonic() - t0:.1f} s with process start-up)"
    )
    sys.exit(0 if result["torn_accepted"] == 0 and result["reads"] > 0 else 1)


if __name__ == "__main__":  # pragma: no cover
    mp.freeze_support()
