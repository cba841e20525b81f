"""`/-/ready` says why (issue 24 item 8): a 200 still carries the readiness reason, so a
failing discovery the docs promise to report on /-/ready is not hidden behind a bare OK."""

from __future__ import annotations

from collections.abc import Callable

from kvsidecar.daemon.endpoints import WebServer
from tests.web.test_server import FakeHandlers, handlers, request, serve  # noqa: F401


def test_ready_200_carries_the_reason(
    serve: Callable[..., WebServer],  # noqa: F811
    handlers: FakeHandlers,  # noqa: F811
) -> None:
    server = serve()
    handlers.is_ready = (True, "ready: vllm-0=up; discovery failing: [Errno 13] Permission denied")
    status, _, body = request(server, "/-/ready")
    assert status == 200
    assert b"discovery failing: [Errno 13] Permission denied" in body
    handlers.is_ready = (False, "not ready: no source is up (no segments)")
    assert request(server, "/-/ready")[::2] == (503, b"not ready: no source is up (no segments)")
