"""The same-address auth flood (issue 24 item 3): distinct wrong passwords, each on a
fresh connection from the scraper's own address, so none is known to have failed. On
0704fc0 a first login queued behind every one of them (11.5-24.9 s in the audit). Now
an address holds at most `PER_ADDRESS` checks per class and is refused at once beyond
that, so the login waits for at most that many checks, or is told 429 at once. Counts,
not wall-clock: the order bcrypt checks ran in, recorded by the server's own verify."""

from __future__ import annotations

import asyncio
import base64
import select
import socket
import threading
from collections.abc import Callable

import bcrypt
import pytest

from kvsidecar.daemon.endpoints import WebServer
from kvsidecar.web.basic_auth import PER_ADDRESS, AuthGate, BasicAuth
from kvsidecar.web.config_file import parse_web_config
from tests.web.test_server import FakeHandlers, handlers, port_of, serve  # noqa: F401

FLOOD = 40  # > PER_ADDRESS: on 0704fc0 all 40 queue ahead of the login


def _send(port: int, auth: str) -> socket.socket:
    token = base64.b64encode(auth.encode()).decode()
    s = socket.create_connection(("127.0.0.1", port), 30)
    s.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {token}\r\n\r\n".encode())
    return s


def _answered(socks: list[socket.socket], got: dict[socket.socket, bytes]) -> int:
    """Read whatever answers have arrived (briefly waiting); how many have."""
    waiting = [s for s in socks if s not in got]
    for s in select.select(waiting, [], [], 0.05)[0] if waiting else ():
        got[s] = s.recv(4096)
    return sum(s in got for s in socks)


def _until(cond: Callable[[], bool], what: str) -> None:
    # An "eventually": returns as soon as it holds; 30 s only stops a hang.
    for _ in range(600):
        if cond():
            return
        threading.Event().wait(0.05)
    raise AssertionError(f"never happened: {what}")


def test_login_waits_for_at_most_per_address_checks_of_its_own_address(
    serve: Callable[..., WebServer],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    order: list[str] = []
    hold = threading.Event()
    real_verify = BasicAuth.verify

    def recorded(self: BasicAuth, user: str, password: str) -> bool:
        order.append(password)
        if len(order) == 1:
            hold.wait(30)  # the first check holds the one bcrypt worker: the rest queue
        return real_verify(self, user, password)

    monkeypatch.setattr(BasicAuth, "verify", recorded)
    cost4 = bcrypt.gensalt(4)  # the order is counted, not timed: a cheap cost will do
    hashes = {
        u: bcrypt.hashpw(p, cost4).decode()
        for u, p in (("prometheus", b"s3cret"), ("scraper", b"right"))
    }
    cfg = parse_web_config(
        "basic_auth_users:\n" + "".join(f"  {u}: '{h}'\n" for u, h in hashes.items())
    )
    server = serve(web_config=cfg, request_timeout_s=30.0)
    gate = server._front.auth_gate._gate  # type: ignore[union-attr]
    port = port_of(server)
    flood = [_send(port, f"prometheus:wrong{i}") for i in range(FLOOD)]
    got: dict[socket.socket, bytes] = {}

    def settled() -> bool:  # every flood request is queued, running or answered
        return bool(order) and gate.busy + gate.pending + _answered(flood, got) == FLOOD

    _until(settled, "the flood's requests queued or answered")
    login = _send(port, "scraper:right")  # the scraper, from the same address, after them
    before = gate.busy + gate.pending
    answer: dict[socket.socket, bytes] = {}
    _until(
        lambda: gate.busy + gate.pending > before or _answered([login], answer) > 0,
        "the login queued or answered",
    )
    answered_while_held = bool(answer)
    hold.set()
    _until(lambda: _answered([login], answer) > 0, "the login answered")
    reply = answer[login]
    for s in [*flood, login]:
        s.close()
    ahead = order.index("right") if "right" in order else len(order)
    # 0704fc0: all 40 ran first. Now at most PER_ADDRESS of the address's checks exist at
    # once, the login's own included; the one held above is one of them.
    assert ahead <= PER_ADDRESS, f"{ahead} bcrypt checks ran before the login's: {order}"
    if reply.startswith(b"HTTP/1.1 429"):
        # Refused for crowding: at once (while the queue was still held), no check run
        # for it, and told when to come back.
        assert answered_while_held, "a refused login waited for the queue"
        assert b"\r\nRetry-After: 1\r\n" in reply, reply
        assert "right" not in order
    else:
        assert reply.startswith(b"HTTP/1.1 200"), reply
    wrong = [p for p in order if p != "right"]
    assert len(wrong) <= PER_ADDRESS, f"{len(wrong)} checks for {FLOOD} same-address attempts"


def test_one_address_cannot_fill_the_queue_for_others() -> None:
    """600 checks from connections of one address that already failed (the keep-alive
    flood) take neither another address's turn nor that address's own first attempts':
    on 0704fc0 they filled the 512-deep queue and both were refused."""
    order: list[str] = []
    results: dict[str, bool | None] = {}
    release = threading.Event()

    def job(name: str) -> bool:
        release.wait(10)
        order.append(name)
        return False

    async def main() -> None:
        gate = AuthGate(workers=1)
        try:
            tasks = {}

            def submit(name: str, key: str, suspect: bool) -> None:
                tasks[name] = asyncio.create_task(gate.run(key, lambda: job(name), suspect))

            for i in range(600):
                submit(f"a{i}", "10.0.0.1", True)
                await asyncio.sleep(0)  # queued in this order
            # Those beyond the address's places are refused once they looked again.
            await asyncio.wait(list(tasks.values())[PER_ADDRESS:], timeout=5)
            submit("other", "10.0.0.2", False)
            submit("scraper", "10.0.0.1", False)
            await asyncio.sleep(0)
            release.set()
            done = await asyncio.wait_for(asyncio.gather(*tasks.values()), 30)
            results.update(zip(tasks, done, strict=True))
        finally:
            gate.close()

    asyncio.run(main())
    assert results["other"] is False and results["scraper"] is False, "refused: queue full"
    assert order.index("other") <= 2 and order.index("scraper") <= 2, order[:5]
    ran = sum(1 for name in order if name.startswith("a"))
    assert ran <= PER_ADDRESS, f"{ran} checks of failed connections from one address"
