"""The daemon's listeners must not claim one port twice: checked before any is bound.

Giving the gateway the main port's address (`--gateway.listen-address :19440` beside the
default `--web.listen-address :19440`) failed with "port in use by another process", which
sent operators looking for another process; the gateway's ranks take `port + dp_rank`, so a
base port just below the main port collides the same way. `overlap` names both flags and
the fix in one line. Port 0 (any free port) never collides; a wildcard host ("", 0.0.0.0,
::) collides with every host on the same port.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


@dataclass(frozen=True)
class Claim:
    """`count` consecutive ports from `port` on `host`, asked for by `flag` (`shown`)."""

    flag: str
    shown: str
    host: str
    port: int
    count: int = 1

    def ports(self) -> range:
        return range(self.port, self.port + self.count) if self.port else range(0)


def _same_host(a: str, b: str) -> bool:
    return a == b or a in _WILDCARDS or b in _WILDCARDS


def overlap(claims: Sequence[Claim]) -> str | None:
    """The first two claims that share a port on one host, as a one-line error; or None."""
    for i, a in enumerate(claims):
        for b in claims[i + 1 :]:
            if not _same_host(a.host, b.host):
                continue
            shared = sorted(set(a.ports()) & set(b.ports()))
            if shared:
                return (
                    f"{a.flag} {a.shown} and {b.flag} {b.shown} both claim port {shared[0]}"
                    f"{_ranks(a, shared[0])}{_ranks(b, shared[0])}: give each its own port"
                    " (the gateway takes port + dp_rank for each of --gateway.ranks)"
                )
    return None


def _ranks(c: Claim, port: int) -> str:
    return f" (as dp_rank {port - c.port} of {c.flag})" if c.count > 1 else ""
