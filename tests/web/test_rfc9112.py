"""Request framing as RFC 9112 requires it (issue 24 item 4): a list-valued or conflicting
Content-Length and an HTTP/1.1 request without exactly one Host are 400, so bytes after
an ambiguous head are never parsed as a second request (the shape of request smuggling).
Real sockets against a real server."""

from __future__ import annotations

import pytest

from kvsidecar.daemon.endpoints import WebServer
from tests.web.test_request_fuzz import exchange, server  # noqa: F401 (fixture)


@pytest.mark.parametrize(
    "head",
    [
        b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nContent-Length: 0, 5\r\n\r\n",
        b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nContent-Length: 5, 0\r\n\r\n",
        b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nContent-Length: 0, 7\r\n\r\n",
        b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nContent-Length: 0,\r\n\r\n",
    ],
)
def test_list_valued_content_length_is_400_and_nothing_follows(
    server: WebServer,  # noqa: F811
    head: bytes,
) -> None:
    # A smuggled second request follows: it must never be answered.
    answer = exchange(server, head + b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:80]
    assert answer.count(b"HTTP/1.1 ") == 1, answer


def test_identical_content_length_list_is_one_length(server: WebServer) -> None:  # noqa: F811
    # RFC 9112 6.3 allows "5, 5": one length; the body is never read, so it closes.
    answer = exchange(server, b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nContent-Length: 0, 0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:80]


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET /-/healthy HTTP/1.1\r\n\r\n", 400),
        (b"GET /-/healthy HTTP/1.1\r\nHost: a\r\nHost: a\r\n\r\n", 400),
        (b"GET /-/healthy HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        (b"GET /-/healthy HTTP/1.0\r\n\r\n", 200),  # HTTP/1.0 has no Host requirement
        (b"GET /-/healthy HTTP/1.1\r\nHost:\r\n\r\n", 200),  # empty Host is allowed (3.2)
    ],
)
def test_host_header_rules(server: WebServer, head: bytes, status: int) -> None:  # noqa: F811
    answer = exchange(server, head)
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:80]
