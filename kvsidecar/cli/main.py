"""The ``kvsidecar`` command line: serve, dump, ls, bench, demo, selfcheck.

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

import click


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``kvsidecar, version 0.1.0 (revision <commit>)``; git is asked only when asked."""
    if not value or ctx.resilient_parsing:
        return
    from kvsidecar import __version__
    from kvsidecar.revision import revision

    click.echo(f"{ctx.find_root().info_name}, version {__version__} (revision {revision()})")
    ctx.exit()


_VERSION = click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version and exit.",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@_VERSION
def main() -> None:
    """kvsidecar: out-of-process KV-cache monitoring for LLM engines."""


def _conventions(cmd: click.Command) -> None:
    """--version on every (sub)command, and the env twin of each option in its --help."""
    if not any("--version" in getattr(p, "opts", ()) for p in cmd.params):
        cmd.params.extend(_VERSION(lambda: None).__click_params__)  # type: ignore[attr-defined]
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
    from kvsidecar.cli.selfcheck import selfcheck
    from kvsidecar.cli.serve import serve

    main.add_command(dump)
    main.add_command(ls)
    main.add_command(bench)
    main.add_command(selfcheck)
    main.add_command(serve)
    main.add_command(demo)
    _conventions(main)


_register()
