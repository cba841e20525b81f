"""The HTTP side that knows nothing of metrics (exporter-toolkit's ``web/``).

So far: the listen-address parser, shared by ``kvsidecar serve`` and ``kvsidecar demo``.
The server, TLS and basic-auth modules still live in ``kvsidecar/daemon/`` (issue #16).
"""
