"""Options and exit codes shared by the CLI's commands (kept apart from the group so
command modules can import them without importing every other command)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import click

from kvsidecar import settings
from kvsidecar.discovery import dir_problem
from kvsidecar.exit_codes import EXIT_NO_TARGET, EXIT_OK, EXIT_USAGE
from kvsidecar.printable import printable

__all__ = ["EXIT_NO_TARGET", "EXIT_OK", "EXIT_USAGE", "dir_problem", "printable"]


def print_and_exit(flag: str, text: Callable[[click.Context], str], **kw: Any) -> Any:
    """An eager flag that prints ``text(ctx)`` and exits before anything else is parsed or
    checked (``--version``, ``--help-man``): it works whatever else is on the line."""

    def callback(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
        if value and not ctx.resilient_parsing:
            click.echo(text(ctx), nl=False)
            ctx.exit()

    return click.option(flag, is_flag=True, expose_value=False, is_eager=True,
                        callback=callback, **kw)  # fmt: skip


def shm_dir_option(f: Any) -> Any:
    return click.option(
        "--shm-dir",
        envvar=settings.SHM_DIR.name,
        default=settings.SHM_DIR.default,
        show_default=True,
        help="Directory holding the segments (a tmpfs).",
    )(f)


def prefix_option(f: Any) -> Any:
    return click.option(
        "--prefix",
        envvar=settings.PREFIX.name,
        default=settings.PREFIX.default,
        show_default=True,
        help="Only segments whose name starts with this.",
    )(f)


def trust_options(f: Any) -> Any:
    """``--allow-uid`` (repeatable) and ``--allow-any-uid``, the same on every command that
    reads segments, so the fix an error message names works wherever it is printed."""
    f = click.option(
        "--allow-any-uid",
        is_flag=True,
        envvar=settings.ALLOW_ANY_UID.name,
        help="Trust segments of any owner (not recommended on shared hosts).",
    )(f)
    return click.option(
        "--allow-uid",
        "allow_uids",
        multiple=True,
        type=click.IntRange(0),
        envvar=settings.ALLOW_UID.name,
        metavar="UID",
        help="Also trust segments owned by this uid (repeatable; the env twin is "
        "space-separated). Default: own uid only.",
    )(f)


def allowed_uids(allow_uids: Iterable[int], allow_any_uid: bool) -> frozenset[int] | None:
    """The uid set a reader trusts (None = any owner)."""
    return None if allow_any_uid else frozenset({os.getuid(), *allow_uids})


def require_dir(shm_dir: str) -> None:
    """Exit with a usage error (`dir_problem`'s message, or `listing_problem`'s) when the
    segment directory is unusable: for the commands that print to a terminal (dump, ls);
    serve logs it, and keeps trying."""
    if (problem := dir_problem(shm_dir) or listing_problem(shm_dir)) is not None:
        click.echo(f"kvsidecar: {problem}", err=True)
        raise SystemExit(EXIT_USAGE)


def listing_problem(shm_dir: str) -> str | None:
    """Why this process cannot list the segment directory, with the fix, as the per-segment
    messages give one; None when it can (or it does not exist: `dir_problem`'s case). A
    one-shot command says it once and stops, where the daemon keeps its targets and retries."""
    try:
        with os.scandir(shm_dir) as entries:
            next(entries, None)
    except FileNotFoundError:
        return None
    except PermissionError:
        return (
            f"permission denied listing {printable(shm_dir)}: run kvsidecar as the engine's "
            "user or in its group (the agent creates the directory 0750)"
        )
    except OSError as e:
        return f"cannot list {printable(shm_dir)}: {e.strerror or e}"
    return None
