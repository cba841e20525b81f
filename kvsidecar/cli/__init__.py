"""The ``kvsidecar`` command line, one module per command (like celery's ``bin/``).

``main`` is the group; ``options`` holds what the commands share; ``serve``, ``dump``
(dump and ls), ``demo`` and ``selfcheck`` are the commands; ``kvsidecar bench`` is a
group of its own in ``kvsidecar/bench/cli.py``. Nothing is imported here, so a command
module loads only what it needs.
"""
