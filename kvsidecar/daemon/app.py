"""The daemon's handlers: metrics (cached per poll), JSON snapshots, readiness.

Rendering 8 ranks x 4 pools costs ~3 ms, polling them ~0.2 ms; a gateway may
scrape at 20 Hz from several clients. So the body is rendered at most once
per poll cycle and format, and every scrape in between gets the same bytes.
A scrape that finds the last poll older than the poll interval polls first
(`TargetSet.refresh_if_older`), so a scrape never sees data older than one
interval.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import Metric
from prometheus_client.openmetrics import exposition as openmetrics

from kvsidecar.daemon.collector import SnapshotCollector
from kvsidecar.daemon.exposition import CONTENT_TYPE, render_text
from kvsidecar.daemon.target import UP, TargetView
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol.schema import to_dict
from kvsidecar.web.stats import HTTPStats

_JSON = msgspec.json.Encoder()
REFUSED_LIST_MAX = 64  # refused files named in /api/v1/snapshots, whatever others create


def view_record(view: TargetView, now_mono_ns: int | None = None) -> dict[str, Any]:
    """A keyed JSON-ready record of a target. Values are under ``snapshot`` only when up;
    otherwise the last good one is under ``last_snapshot``, never passed off as fresh."""
    record: dict[str, Any] = {
        "segment": view.name,
        "state": view.state,
        "error": view.error or None,
        # Why, as a stable name (segment-format.md section 8: closed, publish_failing, ...).
        "error_kind": view.error_kind or None,
        "age_seconds": None,
        "writer_restarts_total": view.writer_restarts_total,
        "read_retries_total": view.read_retries_total,
        "decode_errors_total": view.decode_errors_total,
    }
    last = view.last
    if last is not None:
        record.update(
            age_seconds=round(view.age_seconds(now_mono_ns) or 0.0, 3),  # the daemon's clock
            seq=last.seq,
            incarnation=last.incarnation,
            generation=last.generation,
            writer_pid=last.writer_pid,
        )
        record["snapshot" if view.state == UP else "last_snapshot"] = to_dict(last.snapshot)
    return record


class Daemon:
    """Implements the HTTP layer's `Handlers` over a `TargetSet`."""

    def __init__(
        self,
        targets: TargetSet,
        *,
        http_stats: HTTPStats | None = None,
        ready_requires_source: bool = False,
        exporter_metrics: bool = True,
    ) -> None:
        self.targets = targets
        self.http_stats = http_stats or HTTPStats()
        self.ready_requires_source = ready_requires_source
        self.exporter_metrics = exporter_metrics
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = SnapshotCollector(targets.views, self._daemon_stats, self._http_stats)
        self.registry.register(_Filtered(self.collector, exporter_metrics))
        # The standard process_* and python_* self-metrics every Python exporter has
        # (--web.disable-exporter-metrics leaves them out, as node_exporter does go_*).
        self._self_registry = CollectorRegistry(auto_describe=False)
        if exporter_metrics:
            for c in (ProcessCollector, PlatformCollector, GCCollector):
                c(registry=self._self_registry)
            self.registry.register(_Chain(self._self_registry))
        self._cache: dict[str, tuple[int, bytes]] = {}
        self._ready_cache: tuple[tuple, tuple[bool, str]] | None = None
        # The gateway's PollServer, when --gateway.listen-address is set: its counts only.
        self.gateway_server: Any = None
        self.load_push: Any = None  # kvsidecar/streams/load_push.py, while --load-push is on
        # The OTLP Pusher, when --otlp.endpoint is set: its drop counts only.
        self.otlp_pusher: Any = None
        self._render_lock = threading.Lock()

    # -- Handlers ---------------------------------------------------------------

    def metrics(self, accept_header: str) -> tuple[bytes, str]:
        self.targets.refresh_if_older(self.targets.poll_interval)
        if "application/openmetrics-text" in (accept_header or ""):
            return self._render("om", self._render_openmetrics), openmetrics.CONTENT_TYPE_LATEST
        return self._render("text", self._render_text), CONTENT_TYPE

    def snapshots_json(self) -> bytes:
        self.targets.refresh_if_older(self.targets.poll_interval)
        now = time.monotonic_ns()
        records = [view_record(v, now) for v in self.targets.views()]
        refused = [
            {"file": name, "reason": reason, "why": why}
            for name, reason, why in self.targets.refused_files(REFUSED_LIST_MAX)
        ]
        return _JSON.encode(
            {
                "targets": records,
                "discovery_error": self.targets.discovery_error or None,
                # Bounded: the first REFUSED_LIST_MAX by reason then name; `total` counts all.
                "refused": {"total": self.targets.refused_count, "files": refused},
            }
        )

    def ready(self) -> tuple[bool, str]:
        """(ready, reason) for ``/-/ready``, which answers anyone: counts by state, never a
        segment's name (names are on the authenticated ``/api/v1/snapshots`` and in
        `kvsidecar ls`; 256 long names made a 12 KB probe answer), and worked out once
        per poll cycle, so a stream of probes costs a lookup each (it kept the check busy
        for half a core and /metrics waited behind it)."""
        t = self.targets
        gateways = getattr(self.gateway_server, "gateways", ())
        transitions = sum(g.transitions for g in gateways)
        key = (t.version, t.polls_total, t.refused_count, t.waiting, t.discovery_error)
        key += (transitions,)
        cached = self._ready_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        verdict = self._ready()
        self._ready_cache = (key, verdict)
        return verdict

    def _ready(self) -> tuple[bool, str]:
        if self.targets.polls_total == 0:
            return False, "not ready: no poll completed yet"
        views = self.targets.views()
        by_state = collections.Counter(v.state for v in views)
        summary = ", ".join(f"{n} {state}" for state, n in sorted(by_state.items()))
        refused = self.targets.refused_by_reason()
        if refused:
            # The likeliest first-install failures (the daemon not in the engine's group:
            # unreadable; the engine's uid not trusted: foreign_owner) leave no segment at
            # all: say so here, by reason (issue 33 item 1). Names: `kvsidecar ls`, the log.
            total = self.targets.refused_count
            reasons = ", ".join(
                r if len(refused) == 1 else f"{n} {r}" for r, n in sorted(refused.items())
            )
            summary = (summary or "no segment up") + f"; {total} refused ({reasons})"
        summary = summary or "no segments"
        if self.targets.waiting:  # their names are in no series yet: say how many
            summary += f"; {self.targets.waiting} new segment(s) waiting for admission"
        failing = {
            rank: o
            for g in getattr(self.gateway_server, "gateways", ())
            for rank, o in g.not_ok().items()
        }
        if failing:  # still 200: the picker sees its 503s; an operator sees them here
            ranks = ", ".join(f"{r} {o}" for r, o in failing.items())
            summary += f"; gateway answering 503 for {ranks}"
        if self.targets.discovery_error:
            # Still 200 (the sidecar's readiness gates the Pod), but never silent.
            summary += f"; discovery failing: {self.targets.discovery_error}"
        if self.ready_requires_source and not any(v.up for v in views):
            return False, f"not ready: no source is up ({summary})"
        return True, f"ready: {summary}"

    @property
    def landing_links(self) -> Sequence[tuple[str, str]]:
        return []  # the HTTP layer already lists /metrics, snapshots and health

    # -- rendering ----------------------------------------------------------------

    def _render(self, fmt: str, render: Any) -> bytes:
        version = self.targets.version
        cached = self._cache.get(fmt)
        if cached is not None and cached[0] == version:
            return cached[1]
        with self._render_lock:  # one render per poll; concurrent scrapes wait for it
            cached = self._cache.get(fmt)
            if cached is not None and cached[0] == version:
                return cached[1]
            body = render()
            self._cache[fmt] = (version, body)
            return body

    def _render_text(self) -> bytes:
        families = _without_exporter(self.collector.collect(), self.exporter_metrics)
        return render_text(itertools.chain(families, self._self_registry.collect()))

    def _render_openmetrics(self) -> bytes:
        # Family by family, as render_text: prometheus_client joins the whole body into one
        # string first, 4 bytes a character once a label holds an emoji. Each family's
        # output ends with the "# EOF" line; the body has it once, at the end.
        parts = [
            openmetrics.generate_latest(_One(f))[: -len(_EOF)] for f in self.registry.collect()
        ]
        parts.append(_EOF)
        return b"".join(parts)

    def _daemon_stats(self) -> dict[str, Any]:
        return {
            "last_poll_duration_s": self.targets.last_poll_duration_s,
            "polls_total": self.targets.polls_total,
            "refused": self.targets.refused_count,
            "unremembered": self.targets.unremembered,
            "refused_by_reason": self.targets.refused_by_reason(),
            "refusals": dict(self.targets.refusals_total),
            "discovery_error": self.targets.discovery_error,
            "discovery_errors": dict(self.targets.discovery_errors_total),
            "waiting": self.targets.waiting,
            "gateway": _gateway_stats(self.gateway_server),
            "otlp": self.otlp_pusher.dropped() if self.otlp_pusher is not None else None,
            "otlp_exported": (
                self.otlp_pusher.stats["exported"] if self.otlp_pusher is not None else None
            ),
            "load_push": self.load_push.counts() if self.load_push is not None else None,
        }

    def _http_stats(self) -> dict[str, Any]:
        snap = self.http_stats.snapshot()
        return {
            "requests": dict(snap.requests),
            "durations": {
                h: ([(_le(b), n) for b, n in hist.buckets], hist.sum)
                for h, hist in snap.durations.items()
            },
        }


