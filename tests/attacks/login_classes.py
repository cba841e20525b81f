"""G3 per client class (issue 43 items 3 and 4): a valid first login's time and outcome
under a wrong-password flood from 1 and from 64 addresses, for a client address never
checked, one that logged in before the flood ("known"), and one that sent one wrong
password 2 s before it ("once wrong": a Prometheus during a credential rotation).

``front``: the connections the front serves at once (0: the default budget's 256), set
through ``--web.connection-memory-bytes``; a small front (12) is where the flood fills
every place and the front must choose whom to close or refuse for a login.

Each login is a new user (its password uncached: one bcrypt check), from the class's
address, on a new connection with a 10 s timeout (Prometheus' scrape timeout). Counted:
answered 200, refused with a status (429/503), dropped (closed or reset without a
status line), timed out. Goal: every login 200 within 1 s, none dropped."""

from __future__ import annotations

import base64
import os
import socket
import tempfile
import threading
import time
from typing import Any

import bcrypt

from kvsidecar import settings
from kvsidecar.bench.report import percentile
from kvsidecar.web.server import PLAIN_CONNECTION_BYTES
from tests.attacks.hostile_clients import _daemon, _raise_nofile

__all__ = ["CLASSES", "run_authclasses"]

CLASSES = ("never-checked", "known", "once-wrong")
THREADS = 64  # flooding threads, spread over the flood's addresses
TIMEOUT_S = 10.0
GOAL_MS = 1000.0
_SOURCES = {"never-checked": "127.0.7.{i}", "known": "127.0.8.1", "once-wrong": "127.0.9.{i}"}


def _source(cls: str, i: int) -> str:
    return _SOURCES[cls].format(i=i + 1)


def _ask(port: int, source: str, user: str, password: str) -> tuple[int, float]:
    """(status, seconds): 0 dropped without a status line, -1 no answer in `TIMEOUT_S`."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    t0 = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), TIMEOUT_S, (source, 0)) as s:
            s.sendall(
                f"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                f"Authorization: Basic {token}\r\n\r\n".encode()
            )
            head = s.recv(64)
    except TimeoutError:
        return -1, time.perf_counter() - t0
    except OSError:
        head = b""
    took = time.perf_counter() - t0
    parts = head.split(b" ", 2)
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0), took


def _flood(port: int, k: int, addresses: int, stop: threading.Event) -> None:
    source = f"127.1.{k % addresses // 250}.{k % addresses % 250 + 1}"
    n = 0
    while not stop.is_set():
        n += 1
        status, _ = _ask(port, source, "alice", f"wrong-{k}-{n}")
        if status <= 0:
            stop.wait(0.05)


def _one_flood(addresses: int, logins: int, front: int = 0) -> dict[str, Any]:
    salt = bcrypt.gensalt(10)
    users = {f"{c}{i}": f"pw-{c}-{i}" for c in CLASSES for i in range(logins)}
    users["alice"] = "s3cret"
    users["known-before"] = "before"
    with tempfile.TemporaryDirectory(prefix="kvsidecar-bench-") as tmp:
        path = os.path.join(tmp, "web.yml")
        with open(path, "w") as f:
            f.write("basic_auth_users:\n")
            f.writelines(
                f"  {u}: '{bcrypt.hashpw(p.encode(), salt).decode()}'\n" for u, p in users.items()
            )
        flags = ("--web.connection-memory-bytes", str(front * PLAIN_CONNECTION_BYTES))
        with _daemon(path, None, *(flags if front else ())) as (_, url):
            port = int(url.rsplit(":", 1)[1])
            assert _ask(port, _source("known", 0), "known-before", "before")[0] == 200
            for i in range(logins):  # one wrong password each, 2 s before the flood
                _ask(port, _source("once-wrong", i), f"once-wrong{i}", "rotated-away")
            time.sleep(2.0)
            stop = threading.Event()
            pool = [
                threading.Thread(target=_flood, args=(port, k, addresses, stop), daemon=True)
                for k in range(THREADS)
            ]
            for t in pool:
                t.start()
            time.sleep(2.0)  # the flood is in full swing
            samples: dict[str, list[tuple[int, float]]] = {c: [] for c in CLASSES}
            for i in range(logins):
                for c in CLASSES:
                    samples[c].append(_ask(port, _source(c, i), f"{c}{i}", f"pw-{c}-{i}"))
                    time.sleep(0.3)
            stop.set()
            for t in pool:
                t.join(TIMEOUT_S + 5)
    rows = {}
    for c, got in samples.items():
        ok = [t for s, t in got if s == 200]
        rows[c] = {
            "logins": len(got),
            "ok": len(ok),
            "refused": sum(s in (429, 503) for s, _ in got),
            "dropped": sum(s == 0 for s, _ in got),
            "timed_out": sum(s == -1 for s, _ in got),
            "median_ms": percentile(ok, 50) * 1e3,
            "max_ms": max(ok) * 1e3 if ok else float("nan"),
            "statuses": [s for s, _ in got],
            "ms": [round(t * 1e3) for _, t in got],
        }
    return rows


def run_authclasses(
    *, quick: bool = False, addresses: tuple[int, ...] = (1, 64), front: int = 0
) -> dict[str, Any]:
    _raise_nofile(4096)
    logins = 3 if quick else 8
    return {
        "threads": THREADS,
        "logins_per_class": logins,
        "goal_ms": GOAL_MS,
        "front": front,
        "daemon_from": os.environ.get(settings.BENCH_CHECKOUT.name) or "this install",
        "floods": {str(n): _one_flood(n, logins, front) for n in addresses},
    }
