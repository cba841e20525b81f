"""The ``kvsidecar`` command line: serve, dump, ls, bench, demo, selfcheck.

Every ``serve`` option (and the shared ``--shm-dir``/``--prefix``) has a
``KVSIDECAR_*`` environment twin, named explicitly on each option rather than
derived by click, so the twins are exactly the documented ones.
"""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvsidecar")
def main() -> None:
    """kvsidecar: out-of-process KV-cache monitoring for LLM engines."""


def _register() -> None:
    # Imported here so `kvsidecar --help` stays fast and the daemon never imports torch.
    from kvsidecar.bench.cli import bench
    from kvsidecar.daemon.cli import serve
    from kvsidecar.demo_cli import demo
    from kvsidecar.dump import dump, ls
    from kvsidecar.selfcheck import selfcheck

    main.add_command(dump)
    main.add_command(ls)
    main.add_command(bench)
    main.add_command(selfcheck)
    main.add_command(serve)
    main.add_command(demo)


_register()
