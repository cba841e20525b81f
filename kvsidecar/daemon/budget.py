"""What one target may cost the daemon, and what a writer's values must satisfy to be served.

A segment's owner can write anything that fits its slot. Without bounds, a
valid 16 KB payload of ~16,000 empty pool arrays became 240,000 series and
took every target's scrape down with it. So every target has a `Budget`:

* ``max_payload_bytes``: a segment whose slot is bigger is refused at attach,
  before any payload is copied (the default slot is 16 KiB);
* ``max_pools_per_rank``: checked on the msgpack array header *before* the
  full decode, so an over-budget payload never builds its pool records;
* ``max_label_length``: every string that becomes a label value, in UTF-8 bytes (in
  characters, 256 emoji were 1 KiB each: a 9-12 MB body against a 3 MiB budget);
* ``max_series_per_target``: an upper bound of the series the target would export.

A target over budget is refused (state ``refused``, the reason in its error,
``kvsidecar_source_budget_refusals_total``); other targets are untouched.

Per-target budgets alone let N conforming targets cost N times as much (32 maximal
ones: 771 MB RSS, 2.5 s scrapes). So the daemon also has a budget in aggregate,
``max_exposition_bytes``: the estimated exposition size in UTF-8 bytes
(`exposition_estimate`) of every served target together. The daemon's peak RSS follows it
at about 7 bytes per byte over ~28 MB (text and OpenMetrics renders, their caches and
gzip copies; `kvsidecar bench worsttarget`), so the default 3 MiB keeps it near 50 MB,
inside the Kubernetes sidecar's 64 Mi. Targets are kept in order of seniority (served
first, then found first) while they fit: a newcomer never sheds a target that was
serving, however small the newcomer, and a target that alone exceeds the budget is shed
too (state ``refused``, limit ``total``, the reason in the error).

`sanitize` validates every exported number per field: a negative count, a
NaN/Inf or an integer >= 2^63 from a buggy writer is dropped (no series, as if
unsupported) and counted, so both exposition formats always parse.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

import msgspec

from kvsidecar.daemon import metric_defs as md
from kvsidecar.protocol.reader import array_len
from kvsidecar.protocol.schema import (
    IDENTITY_FIELDS,
    INT_LIMIT,
    MAX_LABEL_LENGTH,
    KVCachePoolSnapshot,
    RuntimeSnapshot,
    Snapshot,
)

DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024  # 64x the agent's default slot
DEFAULT_MAX_POOLS = 64
DEFAULT_MAX_LABEL_LENGTH = MAX_LABEL_LENGTH
DEFAULT_MAX_SERIES = 4096
# About one maximal conforming target (48 pools, every label 256 bytes: ~2.9 MB of text):
# the daemon then stays inside the Kubernetes sidecar's 64 Mi (`bench worsttarget`,
# docs/reliability.md), and ~150 realistic ranks (1-2 pools, short labels) fit.
DEFAULT_MAX_EXPOSITION_BYTES = 3 * 1024 * 1024

# Source-health series a target exports whatever its payload (states, counters, age...).
HEALTH_SERIES = len(md.SOURCE) + 8


@dataclass(frozen=True)
class Budget:
    """Per-target limits (``kvsidecar serve --max-*``)."""

    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    max_pools_per_rank: int = DEFAULT_MAX_POOLS
    max_label_length: int = DEFAULT_MAX_LABEL_LENGTH
    max_series_per_target: int = DEFAULT_MAX_SERIES
    max_exposition_bytes: int = DEFAULT_MAX_EXPOSITION_BYTES  # all targets together


class OverBudget(Exception):
    """A segment exceeds its budget. ``limit`` is a stable short name for metrics."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


LIMITS = ("payload_bytes", "pools", "label_length", "series", "total")


class _Outline(msgspec.Struct, array_like=True):
    # Raw: msgspec only skips over these bytes, it builds nothing.
    runtime: msgspec.Raw
    pools: msgspec.Raw = msgspec.Raw(b"\x90")


_OUTLINE = msgspec.msgpack.Decoder(_Outline)
_FULL = msgspec.msgpack.Decoder(Snapshot)


