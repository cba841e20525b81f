"""A bcrypt check whose client has hung up is skipped (issue 24 item 3): on cb621d7, 600
connect-send-close requests cost ~39 CPU-seconds of bcrypt and held a same-address
login ~37 s. In-process server (to count the checks), real sockets, real bcrypt."""

from __future__ import annotations

import base64
import socket
import time
from collections.abc import Callable

import bcrypt
import pytest

from kvsidecar.daemon.endpoints import WebServer
from kvsidecar.web.basic_auth import PER_ADDRESS, BasicAuth
from kvsidecar.web.config_file import parse_web_config
from tests.web.test_server import FakeHandlers, handlers, port_of, request, serve  # noqa: F401


# 300: more than one address's PER_ADDRESS (256) places, which the ones gone must not
# hold; the first check then lasts 1 s, so they are still queued when the login comes.
@pytest.mark.parametrize("hangups", [30, 300])
def test_checks_of_clients_that_left_are_skipped(
    serve: Callable[..., WebServer],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    hangups: int,
) -> None:
    checks: list[str] = []
    real_verify = BasicAuth.verify

    def counting(self: BasicAuth, user: str, password: str) -> bool:
        checks.append(password)
        if len(checks) == 1 and hangups > PER_ADDRESS:
            time.sleep(1.0)  # longer than CROWDED_WAIT_S: nothing drains the queue meanwhile
        return real_verify(self, user, password)

    monkeypatch.setattr(BasicAuth, "verify", counting)
    hashed = bcrypt.hashpw(b"right", bcrypt.gensalt(10)).decode()  # ~85 ms a check
    cfg = parse_web_config(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    server = serve(web_config=cfg, request_timeout_s=30.0)
    port = port_of(server)
    for i in range(hangups):  # distinct wrong passwords: nothing is cached
        token = base64.b64encode(f"prometheus:wrong{i}".encode()).decode()
        with socket.create_connection(("127.0.0.1", port), 5) as s:
            s.sendall(
                f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {token}\r\n\r\n".encode()
            )
    # A login from the same address, after them: on cb621d7 it queued behind all of them.
    status = request(server, "/metrics", auth="prometheus:right", timeout=30)[0]
    assert status == 200
    time.sleep(0.5)  # anything still queued would have run by now
    wrong = [p for p in checks if p != "right"]
    # The first check or two may start before its client's FIN arrives; the rest never run.
    assert len(wrong) <= 3, f"{len(wrong)} bcrypt checks ran for {hangups} clients that left"
