"""``kvsidecar bench worsttarget``: daemon RSS with one target as costly as a segment can
make it (issue 31 items 1 and 2).

One real writer publishes every string field (engine, model_name, role, engine_version,
device, instance, schema_version untouched; pool_name, pool_type, integration) at a given
length in characters of a given UTF-8 width (1 = ASCII, 4 = an emoji), every optional
number set (the most series per pool), with a given number of pools. The real ``kvsidecar
serve`` runs over it with its default budgets and is scraped (text, OpenMetrics, JSON) a
few times; reported per shape: whether it was served, the body size and the daemon's
peak RSS (VmHWM). With ``--old CHECKOUT`` each shape also runs a daemon from that
checkout (its PYTHONPATH), side by side. A shape of 256 characters is what a daemon
counting characters accepted; 256 bytes is what one counting bytes accepts.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import tempfile
import time
import urllib.request
from typing import Any

import msgspec

from kvsidecar.bench.publish import realistic_snapshot
from kvsidecar.protocol.schema import KVCachePoolSnapshot, Snapshot
from tests.attacks import hostile_writers as hw

MB = 1024 * 1024
# One character per UTF-8 width; 0: a double quote, 1 byte that the exposition escapes to 2.
CHARS = {0: '"', 1: "a", 2: "\u00e9", 3: "\u20ac", 4: "\U0001f600"}
LABEL = 256  # the default --max-label-length
# (width, characters, pools): the old rule's worst (256 characters, whatever their width)
# and the new one's (256 bytes), at the 48 pools and the default maximum 64; pools
# 0 = the most this checkout's default aggregate budget serves (its worst conforming).
SHAPES = [(w, n, p) for w in (1, 2, 4) for n in sorted({LABEL, LABEL // w}) for p in (48, 64)]
SHAPES += [(0, LABEL, 48)]  # double quotes: within the old estimate, twice its size exposed
SHAPES += [(w, LABEL // max(w, 1), 0) for w in (0, 1, 2, 3, 4)]
QUICK_SHAPES = [(1, 256, 48), (4, 256, 48), (4, 64, 0)]


def payload(width: int, chars: int, pools: int) -> bytes:
    text = CHARS[width] * chars
    snap = realistic_snapshot(pools)
    r = snap.runtime
    r.engine = r.model_name = r.role = r.engine_version = r.device = r.instance = text
    r.requests_deferred_free_distinct = r.preemptions_total = 1
    optional = [
        f
        for f in KVCachePoolSnapshot.__struct_fields__
        if getattr(snap.pools[0], f) is None and f != "integration"
    ]
    for i, p in enumerate(snap.pools):
        # Distinct per pool (a duplicate would be renamed, not cheaper), same length.
        p.pool_name = f"{i:03d}" + text[3:]
        p.pool_type = p.integration = text
        p.group_id = i
        for f in optional:
            setattr(p, f, False if f == "null_block_reserved" else 7)
    return msgspec.msgpack.encode(snap)


# Every kind of reader at once, as an HA pair of Prometheus, a gateway and a dashboard do.
_READERS = [
    ("/metrics", {"Accept": "text/plain"}),
    ("/metrics", {"Accept": "text/plain", "Accept-Encoding": "gzip"}),
    ("/metrics", {"Accept": "application/openmetrics-text"}),
    ("/metrics", {"Accept": "application/openmetrics-text", "Accept-Encoding": "gzip"}),
    ("/api/v1/snapshots", {}),
]


def _read(url: str, path: str, headers: dict[str, str]) -> bytes:
    req = urllib.request.Request(url + path, headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


def _scrape_all(url: str, rounds: int) -> tuple[int, bool]:
    """Body size of the text exposition and whether the target is up in it, after
    `rounds` of every reader at once."""
    with concurrent.futures.ThreadPoolExecutor(len(_READERS)) as pool:
        for _ in range(rounds):
            list(pool.map(lambda r: _read(url, *r), _READERS))
    text = _read(url, "/metrics", {"Accept": "text/plain"})
    served = any(
        line.startswith(b"kvsidecar_source_up{") and line.endswith(b" 1.0")
        for line in text.splitlines()
    )
    return len(text), served


def most_pools(width: int, chars: int) -> int:
    """The most pools (up to the default 64) whose target this checkout's default aggregate
    budget still serves."""
    from kvsidecar.daemon.budget import DEFAULT_MAX_EXPOSITION_BYTES, exposition_estimate

    name = "kvsidecar.worst.dp0.tp0.pp0"
    decode = msgspec.msgpack.Decoder(Snapshot).decode
    fits = [
        p
        for p in range(1, 65)
        if exposition_estimate(decode(payload(width, chars, p)), name)
        <= DEFAULT_MAX_EXPOSITION_BYTES
    ]
    return max(fits, default=1)


def one_shape(
    width: int, chars: int, pools: int, scrapes: int = 3, pythonpath: str = ""
) -> dict[str, Any]:
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-worst-", dir="/dev/shm")
    body = payload(width, chars, pools)
    pid = hw.raw_writer(shm_dir, "kvsidecar.worst.dp0.tp0.pp0", body, 512 * 1024)
    try:
        time.sleep(0.5)
        # `python -m` puts the working directory first on sys.path: run it in the checkout.
        popen = {"env": dict(os.environ, PYTHONPATH=pythonpath), "cwd": pythonpath}
        with hw._daemon(shm_dir, **(popen if pythonpath else {})) as (daemon, url):
            time.sleep(1.5)  # discovered, admitted, polled
            size, served = _scrape_all(url, scrapes)
            return {
                "width": width,
                "chars": chars,
                "label_bytes": len(CHARS[width].encode()) * chars,  # before escaping
                "pools": pools,
                "payload_bytes": len(body),
                "served": served,
                "body_bytes": size,
                "peak_rss_mb": round(hw._peak_rss(daemon.pid) / MB, 1),
            }
    finally:
        hw._kill([pid])
        shutil.rmtree(shm_dir, ignore_errors=True)


def run(*, quick: bool = False, old: str = "") -> dict[str, Any]:
    shapes = QUICK_SHAPES if quick else SHAPES
    rows = []
    for w, n, p in shapes:
        s = (w, n, p or most_pools(w, n))
        row = one_shape(*s)
        if old:  # the same shape against the old daemon, right after
            was = one_shape(*s, pythonpath=old)
            row |= {"old_served": was["served"], "old_body_bytes": was["body_bytes"],
                    "old_peak_rss_mb": was["peak_rss_mb"]}  # fmt: skip
        rows.append(row)
    out: dict[str, Any] = {"old": old, "rows": rows}
    for key in ("", "old_") if old else ("",):
        served = [r for r in rows if r.get(key + "served")]
        out[key + "worst_served_rss_mb"] = max(
            (r[key + "peak_rss_mb"] for r in served), default=0.0
        )
        # RSS per byte of exposition: the largest body served against the smallest seen.
        big = max(served, key=lambda r: r[key + "body_bytes"], default=None)
        small = min(rows, key=lambda r: r[key + "body_bytes"])
        if big is not None and big[key + "body_bytes"] > 2 * small[key + "body_bytes"]:
            d_rss = (big[key + "peak_rss_mb"] - small[key + "peak_rss_mb"]) * MB
            d_body = big[key + "body_bytes"] - small[key + "body_bytes"]
            out[key + "rss_per_body_byte"] = round(d_rss / d_body, 1)
    return out
