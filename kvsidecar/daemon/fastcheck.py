"""The poller's checks of a new snapshot (budget.py), whole-record first.

`check`, `identity_error` and `sanitize` in `kvsidecar.daemon.budget` look at each field
of each record in Python: for a 4-pool snapshot, ~200 field reads and range checks, ~60 %
of a gateway poll that finds a new step (docs/gateway.md, "The cost of a poll"). Here each
record is turned into a tuple once (`msgspec.structs.astuple`, in C) and each check reads
the fields it needs with one `itemgetter` and decides them with one C call (`len`, `max`,
`min`, `sum`, `tuple.count`): a record that passes is decided without a Python loop over
its fields. One that does not (a label too long, too many series, a value out of range,
anything unusual) is handed to budget.py's own functions, which decide it exactly as
before and word the refusal. So every field is still checked on every new snapshot; only
how is changed, and the verdict is budget.py's whenever a record is not plainly in range
(tests/daemon/test_fastcheck.py checks both on random snapshots).

``records`` counts the records budget.py's per-field checks looked at (the work this
avoids; 0 for a snapshot in range).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import msgspec

from kvsidecar.daemon import budget
from kvsidecar.daemon import metric_defs as md
from kvsidecar.protocol.schema import INT_LIMIT, KVCachePoolSnapshot, RuntimeSnapshot, Snapshot

__all__ = ["RecordChecks", "check", "identity_error", "records", "rows_of", "sanitize"]

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
        self.identity = _getter(record, identity)
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

# How many records budget.py's per-field checks were asked about (the slow path).
records = 0


def _slow(n: int) -> None:
    global records
    records += n


def rows_of(snapshot: Snapshot) -> list[tuple[RecordChecks, tuple]]:
    rows = [(RUNTIME, _astuple(snapshot.runtime))]
    rows += [(POOL, _astuple(p)) for p in snapshot.pools]
    return rows


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


def check(snapshot: Snapshot, limits: budget.Budget, rows: list | None = None) -> None:
    """budget.check: raise `OverBudget` for a label longer than --max-label-length or more
    series than --max-series-per-target."""
    rows = rows if rows is not None else rows_of(snapshot)
    limit = limits.max_label_length
    series = budget.HEALTH_SERIES + 1 + len(md.POOL_DERIVED) * (len(rows) - 1)
    too_long = False
    try:
        for kind, values in rows:
            strings = tuple(filter(None, kind.strings(values)))
            # At most 4 UTF-8 bytes a character: only a string over limit / 4 is measured.
            if strings and max(map(len, strings)) * 4 > limit:
                too_long = too_long or any(budget.utf8_len(s) > limit for s in strings)
            counted = kind.series(values)
            series += len(counted) - counted.count(None)
    except (TypeError, AttributeError):  # not a str where the schema says one
        too_long = True
    if too_long or series > limits.max_series_per_target:
        _slow(len(rows))
        budget.check(snapshot, limits)  # raises, worded as ever


def identity_error(snapshot: Snapshot, rows: list | None = None) -> str | None:
    """budget.identity_error: the first identity field out of [0, 2^63), else None."""
    rows = rows if rows is not None else rows_of(snapshot)
    for kind, values in rows:
        ids = kind.identity(values)
        try:
            plain = not ids or (min(ids) >= 0 and max(ids) < INT_LIMIT)
        except TypeError:  # not a number: budget.py's check says what it says of it
            plain = False
        if not plain:
            _slow(len(rows))
            return budget.identity_error(snapshot)
    return None


def sanitize(snapshot: Snapshot, rows: list | None = None) -> tuple[Snapshot, dict[str, int]]:
    """budget.sanitize: out-of-range values set to None, and {field: count} rejected."""
    rows = rows if rows is not None else rows_of(snapshot)
    if all(_in_range(kind.values(values)) for kind, values in rows):
        return snapshot, {}
    _slow(len(rows))
    return budget.sanitize(snapshot)
