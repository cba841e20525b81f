"""The ``kvsidecar`` command line: serve, dump, ls, bench, demo, selfcheck.

Every option has a ``KVSIDECAR_*`` environment twin (click's auto_envvar_prefix
for subcommands: ``KVSIDECAR_SERVE_...`` is *not* used; each option names its
variable explicitly so the twins are the documented ones).
"""

from __future__ import annotations

from typing import Any

import click

from kvsidecar.protocol.names import DEFAULT_PREFIX, DEFAULT_SHM_DIR

EXIT_OK, EXIT_NO_TARGET, EXIT_USAGE = 0, 1, 2


def shm_dir_option(f: Any) -> Any:
    return click.option(
        "--shm-dir",
        envvar="KVSIDECAR_SHM_DIR",
        default=DEFAULT_SHM_DIR,
        show_default=True,
        help="Directory holding the segments (a tmpfs).",
    )(f)


def prefix_option(f: Any) -> Any:
    return click.option(
        "--prefix",
        envvar="KVSIDECAR_PREFIX",
        default=DEFAULT_PREFIX,
        show_default=True,
        help="Only segments whose name starts with this.",
    )(f)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvsidecar")
def main() -> None:
    """kvsidecar: out-of-process KV-cache monitoring for LLM engines."""


def _register() -> None:
    # Imported here so `kvsidecar --help` stays fast and the daemon never imports torch.
    from kvsidecar.bench.cli import bench
    from kvsidecar.daemon.cli import serve
    from kvsidecar.dump import dump, ls
    from kvsidecar.selfcheck import selfcheck

    main.add_command(dump)
    main.add_command(ls)
    main.add_command(bench)
    main.add_command(selfcheck)
    main.add_command(serve)


_register()
