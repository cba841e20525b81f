"""The poller's checks of a new snapshot (budget.py), on whole tuples rather than fields.

`check`, `identity_error` and `sanitize` in `kvsidecar.daemon.budget` look at each field
of each record in Python: for a 4-pool snapshot ~200 field reads and range checks, most of
a gateway poll that finds a new step (docs/gateway.md, "The cost of a poll"). Here each
record is turned into a tuple once (`msgspec.structs.astuple`, in C), the fields each check
needs are gathered across the records (`itemgetter`) and decided with a few C calls
(`len`, `max`, `min`, `sum`, `tuple.count`): a snapshot in range is decided without a
Python loop over its fields. One that is not plainly in range (a label too long, too many
series, a value out of range, anything unusual) is handed to budget.py's own functions,
which decide it exactly as before and word the refusal. So every field is still checked
on every new snapshot; only how is changed, and the verdict is budget.py's whenever the
snapshot is not plainly in range (tests/daemon/test_fullcheck_work.py checks both on
random snapshots). The identity fields (8 for 4 pools) are left to
budget.identity_error, already cheap.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from itertools import chain

import msgspec

from kvsidecar.daemon import budget
from kvsidecar.daemon import metric_defs as md
from kvsidecar.protocol.schema import INT_LIMIT, KVCachePoolSnapshot, RuntimeSnapshot, Snapshot

__all__ = ["Facts", "RecordChecks", "check", "sanitize"]

_astuple = msgspec.structs.astuple


def _getter(record: type[msgspec.Struct], fields: tuple[str, ...]) -> Callable[[tuple], tuple]:
    """A function from a record's tuple to the tuple of `fields` (in C: itemgetter)."""
    index = [record.__struct_fields__.index(f) for f in fields]
    if not index:
        return lambda values: ()
    if len(index) == 1:
        one = index[0]
        return lambda values: (values[one],)
    return operator.itemgetter(*index)


class RecordChecks:
    """One record type's field groups, as itemgetters over its tuple."""

    def __init__(
        self,
        record: type[msgspec.Struct],
        values: tuple[str, ...],
        identity: tuple[str, ...],
        series: tuple[str, ...],
    ) -> None:
        names = record.__struct_fields__
        self.strings = _getter(record, tuple(f for f in names if f not in values + identity))
        self.values = _getter(record, values)
        self.series = _getter(record, series)


RUNTIME = RecordChecks(
    RuntimeSnapshot,
    budget.RUNTIME_VALUE_FIELDS,
    budget._RUNTIME_IDENTITY,
    tuple(m.field for m in md.RUNTIME),
)
POOL = RecordChecks(
    KVCachePoolSnapshot,
    budget.POOL_VALUE_FIELDS,
    budget._POOL_IDENTITY,
    tuple(m.field for m in md.POOL),
)


class Facts:
    """One snapshot's fields, gathered by group across its records: each tuple once."""

    __slots__ = ("count", "series", "strings", "values")

    def __init__(self, snapshot: Snapshot) -> None:
        rt = _astuple(snapshot.runtime)
        pools = [_astuple(p) for p in snapshot.pools]
        self.count = 1 + len(pools)
        self.strings = RUNTIME.strings(rt) + _joined(POOL.strings, pools)
        self.values = RUNTIME.values(rt) + _joined(POOL.values, pools)
        self.series = RUNTIME.series(rt) + _joined(POOL.series, pools)


def _joined(get: Callable[[tuple], tuple], records: list[tuple]) -> tuple:
    return tuple(chain.from_iterable(map(get, records)))


def check(snapshot: Snapshot, limits: budget.Budget, facts: Facts | None = None) -> None:
    """budget.check: raise `OverBudget` for a label longer than --max-label-length or more
    series than --max-series-per-target."""
    facts = facts or Facts(snapshot)
    limit = limits.max_label_length
    pools = facts.count - 1
    series = budget.HEALTH_SERIES + 1 + len(md.POOL_DERIVED) * pools
    series += len(facts.series) - facts.series.count(None)
    try:
        strings = tuple(filter(None, facts.strings))
        # At most 4 UTF-8 bytes a character: only a string over limit / 4 is measured.
        too_long = bool(strings) and max(map(len, strings)) * 4 > limit
        too_long = too_long and any(budget.utf8_len(s) > limit for s in strings)
    except (TypeError, AttributeError):  # not a str where the schema says one
        too_long = True
    if too_long or series > limits.max_series_per_target:
        budget.check(snapshot, limits)  # raises, worded as ever


def sanitize(snapshot: Snapshot, facts: Facts | None = None) -> tuple[Snapshot, dict[str, int]]:
    """budget.sanitize: out-of-range values set to None, and {field: count} rejected."""
    facts = facts or Facts(snapshot)
    if _in_range(facts.values):
        return snapshot, {}
    return budget.sanitize(snapshot)


def _in_range(values: tuple) -> bool:
    """Every value None, a bool, or a number in [0, 2^63) and finite (budget.valid_value),
    decided in C; False when it cannot be decided so (then budget.py decides)."""
    nonzero = tuple(filter(None, values))  # None, False, 0, 0.0 and -0.0 are all valid
    if not nonzero:
        return True
    try:
        # A NaN first makes min NaN (False); anywhere else it makes the sum NaN. min and
        # max are exact otherwise; a value that is not a number raises (then: the slow path).
        return min(nonzero) >= 0 and max(nonzero) < INT_LIMIT and math.isfinite(sum(nonzero))
    except (TypeError, OverflowError):
        return False
