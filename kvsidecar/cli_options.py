"""Options and exit codes shared by the CLI's commands (kept apart from the group so
command modules can import them without importing every other command)."""

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
