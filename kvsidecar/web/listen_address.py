"""``--web.listen-address`` values, parsed once for every command that takes one."""

from __future__ import annotations

HINT = "use host:port, :port or [ipv6]:port"


def parse_listen_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` as Go does: ``:19440`` (all interfaces), ``0.0.0.0:19440``,
    ``[::1]:19440``, ``localhost:0``. Raises ValueError with the accepted forms."""
    if address.startswith("["):
        host, sep, rest = address[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"invalid listen address {address!r}: {HINT}")
        port_text = rest[1:]
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise ValueError(f"invalid listen address {address!r}: missing port; {HINT}")
        if ":" in host:
            raise ValueError(
                f"invalid listen address {address!r}: IPv6 needs brackets, e.g. [::1]:19440"
            )
    if not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"invalid listen address {address!r}: port must be 0-65535")
    return host, int(port_text)
