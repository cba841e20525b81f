"""``python -m kvsidecar`` = the ``kvsidecar`` command."""

from kvsidecar.cli.main import main

main()