class BoundedSnapshotDecoder:
    """Drop-in for ``msgspec.msgpack.Decoder(Snapshot)`` that refuses too many pools
    before building any record (raises `OverBudget`; msgspec errors as usual)."""

    def __init__(self, max_pools: int) -> None:
        self.max_pools = max_pools

    def decode(self, payload: bytes | memoryview) -> Snapshot:
        n = array_len(memoryview(_OUTLINE.decode(payload).pools)[:5])
        if n is not None and n > self.max_pools:
            raise OverBudget("pools", f"{n} pools per rank > --max-pools-per-rank {self.max_pools}")
        return _FULL.decode(payload)


def _strings(record: msgspec.Struct) -> list[tuple[str, str]]:
    return [(f, v) for f in record.__struct_fields__ if isinstance(v := getattr(record, f), str)]


def label_values(snapshot: Snapshot) -> list[tuple[str, str]]:
    """(what, value) of every string field of the snapshot: each becomes a label value or
    a JSON string somewhere, so each counts (a list of chosen fields forgot ``instance``,
    and a 900,000-character one was served)."""
    out = _strings(snapshot.runtime)
    for p in snapshot.pools:
        out += _strings(p)
    return out


def utf8_len(value: str) -> int:
    """What a string costs in a label, an exposition body or a JSON answer: its UTF-8
    bytes (an emoji is one character and four bytes)."""
    return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))


def exposed_len(value: str) -> int:
    """Bytes of a label value in the text exposition: UTF-8, a backslash, double quote or
    newline escaped to two (256 double quotes are 512 bytes there)."""
    n = utf8_len(value)
    if "\\" in value or '"' in value or "\n" in value:
        n += value.count("\\") + value.count('"') + value.count("\n")
    return n


def series_estimate(snapshot: Snapshot) -> int:
    """An upper bound of the series one target exports for this snapshot."""
    r = snapshot.runtime
    n = HEALTH_SERIES + 1 + sum(getattr(r, m.field) is not None for m in md.RUNTIME)
    per_pool_derived = len(md.POOL_DERIVED)
    for p in snapshot.pools:
        n += per_pool_derived + sum(getattr(p, m.field) is not None for m in md.POOL)
    return n


_SAMPLE_OVERHEAD = 64  # metric name, punctuation, value, per sample line


def exposition_estimate(snapshot: Snapshot, name: str) -> int:
    """UTF-8 bytes of text exposition this target adds, about: series times their labels
    (as exposed: escapes included)."""
    r = snapshot.runtime
    rank = sum(map(exposed_len, (name, r.engine, r.model_name, r.role))) + 80
    n = HEALTH_SERIES + 1 + sum(getattr(r, m.field) is not None for m in md.RUNTIME)
    total = n * (rank + _SAMPLE_OVERHEAD)
    total += sum(exposed_len(v) for _, v in _strings(r))  # the info series carries them all
    per_pool_derived = len(md.POOL_DERIVED)
    for p in snapshot.pools:
        k = per_pool_derived + sum(getattr(p, m.field) is not None for m in md.POOL)
        total += k * (rank + exposed_len(p.pool_name) + 24 + _SAMPLE_OVERHEAD)
    return total


def health_estimate(name: str, snapshot: Snapshot | None) -> int:
    """UTF-8 bytes of exposition a target that is not up adds: its health series only
    (values are exported only while up)."""
    rank = exposed_len(name) + 80
    if snapshot is not None:
        r = snapshot.runtime
        rank += exposed_len(r.engine) + exposed_len(r.model_name) + exposed_len(r.role)
    return HEALTH_SERIES * (rank + _SAMPLE_OVERHEAD)


def check(snapshot: Snapshot, budget: Budget) -> None:
    """Raise `OverBudget` if the decoded snapshot exceeds the label or series budget."""
    limit = budget.max_label_length
    for what, value in label_values(snapshot):
        if len(value) * 4 > limit and (n := utf8_len(value)) > limit:
            raise OverBudget("label_length", f"{what} is {n} bytes > --max-label-length {limit}")
    series = series_estimate(snapshot)
    if series > budget.max_series_per_target:
        raise OverBudget(
            "series",
            f"{series} series > --max-series-per-target {budget.max_series_per_target}",
        )


# -- value validation ----------------------------------------------------------


def _fields(record: type[msgspec.Struct], identity: bool) -> tuple[str, ...]:
    hints = typing.get_type_hints(record)
    return tuple(
        f
        for f in record.__struct_fields__
        if hints[f] not in (str, str | None) and (f in IDENTITY_FIELDS) == identity
    )


