"""The daemon-wide budget (issue 24 item 2): N conforming targets cannot cost N times the
memory. On cb621d7, 8 maximal conforming targets (64 pools, 256-character labels) took
237 MB RSS against 40 MB for one, and 32 took 771 MB. Real writer processes, the real
``kvsidecar serve``; ~15 s."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator

import msgspec
import pytest

from kvsidecar.bench.publish import realistic_snapshot
from tests.attacks import hostile_writers as hw
from tests.attacks.worst_target import payload

# The most costly target one default aggregate budget serves (48 pools, every label 256
# bytes; 64 such pools alone exceed it and are shed since issue 31).
MAXIMAL = payload(1, 256, 48)
SMALL = msgspec.msgpack.encode(realistic_snapshot(2))


@pytest.fixture
def shm() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvsidecar-total-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run(shm: str, payloads: dict[str, bytes]) -> tuple[float, dict[str, dict]]:
    """Peak RSS (MB) after three scrapes, and the targets' JSON records by segment."""
    pids = [hw.raw_writer(shm, name, p, 64 * 1024) for name, p in payloads.items()]
    try:
        time.sleep(0.5)
        with hw._daemon(shm) as (daemon, url):
            time.sleep(1.5)
            for _ in range(3):
                assert hw._scrape(url, timeout=60)[0] == 200
            with urllib.request.urlopen(url + "/api/v1/snapshots", timeout=60) as r:
                records = {t["segment"]: t for t in json.loads(r.read())["targets"]}
            return hw._peak_rss(daemon.pid) / 2**20, records
    finally:
        hw._kill(pids)


def test_rss_does_not_grow_with_maximal_targets(shm: str) -> None:
    one, _ = run(shm, {"kvsidecar.max0.dp0.tp0.pp0": MAXIMAL})
    shutil.rmtree(shm)
    shm2 = tempfile.mkdtemp(prefix="kvsidecar-total-", dir="/dev/shm")
    try:
        eight, records = run(shm2, {f"kvsidecar.max{i}.dp0.tp0.pp0": MAXIMAL for i in range(8)})
    finally:
        shutil.rmtree(shm2, ignore_errors=True)
    # A ratio against one target in the same test: 5.9x on cb621d7, ~1.0x now.
    assert eight < 1.5 * one, f"8 maximal targets: {eight:.0f} MB RSS vs {one:.0f} MB for one"
    states = sorted(t["state"] for t in records.values())
    assert states.count("up") >= 1, "never every engine"
    shed = [t for t in records.values() if t["state"] == "refused"]
    assert shed and all("--max-exposition-bytes" in t["error"] for t in shed), shed[:1]


def test_the_largest_are_shed_the_small_ones_served(shm: str) -> None:
    payloads = {f"kvsidecar.small{i}.dp0.tp0.pp0": SMALL for i in range(6)}
    payloads |= {f"kvsidecar.big{i}.dp0.tp0.pp0": MAXIMAL for i in range(2)}
    _, records = run(shm, payloads)
    state = {name: t["state"] for name, t in records.items()}
    assert all(state[f"kvsidecar.small{i}.dp0.tp0.pp0"] == "up" for i in range(6)), state
    assert sorted(state[f"kvsidecar.big{i}.dp0.tp0.pp0"] for i in range(2)) == ["refused", "up"]
