"""``python -m kvsidecar`` = the ``kvsidecar`` command."""

from kvsidecar.cli import main

main()