# Every number or flag that is not an identity field (schema.md, "Values"): one out of
# range is dropped alone. Identity numbers (ranks, sizes, pid, group_id) are labels: one
# out of range makes the snapshot unidentifiable (`identity_error`).
RUNTIME_VALUE_FIELDS = _fields(RuntimeSnapshot, identity=False)
POOL_VALUE_FIELDS = _fields(KVCachePoolSnapshot, identity=False)
_RUNTIME_IDENTITY = _fields(RuntimeSnapshot, identity=True)
_POOL_IDENTITY = _fields(KVCachePoolSnapshot, identity=True)


def identity_error(snapshot: Snapshot) -> str | None:
    """The first identity field out of [0, 2^63), as "runtime.<f> = <v>", else None."""
    records = [("runtime.", snapshot.runtime, _RUNTIME_IDENTITY)]
    records += [("pool.", p, _POOL_IDENTITY) for p in snapshot.pools]
    for prefix, record, fields in records:
        for f in fields:
            v = getattr(record, f)
            if not 0 <= v < INT_LIMIT:
                return f"{prefix}{f} = {v} is out of range [0, 2^63)"
    return None


def valid_value(value: object) -> bool:
    """Counts, sizes, timestamps and ratios of the schema are all >= 0 and finite."""
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, int):
        return 0 <= value < INT_LIMIT
    if isinstance(value, float):  # finite, and in [0, 2^63) like every number
        return 0.0 <= value < INT_LIMIT
    return False


def _clean(record: msgspec.Struct, fields: tuple[str, ...], prefix: str, rejected: dict) -> object:
    bad = [f for f in fields if not valid_value(getattr(record, f))]
    if not bad:
        return record
    for f in bad:
        rejected[prefix + f] = rejected.get(prefix + f, 0) + 1
    return msgspec.structs.replace(record, **dict.fromkeys(bad))


def sanitize(snapshot: Snapshot) -> tuple[Snapshot, dict[str, int]]:
    """The snapshot with every out-of-range value set to None, and {field: count} rejected.

    Field names are ``runtime.<field>`` or ``pool.<field>`` (a bounded label set)."""
    rejected: dict[str, int] = {}
    runtime = _clean(snapshot.runtime, RUNTIME_VALUE_FIELDS, "runtime.", rejected)
    pools = [_clean(p, POOL_VALUE_FIELDS, "pool.", rejected) for p in snapshot.pools]
    if not rejected:
        return snapshot, rejected
    return Snapshot(runtime=runtime, pools=pools), rejected  # type: ignore[arg-type]


# A writer in another time namespace is read through a clock offset estimated from its
# heartbeats (Target._clock_offset), which can lag its real clock by a poll: a stamp that
# much ahead is still its own. Same-clock writers get no slack at all.
STAMP_SLACK_NS = 1_000_000_000


def reject_future_stamps(snapshot: Snapshot, writer_now_ns: int, rejected: dict) -> Snapshot:
    """The snapshot with each pool's ``oldest_deferred_free_mono_ns`` later than now (on the
    writer's clock) set to None, counted in `rejected`: a deferral cannot have begun in the
    future, and the age computed from it (now - stamp, clamped at 0) read 0.0 for a stamp
    of 2^62 (schema.md, "Values": in range, yet impossible)."""
    field = "oldest_deferred_free_mono_ns"
    future = [i for i, p in enumerate(snapshot.pools) if (getattr(p, field) or 0) > writer_now_ns]
    if not future:
        return snapshot
    pools = list(snapshot.pools)
    for i in future:
        pools[i] = msgspec.structs.replace(pools[i], **{field: None})
    rejected["pool." + field] = rejected.get("pool." + field, 0) + len(future)
    return msgspec.structs.replace(snapshot, pools=pools)


def over_total(costs: typing.Iterable[tuple[str, int]], fixed: int, limit: int) -> dict[str, int]:
    """The aggregate budget: which of `costs` ((name, cost), by seniority, those served
    longest first) do not fit within `limit` bytes together with `fixed` (what the others
    cost anyway), each with the total it would have made. Each is kept while the running
    total fits: a newcomer never sheds a senior, and one alone over `limit` is shed too."""
    total, shed = fixed, {}
    for name, cost in costs:
        if total + cost <= limit:
            total += cost
        else:
            shed[name] = total + cost
    return shed
