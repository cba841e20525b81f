"""The Prometheus collector: a plain object yielding metric families from target views.

Like prometheus_client's own collectors, `SnapshotCollector.collect()` builds
fresh families on each call from an immutable list of `TargetView`s, so it
needs no locking. Only *up* targets export per-rank values; every target
exports its source health.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from kvsidecar import __version__
from kvsidecar.daemon import metric_defs as md
from kvsidecar.daemon.budget import valid_value
from kvsidecar.daemon.target import STATES, TargetView
from kvsidecar.protocol.schema import KVCachePoolSnapshot, RuntimeSnapshot, Snapshot
from kvsidecar.revision import revision


def rank_labels(view: TargetView) -> list[str]:
    """Label values in md.RANK_LABELS order; empty strings until a snapshot was seen."""
    if view.last is None:
        return [view.name, "", "", "", "", "", ""]
    r = view.last.snapshot.runtime
    return [
        view.name,
        r.engine,
        r.model_name,
        r.role,
        str(r.dp_rank),
        str(r.tp_rank),
        str(r.pp_rank),
    ]


def rank_instances(views: list[TargetView]) -> dict[str, str]:
    """segment -> engine instance (runtime.instance; "" before schema v1.3): the OTLP push's
    kvsidecar.instance Resource attribute, which no rank series carries as a label."""
    return {v.name: v.last.snapshot.runtime.instance or "" for v in views if v.last is not None}


def _family(m: md.MetricDef, labels: tuple[str, ...] | list[str]) -> Metric:
    if m.type == md.COUNTER:
        return CounterMetricFamily(m.name.removesuffix("_total"), m.help, labels=labels)
    return GaugeMetricFamily(m.name, m.help, labels=labels)


class SnapshotCollector:
    """Yields every kvsidecar metric family from the current target views."""

    def __init__(
        self,
        views: Callable[[], list[TargetView]],
        daemon_stats: Callable[[], dict] | None = None,
        http_stats: Callable[[], dict] | None = None,
    ) -> None:
        self._views = views
        self._daemon_stats = daemon_stats
        self._http_stats = http_stats

    def describe(self) -> list[Metric]:
        return []  # dynamic: skip registry-time collection

    def collect(self) -> Iterator[Metric]:
        views = self._views()
        now = time.monotonic_ns()
        up = [v for v in views if v.up and v.last is not None]
        yield from self._runtime(up)
        yield from self._pools(up, now)
        # _dp_sums emits no sum over a rank that cannot tell (None, also a value dropped by
        # validation): a partial sum would be a number that is not what it says.
        yield from self._dp_sums(up)
        yield from self._sources(views, now)
        yield from self._daemon(views)

    # -- per rank ---------------------------------------------------------------

    def _runtime(self, up: list[TargetView]) -> Iterator[Metric]:
        families = [(m, _family(m, md.RANK_LABELS)) for m in md.RUNTIME]
        info = InfoMetricFamily(
            md.ENGINE_INFO.name.removesuffix("_info"), md.ENGINE_INFO.help, labels=md.RANK_LABELS
        )
        for view in up:
            labels = rank_labels(view)
            r: RuntimeSnapshot = view.last.snapshot.runtime  # type: ignore[union-attr]
            for m, fam in families:
                value = getattr(r, m.field)
                if value is not None:
                    fam.add_metric(labels, value * m.scale)
            info.add_metric(
                labels,
                {
                    "engine_version": r.engine_version,
                    "device": r.device,
                    "dp_size": str(r.dp_size),
                    "tp_size": str(r.tp_size),
                    "pp_size": str(r.pp_size),
                    "schema_version": r.schema_version,
                    "initialized": str(r.initialized).lower(),
                    # No pid: a label that changes at every engine restart would make a new
                    # series each time (kvsidecar_engine_start_time_seconds marks restarts;
                    # the pid is in /api/v1/snapshots and kvsidecar dump).
                },
            )
        for _, fam in families:
            yield fam
        yield info

    def _pools(self, up: list[TargetView], now: int) -> Iterator[Metric]:
        families = [(m, _family(m, md.POOL_LABELS)) for m in md.POOL]
        usage, tokens, age, fill = (_family(m, md.POOL_LABELS) for m in md.POOL_DERIVED)
        for view in up:
            base = rank_labels(view)
            pools = view.last.snapshot.pools  # type: ignore[union-attr]
            for p, pool_label in zip(pools, pool_labels(pools)):
                labels = [*base, pool_label, str(p.group_id)]
                for m, fam in families:
                    value = getattr(p, m.field)
                    if value is not None:
                        fam.add_metric(labels, float(value) * m.scale)
                _derived(p, labels, usage, tokens, fill)
                _deferred_age(p, labels, age, now - view.clock_offset_ns)
        for _, fam in families:
            yield fam
        yield usage
        yield tokens
        yield age
        yield fill

    def _dp_sums(self, up: list[TargetView]) -> Iterator[Metric]:
        # Grouped per engine instance (schema v1.3 runtime.instance, "" before): two
        # engines that share engine/model/role are not one engine's DP ranks.
        groups: dict[tuple[str, str, str, str], list[Snapshot]] = {}
        for view in up:
            snap = view.last.snapshot  # type: ignore[union-attr]
            r = snap.runtime
            if r.tp_rank != 0 or r.pp_rank != 0:
                continue  # one scheduler per DP rank: TP/PP peers hold the same blocks
            key = (r.engine, r.model_name, r.role, r.instance or "")
            groups.setdefault(key, []).append(snap)
        req_m, blk_m = md.DP
        req = GaugeMetricFamily(req_m.name, req_m.help, labels=md.DP_LABELS)
        blk = GaugeMetricFamily(blk_m.name, blk_m.help, labels=md.DP_LABELS)
        for key in sorted(groups):
            snaps = groups[key]
            ranks = {s.runtime.dp_rank for s in snaps}
            if len(ranks) != len(snaps):
                continue  # a dp_rank twice: two instances we cannot tell apart; no sum
            requests = [s.runtime.requests_deferred_free_distinct for s in snaps]
            if None not in requests:  # unsupported anywhere: no series, never a partial sum
                req.add_metric(list(key), sum(requests))  # type: ignore[arg-type]
            blocks = [_deferred_blocks(s.pools) for s in snaps]
            if None not in blocks:
                blk.add_metric(list(key), sum(blocks))  # type: ignore[arg-type]
        yield req
        yield blk

    # -- health -----------------------------------------------------------------

    def _sources(self, views: list[TargetView], now: int) -> Iterator[Metric]:
        def fam(metric: md.MetricDef, extra: tuple[str, ...] = ()) -> Metric:
            return _family(metric, (*md.RANK_LABELS, *extra))

        up = fam(md.SOURCE_UP)
        state = fam(md.SOURCE_STATE, ("state",))
        age = fam(md.SOURCE_SNAPSHOT_AGE_SECONDS)
        restarts = fam(md.SOURCE_WRITER_RESTARTS_TOTAL)
        retries = fam(md.SOURCE_READ_RETRIES_TOTAL)
        decode = fam(md.SOURCE_DECODE_ERRORS_TOTAL)
        errors = fam(md.SOURCE_READ_ERRORS_TOTAL, ("kind",))
        publish_errors = fam(md.SOURCE_PUBLISH_ERRORS_TOTAL)
        generation = fam(md.SOURCE_GENERATION)
        seq = fam(md.SOURCE_LAST_SEQUENCE)
        budget = fam(md.SOURCE_BUDGET_REFUSALS_TOTAL, ("limit",))
        rejected = fam(md.SOURCE_REJECTED_VALUES_TOTAL, ("field",))
        duplicates = fam(md.SOURCE_DUPLICATE_POOLS)
        for view in views:
            labels = rank_labels(view)
            up.add_metric(labels, 1.0 if view.up else 0.0)
            for s in STATES:
                state.add_metric([*labels, s], 1.0 if view.state == s else 0.0)
            a = view.age_seconds(now)
            if a is not None:
                last = view.last
                age.add_metric(labels, a)
                # Header words are u64 the writer controls: int64 range only, like the payload.
                if valid_value(last.generation):  # type: ignore[union-attr]
                    generation.add_metric(labels, last.generation)  # type: ignore[union-attr]
                if valid_value(last.seq):  # type: ignore[union-attr]
                    seq.add_metric(labels, last.seq)  # type: ignore[union-attr]
                pools = last.snapshot.pools  # type: ignore[union-attr]
                duplicates.add_metric(labels, _duplicates(pools))
                # From the header at the last read, independent of the payload.
                if valid_value(last.publish_errors_total):  # type: ignore[union-attr]
                    publish_errors.add_metric(labels, last.publish_errors_total)  # type: ignore[union-attr]
            restarts.add_metric(labels, view.writer_restarts_total)
            retries.add_metric(labels, view.read_retries_total)
            decode.add_metric(labels, view.decode_errors_total)
            for kind, n in sorted(view.read_errors_total.items()):
                errors.add_metric([*labels, kind], n)
            for limit, n in sorted(view.budget_refusals_total.items()):
                budget.add_metric([*labels, limit], n)
            for name, n in sorted(view.rejected_values_total.items()):
                rejected.add_metric([*labels, name], n)
        yield from (up, state, age, restarts, retries, decode, errors, publish_errors)
        yield from (generation, seq)
        yield from (budget, rejected, duplicates)

    def _daemon(self, views: list[TargetView]) -> Iterator[Metric]:
        sources = _family(md.SOURCES, ())
        sources.add_metric([], len(views))
        yield sources
        build = InfoMetricFamily(md.BUILD_INFO.name.removesuffix("_info"), md.BUILD_INFO.help)
        build.add_metric([], {"version": __version__, "revision": revision()})
        yield build
        if self._daemon_stats is not None:
            stats = self._daemon_stats()
            poll = _family(md.POLL_DURATION_SECONDS, ())
            poll.add_metric([], stats["last_poll_duration_s"])
            polls = _family(md.POLLS_TOTAL, ())
            polls.add_metric([], stats["polls_total"])
            refused = _family(md.REFUSED_SEGMENTS, ())
            refused.add_metric([], stats.get("refused", 0))
            yield poll
            yield polls
            yield refused
            refusals = _family(md.SEGMENT_REFUSALS_TOTAL, ("reason",))
            for reason, n in sorted(stats.get("refusals", {}).items()):
                refusals.add_metric([reason], n)
            yield refusals
            discovery_up = _family(md.DISCOVERY_UP, ())
            discovery_up.add_metric([], 0.0 if stats.get("discovery_error") else 1.0)
            yield discovery_up
            errors = _family(md.DISCOVERY_ERRORS_TOTAL, ("cause",))
            for cause, n in sorted(stats.get("discovery_errors", {}).items()):
                errors.add_metric([cause], n)
            yield errors
            # By reason only: a file name is a label value its creator would choose.
            by_reason = _family(md.REFUSED_SEGMENTS_BY_REASON, ("reason",))
            for reason, n in sorted(stats.get("refused_by_reason", {}).items()):
                by_reason.add_metric([reason], n)
            yield by_reason
            waiting = _family(md.TARGETS_WAITING, ())
            waiting.add_metric([], stats.get("waiting", 0))
            yield waiting
            unremembered = _family(md.REFUSED_SEGMENTS_UNREMEMBERED, ())
            unremembered.add_metric([], stats.get("unremembered", 0))
            yield unremembered
            if stats.get("gateway") is not None:
                yield from _gateway_families(stats["gateway"])
            if stats.get("load_push") is not None:  # {(dp_rank, reason): n}, while on
                sent = _family(md.LOAD_PUSH_MESSAGES_TOTAL, ("dp_rank", "reason"))
                for (rank, reason), n in sorted(stats["load_push"].items()):
                    sent.add_metric([str(rank), reason], n)
                yield sent
            if stats.get("otlp") is not None:  # {reason: n}, only while the push is on
                dropped = _family(md.OTLP_DROPPED_BATCHES_TOTAL, ("reason",))
                for reason, n in sorted(stats["otlp"].items()):
                    dropped.add_metric([reason], n)
                yield dropped
            if stats.get("otlp_exported") is not None:
                exported = _family(md.OTLP_EXPORTED_BATCHES_TOTAL, ())
                exported.add_metric([], stats["otlp_exported"])
                yield exported
        if self._http_stats is not None:
            yield from _http_families(self._http_stats())


def _deferred_blocks(pools: list[KVCachePoolSnapshot]) -> int | None:
    """Deferred blocks of one rank, None unless every pool reports them (and there is one)."""
    if not pools:
        return None
    total = 0
    for p in pools:
        if p.deferred_free_blocks is None:
            return None
        total += p.deferred_free_blocks
    return total


def pool_labels(pools: list[KVCachePoolSnapshot]) -> list[str]:
    """The pool label of each pool: its name, or ``<name>#<n>`` for the n-th pool with the
    same (pool_name, group_id), so one segment never yields two identical series.
    Deterministic: payload order, and a suffix never collides with another pool's label."""
    taken = {(p.pool_name, p.group_id) for p in pools}
    seen: set[tuple[str, int]] = set()
    out = []
    for p in pools:
        label = p.pool_name
        if (label, p.group_id) in seen:
            n = 2
            # Skip suffixes a real pool uses too ("kv#2" registered by the engine itself).
            while (f"{label}#{n}", p.group_id) in seen or (f"{label}#{n}", p.group_id) in taken:
                n += 1
            label = f"{label}#{n}"
        seen.add((label, p.group_id))
        out.append(label)
    return out