def _gateway_stats(server: Any) -> dict[str, Any] | None:
    if server is None:
        return None
    answers: dict = {}  # (role, dp_rank, outcome) -> n
    for gateway in getattr(server, "gateways", ()):
        counts = gateway.counts()
        answers.update({(gateway.label, *key): n for key, n in counts.items()})
    return {
        "requests": server.request_counts(),
        "closed": dict(server.closed),
        "connections": server.connections,
        "answers": answers,
    }


def _without_exporter(families: Iterable[Metric], keep: bool) -> Iterable[Metric]:
    if keep:
        return families
    # kvsidecar_http_* is ours what promhttp_* is to a Go exporter: about the exporter.
    return (f for f in families if not f.name.startswith("kvsidecar_http_"))


class _Filtered:
    """The snapshot collector, less the exporter's own HTTP families when disabled."""

    def __init__(self, collector: SnapshotCollector, keep: bool) -> None:
        self._collector, self._keep = collector, keep

    def collect(self) -> Iterable[Metric]:
        return _without_exporter(self._collector.collect(), self._keep)


_EOF = b"# EOF\n"


class _One:
    """One metric family as a registry, for generate_latest."""

    def __init__(self, family: Metric) -> None:
        self._family = family

    def collect(self) -> list[Metric]:
        return [self._family]


class _Chain:
    """A registry as a collector, so OpenMetrics output has the self-metrics too."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        return self._registry.collect()


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))
