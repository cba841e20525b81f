"""Listening sockets: binding parsed listen addresses, naming bound ones, and the
open-file limit every accepted connection counts against."""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket

__all__ = ["BACKLOG", "bind", "format_address", "open_fds", "raise_fd_limit"]

log = logging.getLogger(__name__)

BACKLOG = 1024  # a burst of connects waits in the kernel, not refused


def format_address(sockaddr: tuple) -> str:
    host, port = sockaddr[0], sockaddr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _listen_socket(
    sockaddr: tuple, family: socket.AddressFamily, dualstack: bool = False
) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if dualstack:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(sockaddr)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def bind(host: str, port: int) -> socket.socket:
    """A listening socket for a parsed listen address ("" = every interface)."""
    if host == "":
        # ":port" means every interface: IPv6 dual-stack when the kernel has it.
        if socket.has_dualstack_ipv6():
            try:
                return _listen_socket(("::", port), socket.AF_INET6, dualstack=True)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise
        return _listen_socket(("0.0.0.0", port), socket.AF_INET)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    return _listen_socket(sockaddr, family)


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (each connection is an fd); the new
    soft limit. Idempotent; a refusal (rare: a seccomp filter) keeps the old limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft


def open_fds() -> int:
    """Descriptors this process holds now (0 where /proc is not mounted)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listing them
    except OSError:
        return 0
