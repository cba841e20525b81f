"""What idle connections may cost the daemon, against a real `kvsidecar serve` (#24).

1,000 idle TLS connections took the daemon to 95-103 MB RSS, above the Kubernetes
sidecar's 64Mi: up to ~63 KB each (a request head nearly at its 16 KB limit, never
finished). Open connections are now capped by a memory budget (`CONNECTION_MEMORY`,
each counted at an upper bound of what it can keep), and TLS ciphertext passes
through OpenSSL's memory BIOs 4 KB at a time. Counts and RSS, no timing.
"""

from __future__ import annotations

from kvsidecar.bench.hostile_fds import run_tlsidle
from kvsidecar.web.server import (
    CONNECTION_MEMORY,
    PLAIN_CONNECTION_BYTES,
    TLS_CONNECTION_BYTES,
)

SLACK = 16  # connections accepted and not yet closed while the cap evicts


def test_idle_tls_connections_stay_within_the_memory_budget() -> None:
    """600 TLS connections (P-256) each holding 15 KB of an unfinished request head:
    at most CONNECTION_MEMORY / TLS_CONNECTION_BYTES kept, and the daemon's RSS grows
    by at most 1.5 x CONNECTION_MEMORY (18 MiB; the kept ones measure ~8-10 MiB, and
    evicted ones' memory goes back to the allocator). Was: all 600 kept, +37 MB. ~6 s."""
    (row,) = run_tlsidle(cert="p256", mode="half-head", counts=(600,))["rows"]
    assert row["kept_open"] <= CONNECTION_MEMORY // TLS_CONNECTION_BYTES + SLACK, row
    grown = (row["rss_mb"] - row["baseline_rss_mb"]) * 2**20
    assert grown <= 1.5 * CONNECTION_MEMORY, row
    # The estimate per connection is an upper bound of what each kept one costs.
    assert grown / max(1, row["kept_open"]) <= 1.5 * TLS_CONNECTION_BYTES, row


def test_idle_plain_connections_are_capped_by_the_memory_budget() -> None:
    """800 plain connections with such a head (~22-30 KB each): at most
    CONNECTION_MEMORY / PLAIN_CONNECTION_BYTES kept. Was: all 800 (+17 MB). ~3 s."""
    (row,) = run_tlsidle(cert="none", mode="half-head", counts=(800,))["rows"]
    assert row["kept_open"] <= CONNECTION_MEMORY // PLAIN_CONNECTION_BYTES + SLACK, row
    grown = (row["rss_mb"] - row["baseline_rss_mb"]) * 2**20
    assert grown <= 1.5 * CONNECTION_MEMORY, row


def test_the_connection_memory_flag_sets_the_cap() -> None:
    """`--web.connection-memory-bytes 1 MiB`: at most 32 plain connections kept of 200
    (the default would keep all 200). The operator with a larger memory limit raises it."""
    (row,) = run_tlsidle(
        cert="none",
        mode="half-head",
        counts=(200,),
        serve_args=("--web.connection-memory-bytes", str(1 << 20)),
    )["rows"]
    assert row["kept_open"] <= (1 << 20) // PLAIN_CONNECTION_BYTES + SLACK, row