def _duplicates(pools: list[KVCachePoolSnapshot]) -> int:
    return len(pools) - len({(p.pool_name, p.group_id) for p in pools})


def _derived(p: KVCachePoolSnapshot, labels: list[str], usage, tokens, fill) -> None:
    # Any input may be None: unsupported, or dropped by validation (budget.sanitize).
    total, allocated, size = p.total_blocks, p.allocated_blocks, p.block_size_tokens
    if total is not None and allocated is not None and total > 0:
        usage.add_metric(labels, allocated / total)
    if p.tokens_used is None or size is None or size <= 0:
        return  # token occupancy unsupported by this writer: no series, not a fake 0
    if total is not None and total > 0:
        tokens.add_metric(labels, p.tokens_used / (total * size))
    if allocated is not None and allocated > 0:
        fill.add_metric(labels, p.tokens_used / (allocated * size))


def _deferred_age(p: KVCachePoolSnapshot, labels: list[str], age, now_mono_ns: int) -> None:
    since = p.oldest_deferred_free_mono_ns
    if since is None:
        return  # the writer cannot tell: no series
    # now_mono_ns is on the writer's clock: ours less the offset of a writer in another time
    # namespace (TargetView.clock_offset_ns; it read its offset, 1000s of s, as an age).
    age.add_metric(labels, max(0, now_mono_ns - since) / 1e9 if since > 0 else 0.0)


