"""The HTTP side, shaped like exporter-toolkit's ``web/``; it knows nothing of metrics.

========================  ===========================================================
``server``                the asyncio front, routes given by the caller, probes
``request``               strict HTTP/1.1 request-head parser and response heads
``workers``               render threads and the max-requests limiter
``sockets``               binding listen addresses, the open-file limit
``listen_address``        ``host:port`` / ``:port`` / ``[v6]:port`` (serve and demo)
``stats``                 request counts, durations, rejected connections
``landing``               the landing page
``compression``           gzip negotiation and cache
``config``                the web config's records (TLS, headers, users, rate limit)
``config_file``           its strict YAML parser
``tls_context``           the server's SSLContext and the client-SAN check
``tls_stream``            TLS over asyncio streams, pulled on demand
``basic_auth``            bcrypt basic auth: cache, bounded and fair checks
``live_config``           the config in force: reload on change or SIGHUP
``log_throttle``          one log line per second for floods
========================  ===========================================================

The daemon's routes (``/metrics``, ``/api/v1/snapshots``, ``/``) are in
`kvsidecar.daemon.endpoints`.
"""
