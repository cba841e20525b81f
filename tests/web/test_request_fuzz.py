"""Malformed requests (issue 12 item 11): every input is answered, with at most one
short log line and never a traceback. Real sockets on 127.0.0.1, inputs from hypothesis."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsidecar.daemon.endpoints import WebServer
from tests.web.test_server import FakeHandlers, port_of


@pytest.fixture(scope="module")
def server() -> Iterator[WebServer]:
    with WebServer(FakeHandlers(), ["127.0.0.1:0"], request_timeout_s=5.0) as s:
        yield s


def exchange(server: WebServer, data: bytes) -> bytes:
    """Send ``data``, half-close, read everything until the server closes."""
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=10) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server answered and closed before taking it all
            pass
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
        return b"".join(chunks)


def assert_quiet(caplog: pytest.LogCaptureFixture) -> None:
    """At most one short line per request, never a traceback or an error."""
    ours = [r for r in caplog.records if r.name.startswith(("kvsidecar", "asyncio"))]
    for r in ours:
        assert r.exc_info is None and r.levelno < logging.ERROR, r.getMessage()
        assert "\n" not in r.getMessage() and len(r.getMessage()) < 300


@pytest.mark.parametrize(
    "target",
    [
        "http://[::1/metrics",  # the reported one
        "http://[::1]x/metrics",
        "http://[/metrics",
        "http://a:b:c/metrics",
        "http:///metrics",
        "http://user@host/metrics",
        "ftp://host/metrics",
        "metrics",
        "*",
        "/metr\x7fics",
        "/m\xe9trics",
    ],
)
def test_malformed_request_target_is_400_with_one_log_line(
    server: WebServer, caplog: pytest.LogCaptureFixture, target: str
) -> None:
    caplog.set_level(logging.DEBUG)
    answer = exchange(server, f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode("latin-1"))
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:100]
    assert answer.count(b"HTTP/1.1 ") == 1
    assert_quiet(caplog)
    assert len([r for r in caplog.records if r.name.startswith("kvsidecar")]) <= 1


def test_absolute_form_target_is_served(server: WebServer) -> None:
    answer = exchange(server, b"GET http://[::1]:9400/-/healthy?x HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET /metrics HTTP/1.1\r\nHost : x\r\n\r\n", 400),  # space before the colon
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nNoColon\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nX: a\x01b\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nX: \xff\xfe\r\n\r\n", 200),  # opaque value
        (b"GET /metrics HTTP/1.1\r\nHost: x", 400),  # half-closed mid-head
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 200),
        (b"\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 200),  # an empty line first is allowed
        (b"GET  /metrics HTTP/1.1\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1 x\r\n\r\n", 400),
        (b"GET /metrics HTTP/2.0\r\n\r\n", 505),
        (b"G(T /metrics HTTP/1.1\r\n\r\n", 400),
        (b"\x16\x03\x01\x00\x05hello\r\n\r\n", 400),  # TLS to the plain port
    ],
)
def test_malformed_heads(
    server: WebServer, caplog: pytest.LogCaptureFixture, head: bytes, status: int
) -> None:
    caplog.set_level(logging.DEBUG)
    assert exchange(server, head).startswith(b"HTTP/1.1 %d " % status)
    assert_quiet(caplog)


_text = st.text(st.characters(codec="latin-1"), max_size=40)
_method = st.sampled_from(["GET", "HEAD", "POST", "get", "G ET", ""]) | _text
_target = (
    st.sampled_from(["/metrics", "/-/healthy", "http://[::1/metrics", "http://h/-/ready", "*"])
    | _text
)
_version = st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/1.x", "HTTP/11", ""]) | _text
_header_name = st.sampled_from(["Host", "Connection", "Content-Length", "Transfer-Encoding"])


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    method=_method,
    target=_target,
    version=_version,
    headers=st.lists(st.tuples(_header_name | _text, _text), max_size=6),
    eol=st.sampled_from(["\r\n", "\n"]),
)
def test_fuzzed_heads_always_get_an_answer(
    server: WebServer,
    caplog: pytest.LogCaptureFixture,
    method: str,
    target: str,
    version: str,
    headers: list[tuple[str, str]],
    eol: str,
) -> None:
    caplog.clear()
    caplog.set_level(logging.DEBUG)
    head = f"{method} {target} {version}{eol}" + "".join(f"{k}: {v}{eol}" for k, v in headers)
    data = (head + eol).encode("latin-1")
    answer = exchange(server, data)
    if data.strip(b"\r\n"):
        assert answer.startswith(b"HTTP/1.1 "), (data, answer[:80])
    assert_quiet(caplog)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(min_size=1, max_size=300))
def test_fuzzed_bytes_always_get_an_answer(server: WebServer, data: bytes) -> None:
    answer = exchange(server, data)
    if data.strip(b"\r\n"):
        assert answer.startswith(b"HTTP/1.1 "), (data, answer[:80])