def _gateway_families(stats: dict) -> Iterator[Metric]:
    """stats: {"requests": {code: n}, "closed": {reason: n}, "connections": n}."""
    req = _family(md.GATEWAY_REQUESTS_TOTAL, ("code",))
    for code, n in sorted(stats["requests"].items()):
        req.add_metric([str(code)], n)
    conns = _family(md.GATEWAY_CONNECTIONS, ())
    conns.add_metric([], stats["connections"])
    closed = _family(md.GATEWAY_CONNECTIONS_CLOSED_TOTAL, ("reason",))
    for reason, n in sorted(stats["closed"].items()):
        closed.add_metric([reason], n)
    answers = _family(md.GATEWAY_ANSWERS_TOTAL, ("dp_rank", "outcome", "role"))
    for (role, rank, outcome), n in sorted(stats.get("answers", {}).items()):
        answers.add_metric([str(rank), outcome, role], n)
    yield from (req, conns, closed, answers)


def _http_families(stats: dict) -> Iterator[Metric]:
    """stats: {"requests": {(handler, code): n}, "durations": {handler: (buckets, sum)}}."""
    req = _family(md.HTTP_REQUESTS_TOTAL, ("handler", "code"))
    for (handler, code), n in sorted(stats.get("requests", {}).items()):
        req.add_metric([handler, str(code)], n)
    yield req
    dur_def = md.HTTP_REQUEST_DURATION_SECONDS
    dur = HistogramMetricFamily(dur_def.name, dur_def.help, labels=("handler",))
    for handler, (buckets, total) in sorted(stats.get("durations", {}).items()):
        dur.add_metric([handler], buckets=buckets, sum_value=total)
    yield dur
