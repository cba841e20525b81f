"""HTTP/1.x request heads: a strict parser and the response head, no I/O.

Every malformed input is a `BadRequest` carrying the status to answer (400, 405,
414, 431, 505) and a short reason for the one log line; nothing else escapes
`parse_head`, so no request, however broken, can produce a traceback or go
unanswered (tests/web/test_request_fuzz.py drives it with hypothesis).
"""

from __future__ import annotations

import email.utils
import http
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "MAX_HEADERS",
    "MAX_HEAD_BYTES",
    "MAX_REQUEST_LINE",
    "BadRequest",
    "Request",
    "parse_head",
    "response_head",
]

# Far above what Prometheus, curl or a kubelet send (a few hundred bytes), low enough
# that 1,000 half-sent requests cost at most ~32 MB (asyncio buffers up to twice this).
MAX_REQUEST_LINE = 8192  # over: 414
MAX_HEAD_BYTES = 16384  # request line + headers; over: 431
MAX_HEADERS = 100  # over: 431

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(r"HTTP/(\d)\.(\d)")
_TARGET = re.compile(r"[\x21-\x7e]+")  # visible ASCII: no controls, spaces or non-ASCII
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # controls other than HT


class BadRequest(Exception):
    """A request that is answered with ``status`` and closed; ``reason`` is for the log."""

    def __init__(self, status: int, reason: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.headers = dict(headers or {})


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    path: str  # the target's path, without query or fragment (routes are exact paths)
    version: tuple[int, int]
    headers: Mapping[str, str] = field(default_factory=dict)  # lower-case names
    keep_alive: bool = True
    has_body: bool = False  # never read: such a connection is closed after the answer

    @property
    def request_line(self) -> str:
        return f"{self.method} {self.target} HTTP/{self.version[0]}.{self.version[1]}"

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name.lower(), default)


def _path_of(target: str) -> str:
    if target.startswith("/"):
        return target.split("?", 1)[0].split("#", 1)[0]
    # absolute-form (RFC 9112 3.2.2), as sent to proxies: http://host[:port]/path
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        raise BadRequest(400, "request target is neither /path nor http://host/path")
    authority, slash, tail = rest.partition("/")
    if not authority or "@" in authority:
        raise BadRequest(400, "request target has no usable host")
    if authority.startswith("["):
        host, close, port = authority[1:].partition("]")
        if not close or not host or (port and not re.fullmatch(r":\d{0,5}", port)):
            raise BadRequest(400, "request target has a malformed [IPv6] host")
    elif authority.count(":") > 1 or not re.fullmatch(r"[^:]+(:\d{0,5})?", authority):
        raise BadRequest(400, "request target has a malformed host:port")
    return ("/" + tail if slash else "/").split("?", 1)[0].split("#", 1)[0]


def _request_line(line: str) -> tuple[str, str, tuple[int, int]]:
    words = line.split(" ")
    if len(words) == 2 and words[0] and words[1]:
        raise BadRequest(400, "HTTP/0.9 requests are not supported")
    if len(words) != 3 or not all(words):
        raise BadRequest(400, "malformed request line")
    method, target, version_text = words
    if not _TOKEN.fullmatch(method):
        raise BadRequest(400, "malformed method")
    m = _VERSION.fullmatch(version_text)
    if not m:
        raise BadRequest(400, "malformed HTTP version")
    version = (int(m.group(1)), int(m.group(2)))
    if version[0] != 1:
        raise BadRequest(505, f"HTTP version {version_text} not supported")
    if not _TARGET.fullmatch(target):
        raise BadRequest(400, "malformed request target")
    return method, target, version


def _content_length(headers: Mapping[str, str]) -> int:
    """RFC 9112 6.3: a list of Content-Length values (repeated headers arrive joined by
    commas) is only acceptable when every member is the same number; anything else
    means the message's end is ambiguous, the shape of request smuggling."""
    values = {v.strip(" \t") for v in headers.get("content-length", "0").split(",")}
    if len(values) != 1:
        raise BadRequest(400, "conflicting Content-Length values")
    (length,) = values
    if not length.isdigit() or not length.isascii():
        raise BadRequest(400, "malformed Content-Length")
    return int(length)


def parse_head(lines: Sequence[bytes]) -> Request:
    """Parse a request line and header lines (each ending in LF or CRLF, without the
    empty line that ends the head). Raises `BadRequest` for anything malformed."""
    if not lines:
        raise BadRequest(400, "empty request")
    if len(lines) - 1 > MAX_HEADERS:
        raise BadRequest(431, f"more than {MAX_HEADERS} header fields")
    decoded = []
    for raw in lines:
        text = raw.decode("latin-1")  # never fails; non-ASCII is rejected below
        text = text[:-2] if text.endswith("\r\n") else text.rstrip("\n")
        if "\r" in text or "\n" in text or "\x00" in text:
            raise BadRequest(400, "stray CR, LF or NUL in the request head")
        decoded.append(text)
    if len(decoded[0]) > MAX_REQUEST_LINE:
        raise BadRequest(414, "request line too long")
    method, target, version = _request_line(decoded[0])
    headers: dict[str, str] = {}
    for text in decoded[1:]:
        if text[:1] in (" ", "\t"):
            raise BadRequest(400, "obsolete header line folding")
        name, colon, value = text.partition(":")
        if not colon or not _TOKEN.fullmatch(name):
            raise BadRequest(400, "malformed header field")
        value = value.strip(" \t")
        if _BAD_VALUE.search(value):
            raise BadRequest(400, f"control character in header {name}")
        key = name.lower()
        if key in headers:
            if key == "host":  # RFC 9112 3.2: more than one Host is a 400
                raise BadRequest(400, "more than one Host header")
            headers[key] = f"{headers[key]}, {value}"
        else:
            headers[key] = value
    if version >= (1, 1) and "host" not in headers:
        raise BadRequest(400, "HTTP/1.1 request without a Host header")
    has_body = "transfer-encoding" in headers or _content_length(headers) > 0
    connection = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep_alive = "keep-alive" in connection if version < (1, 1) else "close" not in connection
    path = _path_of(target)  # "*" (asterisk-form) is for OPTIONS only: 400 too
    request = Request(method, target, path, version, headers, keep_alive and not has_body, has_body)
    if method not in ("GET", "HEAD"):
        raise BadRequest(405, f"method {method} not allowed", {"Allow": "GET, HEAD"})
    return request


def response_head(
    status: int, headers: Mapping[str, str] | Sequence[tuple[str, str]], *, close: bool
) -> bytes:
    """Status line and headers, with Server and Date as the stdlib server sends them."""
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    items = headers.items() if isinstance(headers, Mapping) else headers
    lines = [
        f"HTTP/1.1 {status} {phrase}",
        "Server: kvsidecar",
        f"Date: {email.utils.formatdate(usegmt=True)}",
        *(f"{k}: {v}" for k, v in items),
    ]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
