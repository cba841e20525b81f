"""The ``kvsidecar`` command line: serve, dump, ls, bench, demo, selfcheck, events.

Every ``serve`` option (and the shared ``--shm-dir``/``--prefix``) has a
``KVSIDECAR_*`` environment twin, named explicitly on each option rather than
derived by click, so the twins are exactly the documented ones; ``--help`` shows
each twin. Every command and subcommand takes ``--version``.

Exit codes (all commands): 0 ok; 1 nothing to show or the check failed (no segment
up, a torn read, a child that died); 2 usage error (bad option, missing directory,
port in use). Shell completion: ``eval "$(_KVSIDECAR_COMPLETE=bash_source kvsidecar)"``
(``zsh_source``, ``fish_source`` for the other shells).
"""

from __future__ import annotations

import sys

import click

from kvsidecar.cli.options import print_and_exit


def _version(ctx: click.Context) -> str:
    """``kvsidecar, version 0.1.0 (revision <commit>)`` and the build date below it, as
    Prometheus's exporters print them; git is asked only when asked."""
    import platform

    from kvsidecar import __version__
    from kvsidecar.revision import build_date, revision

    return (
        f"{ctx.find_root().info_name}, version {__version__} (revision {revision()})\n"
        f"  build date:       {build_date()}\n"
        f"  python version:   {platform.python_version()}\n"
        f"  platform:         {sys.platform}/{platform.machine()}\n"
    )


_VERSION = print_and_exit("--version", _version, help="Show the version and exit.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@_VERSION
def main() -> None:
    """kvsidecar: out-of-process KV-cache monitoring for LLM engines."""


def _conventions(cmd: click.Command) -> None:
    """--version and --help-man on every (sub)command, and the env twin of each option in
    its --help."""
    from kvsidecar.cli.manpage import HELP_MAN

    for flag, option in (("--version", _VERSION), ("--help-man", HELP_MAN)):
        if not any(flag in getattr(p, "opts", ()) for p in cmd.params):
            cmd.params.extend(option(lambda: None).__click_params__)  # type: ignore[attr-defined]
    for p in cmd.params:
        if isinstance(p, click.Option) and p.envvar:
            p.show_envvar = True
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            _conventions(sub)


def _register() -> None:
    # Imported here so `kvsidecar --help` stays fast and the daemon never imports torch.
    from kvsidecar.bench.cli import bench
    from kvsidecar.cli.demo import demo
    from kvsidecar.cli.dump import dump, ls
    from kvsidecar.cli.events import events
    from kvsidecar.cli.selfcheck import selfcheck
    from kvsidecar.cli.serve import serve

    main.add_command(dump)
    main.add_command(ls)
    main.add_command(bench)
    main.add_command(selfcheck)
    main.add_command(serve)
    main.add_command(demo)
    main.add_command(events)
    _conventions(main)


_register()
