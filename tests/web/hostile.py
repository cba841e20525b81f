"""Helpers for the in-process attack tests: attacker threads and counted probes."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvsidecar.web.server import WebServer


@contextmanager
def metrics_server(**kwargs: object) -> Iterator[WebServer]:
    """A started `WebServer` with one /metrics route on 0.0.0.0:0 (a 30 s head deadline
    unless told otherwise), shut down after the block."""
    kwargs.setdefault("request_timeout_s", 30.0)
    web = WebServer(
        {"/metrics": lambda request: (b"up 1\n", "text/plain; version=0.0.4")},
        ["0.0.0.0:0"],
        **kwargs,  # type: ignore[arg-type]
    )
    web.start()
    try:
        yield web
    finally:
        web.shutdown()


def port_of(server: WebServer) -> int:
    return int(server.addresses[0].rsplit(":", 1)[1])


@contextmanager
def attackers(attack: Callable[[int, threading.Event], None], n: int) -> Iterator[None]:
    """Run ``attack(k, stop)`` on n threads for the duration of the block."""
    stop = threading.Event()
    threads = [threading.Thread(target=attack, args=(k, stop), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(40)


def probe(port: int, timeout_s: float = 3.0) -> bool:
    """One /-/healthy on a new connection from 127.0.0.1: answered 200 within timeout_s."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def answered_probes(port: int, probes: int, gap_s: float = 0.1) -> int:
    answered = 0
    for _ in range(probes):
        answered += probe(port)
        time.sleep(gap_s)
    return answered
