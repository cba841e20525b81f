"""TLS probes from an address that floods fresh ClientHellos (issue 31 shape 5): 64
addresses, the prober's 127.0.0.1 among them, each sending hellos with a fresh random,
half hanging up at once, half staying silent. Before: the gate queued every whole hello
(~4,000, most of their clients gone by their turn) and handed them to the front oldest
first, per address in turn; a probe waited behind its neighbour's queue past its timeout,
or was evicted at the gate's cap: 0-2 of ~20 answered. Now a hello whose client hung up
is closed at the gate (also while queued), the front takes a few hellos at a time, the
newest of each address first, and addresses whose clients completed handshakes lately
go first. A real ``kvsidecar serve`` (the attack's threads must not share its GIL);
counted, never timed: a probe either completes within its timeout or not."""

from __future__ import annotations

import ssl
import tempfile
import time

from tests.attacks import front_shapes as fs
from tests.attacks.hostile_clients import _daemon, _probe, _raise_nofile, _self_signed
from tests.attacks.hostile_front import web_config_for

PROBES = 20
PROBE_TIMEOUT_S = 2.0  # a kubelet waits 1 s; twice that for a shared CI host


def test_tls_probes_are_answered_from_an_address_that_floods_hellos() -> None:
    _raise_nofile(4096)
    with tempfile.TemporaryDirectory(prefix="kvsidecar-test-") as tmp:
        cert, key = _self_signed(tmp)  # ECDSA P-256: the crypto is not what is measured
        ctx = ssl.create_default_context(cafile=cert)
        with _daemon(web_config_for(tmp, cert, key), ctx) as (_daemon_proc, url):
            port = int(url.rsplit(":", 1)[1])
            with fs._Threads(64, lambda k, stop: fs._fresh_hellos(port, ctx, k, stop)):
                time.sleep(2.0)
                answered = 0
                for _ in range(PROBES):
                    ok, _took = _probe(port, "/-/healthy", ctx, timeout=PROBE_TIMEOUT_S)
                    answered += ok
                    time.sleep(0.1)
    assert answered >= PROBES * 0.8, f"{answered}/{PROBES} TLS probes answered"
