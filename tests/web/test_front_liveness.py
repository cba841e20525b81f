"""The HTTP front stays answered under unauthenticated attacks (issue 24 item 1), against
the real ``kvsidecar serve`` subprocess, with the attackers of ``kvsidecar bench
frontmix``/``scrapeflood`` (from 127.0.0.2: another client address on loopback).

The criterion is the kubelet's: a probe answered within its timeout (2 s in our
manifests). On cb621d7 pipelining held probes ~2 s, slow readers at the connection cap
left nothing answered, a replayed ClientHello starved TLS probes, and 40 keep-alive
scrapers got a 41st 503s. Each test samples ~5 s of probes and takes 10-25 s.
"""

from __future__ import annotations

import contextlib
import resource
import shutil
import socket
import ssl
import tempfile
from collections.abc import Iterator

import pytest

from kvsidecar.bench.fleet import start_daemon, stop_daemon
from tests.attacks import hostile_front as hf
from tests.attacks.hostile_clients import _probe

PROBE_TIMEOUT_S = 2.0  # the manifests' timeoutSeconds
# Of the probes, answered 200 within PROBE_TIMEOUT_S. Below 1 because the test host runs
# CPU burners beside us; the defects measured 0-60 % here.
ANSWERED = 0.9

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@contextlib.contextmanager
def daemon(*args: str, nofile: int = 0, context: ssl.SSLContext | None = None) -> Iterator[int]:
    def limit() -> None:
        if nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    shm = tempfile.mkdtemp(prefix="kvsidecar-front-", dir="/dev/shm")
    proc, url = start_daemon(shm, *args, wait_for_source=False, context=context, preexec_fn=limit)
    try:
        yield int(url.rsplit(":", 1)[1])
    finally:
        stop_daemon(proc)
        shutil.rmtree(shm, ignore_errors=True)


def answered(port: int, ctx: ssl.SSLContext | None = None, path: str = "/-/healthy") -> float:
    samples = hf.sample(lambda: _probe(port, path, ctx, timeout=PROBE_TIMEOUT_S), 5.0, 0.1)
    return sum(ok for ok, _ in samples) / len(samples)


def test_probes_answered_beside_pipelining() -> None:
    with daemon() as port:
        attack = hf.Pipeliners(port, 20).start()
        try:
            share = answered(port)
        finally:
            attack.stop()
        assert attack.sent > 1000, "the pipelining attack ran"
    assert share >= ANSWERED, f"{share:.0%} of probes answered beside 20 pipelining connections"


def test_probes_answered_beside_slow_readers_at_the_connection_cap() -> None:
    # 256 descriptors: a connection cap of 128, and 200 clients that never read.
    with daemon(nofile=256) as port:
        attack = hf.SlowReaders(port, 200).start()
        try:
            share = answered(port)
        finally:
            attack.stop()
        assert attack.connects >= 128, "the cap was reached"
    assert share >= ANSWERED, f"{share:.0%} of probes answered beside 200 slow readers"


@pytest.fixture(scope="module")
def rsa_pki() -> Iterator[tuple[str, str]]:
    with tempfile.TemporaryDirectory(prefix="kvsidecar-front-") as tmp:
        yield hf.rsa_self_signed(tmp)  # RSA-4096: the expensive handshake


def test_tls_probes_answered_beside_a_replayed_client_hello(rsa_pki: tuple[str, str]) -> None:
    with hf.tls_daemon(*rsa_pki) as (_proc, port, ctx):
        attack = hf.HelloReplay(port, hf.canned_client_hello(ctx)).start()
        try:
            share = answered(port, ctx)
        finally:
            attack.stop()
        assert attack.sent > 100, "the replay ran"
    assert share >= ANSWERED, f"{share:.0%} of TLS probes answered beside a ClientHello replay"


def test_legitimate_scraper_beside_40_keep_alive_scrapers() -> None:
    with daemon() as port:
        flood = hf.KeepAliveScrapers(port, 40).start()
        try:
            # Prometheus' scrape timeout: 10 s by default.
            samples = hf.sample(lambda: _probe(port, "/metrics", None, timeout=10.0), 6.0, 0.5)
        finally:
            flood.stop()
        assert flood.sent > 100, "the flood ran"
    rate = sum(ok for ok, _ in samples) / len(samples)
    assert rate >= ANSWERED, f"{rate:.0%} of scrapes answered beside 40 keep-alive scrapers"


def test_replayed_hello_costs_no_handshake(rsa_pki: tuple[str, str]) -> None:
    """The replay filter itself: the second copy of a hello is closed unanswered (no
    ServerHello, so no signature), while a fresh hello gets one."""
    with hf.tls_daemon(*rsa_pki) as (_proc, port, ctx):
        hello = hf.canned_client_hello(ctx)

        def server_hello(data: bytes) -> bytes:
            with socket.create_connection(("127.0.0.1", port), 5) as s:
                s.sendall(data)
                with contextlib.suppress(OSError):
                    return s.recv(5)
                return b""

        assert server_hello(hello)[:1] == b"\x16", "a first hello is answered"
        assert server_hello(hello) == b"", "its replay is closed before any crypto"
        assert server_hello(hf.canned_client_hello(ctx))[:1] == b"\x16"
