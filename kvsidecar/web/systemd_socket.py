"""systemd socket activation (`--web.systemd-socket`, as exporter-toolkit has it).

systemd binds the listen sockets itself (a ``.socket`` unit) and starts the service with
them as descriptors 3, 4, ... and ``LISTEN_FDS`` (how many) and ``LISTEN_PID`` (the
process they are for) in its environment (sd_listen_fds(3)): the port is open from boot,
before the daemon runs, and a restart never drops a connection attempt.
"""

from __future__ import annotations

import os
import socket

__all__ = ["LISTEN_FDS_START", "SystemdSocketError", "listen_sockets"]

LISTEN_FDS_START = 3  # SD_LISTEN_FDS_START


class SystemdSocketError(ValueError):
    """No usable socket was passed; the message says what is wrong and what to do."""


def listen_sockets(environ: dict[str, str] | None = None) -> list[socket.socket]:
    """The listening stream sockets systemd passed to this process, in order.

    Unlike sd_listen_fds(unset_environment=1) the variables stay set and the descriptors
    inheritable: `serve --hold-on-error` retries a failed start by exec'ing itself (same
    pid), and the retry must find the sockets again."""
    env = os.environ if environ is None else environ
    pid, count = env.get("LISTEN_PID", ""), env.get("LISTEN_FDS", "")
    if not pid or not count:
        raise SystemdSocketError(
            "--web.systemd-socket: no socket passed by systemd (LISTEN_PID/LISTEN_FDS unset): "
            "start the service from a .socket unit, or use --web.listen-address instead"
        )
    if not (pid.isdigit() and count.isdigit()) or int(count) < 1:
        raise SystemdSocketError(
            f"--web.systemd-socket: bad LISTEN_PID={pid!r} LISTEN_FDS={count!r}"
        )
    # Set for another process (a wrapper that did not exec, a child that inherited them):
    # the descriptors are not ours to take.
    if int(pid) != os.getpid():
        raise SystemdSocketError(
            f"--web.systemd-socket: LISTEN_PID={pid} is not this process ({os.getpid()}): "
            "the sockets were passed to another process"
        )
    sockets: list[socket.socket] = []
    try:
        for fd in range(LISTEN_FDS_START, LISTEN_FDS_START + int(count)):
            sockets.append(_listening_stream(fd))
    except BaseException:
        for sock in sockets:
            sock.detach()  # not ours to close: systemd keeps them for the next start
        raise
    return sockets


def _listening_stream(fd: int) -> socket.socket:
    try:
        sock = socket.socket(fileno=fd)  # family and type read from the descriptor
    except OSError as e:
        raise SystemdSocketError(f"--web.systemd-socket: descriptor {fd}: {e.strerror}") from e
    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    inet = sock.family in (socket.AF_INET, socket.AF_INET6)
    if sock.type != socket.SOCK_STREAM or not listening or not inet:
        sock.detach()
        raise SystemdSocketError(
            f"--web.systemd-socket: descriptor {fd} is not a listening TCP socket "
            "(the .socket unit needs ListenStream=[address:]port)"
        )
    return sock
