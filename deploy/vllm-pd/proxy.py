#!/usr/bin/env python3
"""A small P/D proxy for vLLM's NixlConnector (stdlib only: runs in any Python 3.9+).

It follows the protocol of vLLM's toy proxy
(tests/v1/kv_connector/nixl_integration/toy_proxy_server.py): each OpenAI completion
(or chat completion) goes first to the prefill server with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true, ...}``; prefill answers with the
``kv_transfer_params`` decode needs (its engine id, block ids, host, port, request id),
and the original body plus those params goes to the decode server, whose answer
(streamed or not) is relayed to the client. Prefill keeps the blocks until decode has
READ them, or until its lease (``kv_lease_duration``) runs out.

    python3 deploy/vllm-pd/proxy.py --prefill 127.0.0.1:8100 --decode 127.0.0.1:8200 --port 8000

``--decode-delay S`` (or a request header ``X-PD-Decode-Delay: S``) waits S seconds between
the two halves, like a decode queue: prefill holds the KV that long at least. The
response carries prefill's params as the header ``X-PD-Transfer-Params`` (JSON).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PATHS = ("/v1/completions", "/v1/chat/completions")
TIMEOUT_S = 600.0


def parse_addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT, e.g. 127.0.0.1:8100")
    return host or "127.0.0.1", int(port)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill half: one token, not streamed, asking prefill to keep the KV for decode."""
    req = dict(body)
    req["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    req["stream"] = False
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req.pop("stream_options", None)
    return req


def _post(addr: tuple[str, int], path: str, body: dict[str, Any], request_id: str):
    conn = http.client.HTTPConnection(addr[0], addr[1], timeout=TIMEOUT_S)
    conn.request(
        "POST",
        path,
        json.dumps(body),
        {"Content-Type": "application/json", "X-Request-Id": request_id},
    )
    return conn, conn.getresponse()


def prefill(
    addr: tuple[str, int], path: str, body: dict[str, Any], request_id: str
) -> dict[str, Any]:
    """Run the prefill half; return the kv_transfer_params decode needs (RuntimeError if
    prefill fails or returns none: then it is not a kv_producer)."""
    conn, resp = _post(addr, path, prefill_body(body), request_id)
    try:
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"prefill answered {resp.status}: {data[:300]!r}")
        params = json.loads(data).get("kv_transfer_params")
        if not params:
            raise RuntimeError(
                "prefill returned no kv_transfer_params: start it with --kv-transfer-config "
                '\'{"kv_connector":"NixlConnector","kv_role":"kv_producer",...}\''
            )
        return params
    finally:
        conn.close()


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    return {**body, "kv_transfer_params": params}


class Handler(BaseHTTPRequestHandler):
    server: ProxyServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # one line per request, to stderr
        sys.stderr.write("proxy: " + (fmt % args) + "\n")

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path in ("/health", "/healthz"):
            self._reply(200, {"status": "ok"})
        else:
            self._reply(404, {"error": f"no route {self.path}; POST one of {PATHS}"})

    def do_POST(self) -> None:
        if self.path not in PATHS:
            self._reply(404, {"error": f"no route {self.path}; POST one of {PATHS}"})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            delay = float(self.headers.get("X-PD-Decode-Delay") or self.server.decode_delay)
        except ValueError as e:
            self._reply(400, {"error": f"bad request: {e}"})
            return
        rid = self.headers.get("X-Request-Id") or str(uuid.uuid4())
        try:
            params = prefill(self.server.prefill_addr, self.path, body, rid)
        except (OSError, RuntimeError, ValueError) as e:
            self._reply(502, {"error": f"prefill {self.server.prefill_addr}: {e}"})
            return
        if delay > 0:
            time.sleep(delay)
        try:
            conn, resp = _post(self.server.decode_addr, self.path, decode_body(body, params), rid)
        except OSError as e:
            self._reply(502, {"error": f"decode {self.server.decode_addr}: {e}"})
            return
        try:
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.getheader("Content-Type") or "application/json")
            self.send_header("X-PD-Transfer-Params", json.dumps(params))
            self.send_header("Connection", "close")
            self.end_headers()
            while chunk := resp.read1(65536):  # relay as it comes (SSE streams too)
                self.wfile.write(chunk)
                self.wfile.flush()
        except OSError:
            pass  # the client or decode went away mid-answer
        finally:
            conn.close()
            self.close_connection = True


class ProxyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        listen: tuple[str, int],
        prefill_addr: tuple[str, int],
        decode_addr: tuple[str, int],
        decode_delay: float = 0.0,
    ) -> None:
        super().__init__(listen, Handler)
        self.prefill_addr = prefill_addr
        self.decode_addr = decode_addr
        self.decode_delay = decode_delay

    def start(self) -> threading.Thread:
        """Serve from a thread (for tests); stop with shutdown()."""
        t = threading.Thread(target=self.serve_forever, name="pd-proxy", daemon=True)
        t.start()
        return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", type=parse_addr, required=True, help="prefill HOST:PORT")
    p.add_argument("--decode", type=parse_addr, required=True, help="decode HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--decode-delay", type=float, default=0.0, metavar="S")
    a = p.parse_args(argv)
    try:
        server = ProxyServer((a.host, a.port), a.prefill, a.decode, a.decode_delay)
    except OSError as e:
        print(
            f"proxy: cannot listen on {a.host}:{a.port}: {e} (pick another --port)", file=sys.stderr
        )
        return 2
    print(f"proxy: http://{a.host}:{a.port} -> prefill {a.prefill}, decode {a.decode}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
