"""Why a push failed, in one line naming the fix.

The transport (transport.py) gives a cause per failed export: a status (`code: 401`), its
own bound (`answer over 64 KiB`, `no complete answer within 10 s`), or a requests
exception, whose text for a TLS failure is a 300-character repr. `explain` turns it into
one short line; the Pusher logs it when the push starts failing and when it recovers, not
once per interval.
"""

from __future__ import annotations

# (substring of the cause, what to do). First match wins.
_HINTS = (
    (
        "CERTIFICATE_VERIFY_FAILED",
        "TLS certificate not trusted: give the collector's CA with --otlp.ca-file",
    ),
    ("SSLError", "TLS handshake failed: check --otlp.ca-file/--otlp.cert-file/--otlp.key-file"),
    ("Connection refused", "connection refused: is the collector listening at the endpoint?"),
    ("code: 401", "HTTP 401: check the token in --otlp.headers-file"),
    ("code: 403", "HTTP 403: check the token in --otlp.headers-file"),
    ("code: 404", "HTTP 404: the endpoint's path is wrong (OTLP/HTTP: /v1/metrics)"),
    ("answer over", "the collector's {cause}: is the endpoint an OTLP/HTTP receiver?"),
    ("no complete answer", "{cause}: the collector is slow, or trickles its answer"),
    ("timed out", "no answer in time: the collector is slow or unreachable"),
    ("timeout", "no answer in time: the collector is slow or unreachable"),
    ("NameResolutionError", "host name does not resolve: check --otlp.endpoint"),
)


def explain(message: str) -> str:
    """The transport's cause as one short line naming the fix."""
    for needle, hint in _HINTS:
        if needle in message:
            return hint.format(cause=message)
    flat = " ".join(message.split())
    return flat[:200] + ("..." if len(flat) > 200 else "")
