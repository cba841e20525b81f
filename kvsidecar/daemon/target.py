"""One target: a segment name followed across writer restarts, its state, last good
snapshot and counters (Prometheus's `scrape/target.go`, apart from finding: scan.py).

A `Target` is polled by one thread at a time (its lock); readers of its state (the
collector, the JSON API) only ever see an immutable `TargetView` that the poll swaps in
whole, so a scrape never observes a half-updated target.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass, field, replace

import msgspec

from kvsidecar.daemon import fastcheck
from kvsidecar.daemon.budget import (
    STAMP_SLACK_NS,
    BoundedSnapshotDecoder,
    Budget,
    OverBudget,
    exposition_estimate,
    health_estimate,
    identity_error,
    reject_future_stamps,
)
from kvsidecar.daemon.refusals import bump
from kvsidecar.protocol import layout
from kvsidecar.protocol.reader import (
    Corrupt,
    Gone,
    ReadError,
    Reading,
    SegmentReader,
    Stale,
    WriterDead,
    dead_message,
    faulted_message,
    stale_message,
    state_byte,
)
from kvsidecar.protocol.schema import Snapshot

UP, STALE, DEAD, CORRUPT, NOT_READY, REFUSED = (
    "up",
    "stale",
    "dead",
    "corrupt",
    "not_ready",
    "refused",
)
STATES = (UP, STALE, DEAD, CORRUPT, NOT_READY, REFUSED)
OVER_BUDGET = "over_budget"  # error_kind of a target refused for its budget

log = logging.getLogger(__name__)
TRANSITION_LOG_S = 10.0


class NameThrottle:
    """Log lines about one target name, a token bucket per name: `BURST` lines at once,
    then one per `TRANSITION_LOG_S`; the lines held back are counted in the next one (a
    flapping writer logged ~5.7 lines a second, one per change). Keyed by name across
    forgetting and re-finding; bounded, the oldest names dropped first."""

    BURST = 5

    def __init__(self, interval: float = TRANSITION_LOG_S, names: int = 4096) -> None:
        self.interval, self.names = interval, names
        self._seen: collections.OrderedDict[str, list] = collections.OrderedDict()

    def __call__(self, name: str, level: int, message: str, *args: object) -> None:
        now = time.monotonic()
        tokens, last, held = self._seen.pop(name, (self.BURST, now, 0))
        tokens = min(self.BURST, tokens + (now - last) / self.interval)
        if tokens < 1:
            self._seen[name] = [tokens, now, held + 1]
            return
        more = f" ({held} more held back)" if held else ""
        # per_target marks the line as one segment's news: the CLI's table already shows it.
        log.log(level, "%s: " + message + "%s", name, *args, more, extra={"per_target": True})
        self._seen[name] = [tokens - 1, now, 0]
        if len(self._seen) > self.names:
            self._seen.popitem(last=False)


@dataclass(frozen=True)
class TargetView:
    """What the outside world sees of a target; replaced whole on every poll."""

    name: str
    state: str = NOT_READY
    error: str = ""
    # Why it is not up, as a stable name (segment-format.md section 8): a ReadError.kind,
    # or one of the kinds below; "" (null) only while up.
    error_kind: str = "not_ready"
    last: Reading | None = None  # last good reading, kept across dead/stale/corrupt
    # When, on the daemon's clock, the writer last showed progress (Target._still_for).
    progress_mono_ns: int = 0
    # Add to a writer's CLOCK_MONOTONIC stamp to read it on ours: 0 while the clocks agree
    # (within --stale-after), else the offset seen at its last progress (a time namespace).
    clock_offset_ns: int = 0
    last_poll_mono_ns: int = 0
    writer_restarts_total: int = 0
    read_retries_total: int = 0
    decode_errors_total: int = 0
    read_errors_total: dict[str, int] = field(default_factory=dict)
    budget_refusals_total: dict[str, int] = field(default_factory=dict)  # by limit
    rejected_values_total: dict[str, int] = field(default_factory=dict)  # by field

    @property
    def up(self) -> bool:
        return self.state == UP

    def age_seconds(self, now_mono_ns: int | None = None) -> float | None:
        """Seconds since the writer last showed progress, on the daemon's clock: the
        writer's clock alone made a live writer 500 s behind (another time namespace)
        read 500 s old. At first sight its own age is believed, up to just past
        stale_after in serve, in full in dump and ls (Target._still_for)."""
        if self.last is None:
            return None
        if not self.progress_mono_ns:
            return self.last.age_seconds(now_mono_ns)
        now = time.monotonic_ns() if now_mono_ns is None else now_mono_ns
        return max(0, now - self.progress_mono_ns) / 1e9


def _evolve(v: TargetView, **changes: object) -> TargetView:
    """`dataclasses.replace` for the poll's own view (every field valid as it was, the
    changed ones as the poll set them): a copy of its fields, without replace's per-call
    look at each field (6 of a full check's ~40 us alone)."""
    new = object.__new__(TargetView)
    new.__dict__.update(v.__dict__, **changes)
    return new


CLOSED_KIND = "closed"  # error_kind of a target whose writer closed it cleanly
WRITER_DEAD_KIND = WriterDead.kind  # ... of one whose writer died (no lock, not CLOSED)
STALE_KIND = Stale.kind  # ... of a live writer that showed no progress (hung, stopped)
PUBLISH_FAILING_KIND = "publish_failing"  # ... of a stale one failing every publish
INTERNAL_KIND = "internal_error"  # ... of one whose poll hit a bug of the daemon's own


FAULTED_KIND = "faulted"  # error_kind of a target whose engine reported a fatal error


def _closed(reader: SegmentReader) -> bool:
    """The mapped (old) segment's state byte says CLOSED."""
    return state_byte(reader) == layout.STATE_CLOSED


class Target:
    """One segment name, followed across writer restarts."""

    def __init__(
        self,
        name: str,
        shm_dir: str,
        *,
        stale_after: float,
        true_first_age: bool = False,
        allowed_uids: frozenset[int] | None = None,
        budget: Budget | None = None,
        explicit: bool = False,
        note: NameThrottle | None = None,
    ) -> None:
        self.name = name
        self.note = note or NameThrottle()  # its log lines, throttled per name
        self.stale_after = stale_after
        self.true_first_age = true_first_age  # Polling.true_first_age: dump and ls
        self.budget = budget or Budget()
        self.explicit = explicit
        self.admitted_mono = time.monotonic()
        self.reader = SegmentReader(name, shm_dir=shm_dir, allowed_uids=allowed_uids)
        # The reader decodes through this: too many pools are refused before a record is built.
        self.reader._decoder = BoundedSnapshotDecoder(self.budget.max_pools_per_rank)  # type: ignore[assignment]
        self.view = TargetView(name=name)
        # The poller and the gateway (a fresh read per request) both poll: one at a time,
        # and never while the reader is being closed.
        self.lock = threading.Lock()
        # Closed by the TargetSet (forgotten): a late gateway poll must not re-attach it, or
        # the descriptor it opened would never be closed.
        self.forgotten = False
        # The last checked snapshot, costed (exposition_estimate) only when the aggregate
        # budget asks: a gateway poll of a new step must not pay for it (~20 % of a check).
        self._cost_of: Snapshot | None = None
        self._cost = (None, 0)
        self.shed = ""  # why the aggregate budget sheds it ("" = served)
        # When the aggregate budget first served it up: its seniority there (None: never).
        self.served_since: float | None = None
        self.ever_up = False  # a target never up since admission is junk at --max-targets
        self.dead_since = 0.0  # monotonic time it was last seen becoming dead
        # Exported (its name a `segment` label) once admitted: see TargetSet._admit.
        self.shown = explicit
        self.waited = False  # counted once as waiting for admission
        self._incarnation = 0
        # Liveness by progress on our own clock: the last (incarnation, heartbeat, seq)
        # seen and when it changed. The writer's clock alone misjudged a writer in another
        # time namespace (its CLOCK_MONOTONIC offset): hung = up forever, live = stale.
        self._beat: tuple[int, int, int] | None = None
        self._beat_seen = 0
        self._checked: tuple[int, int] | None = None  # (incarnation, seq) of v.last's snapshot
        # (incarnation, seq, header, payload) of the last snapshot checked with nothing
        # rejected (None: the last one had a value rejected, or was read field by field).
        self.fast_base: tuple[int, int, bytes, bytes] | None = None

    @property
    def cost(self) -> int:
        """exposition_estimate of the last good snapshot (0 before one): the aggregate budget."""
        snapshot = self._cost_of
        if snapshot is None:
            return 0
        if self._cost[0] is not snapshot:
            self._cost = (snapshot, exposition_estimate(snapshot, self.name))
        return self._cost[1]

    def poll(self, log_transitions: bool = True, trusted: mmap.mmap | None = None) -> TargetView:
        """Attach if needed, read, classify. Never raises.

        `trusted`: the map a probed poll found live and in place moments ago, whose
        published sequence has moved since (the gateway's window, gateway.py). While the
        reader still holds that map and its state byte says READY, the probes of a
        moving writer are skipped: the path's ``stat`` (replaced?), the size ``fstat``
        and the liveness lock probe (``fcntl``). Every check of the snapshot itself runs,
        and the view left (the one the collector reads) is up on the moving word. The
        caller probes again at its window's end: a writer gone is seen as without the
        shortcut, a segment replaced under a writer still publishing within that window
        (tests/daemon/test_gateway_moving.py)."""
        with self.lock:
            if self.forgotten:
                return replace(
                    self.view,
                    state=NOT_READY,
                    error=f"segment {self.name}: forgotten",
                    error_kind=Gone.kind,
                )
            try:
                view = self._poll(trusted is not None and trusted is self.reader.mm)
            except Exception as e:  # a bug must not take the daemon down with it
                view = replace(
                    self.view,
                    state=CORRUPT,
                    error=f"internal error: {e!r}",
                    error_kind=INTERNAL_KIND,
                )
            if log_transitions and view.state != self.view.state:
                self._log_transition(view)
            if view.state == DEAD and self.view.state != DEAD:
                self.dead_since = time.monotonic()
            self.view = view
            self.ever_up = self.ever_up or view.up
            return view

    def _still_for(self, result: Reading, now: int) -> float:
        """Seconds, on the daemon's clock, since the writer last showed progress. At first
        sight the writer's own age is believed (so an engine already hung reads stale at
        once when the clocks agree): in serve up to just past stale_after, since a writer
        in another time namespace stamps its own clock; in full with true_first_age (dump,
        ls: one look, which must not show an hour-old heartbeat as 6 s old). After that
        only a changed heartbeat or sequence counts, whatever the writer's clock says."""
        beat = (result.incarnation, result.heartbeat_mono_ns, result.seq)
        if self._beat is None or beat[0] != self._beat[0]:
            age = max(0.0, result.age_seconds(now))
            if not self.true_first_age:
                age = min(age, self.stale_after + 1.0)
            self._beat, self._beat_seen = beat, now - int(age * 1e9)
        elif beat != self._beat:
            self._beat, self._beat_seen = beat, now
        return (now - self._beat_seen) / 1e9

    def _clock_offset(self, result: Reading) -> int:
        """Our clock minus the writer's, from when its last heartbeat was first seen; 0 when
        that is within stale_after (the same clock, read a poll later): a stamp of the
        writer's own (a pool's oldest deferral) is then trusted as is."""
        offset = self._beat_seen - result.heartbeat_mono_ns
        return 0 if abs(offset) <= self.stale_after * 1e9 else offset

    def _log_transition(self, view: TargetView) -> None:
        level = (
            logging.INFO if view.state == UP or view.error_kind == CLOSED_KIND else logging.WARNING
        )
        # The error names the segment itself ("segment NAME: ..."): not twice per line.
        why = view.error.removeprefix(f"segment {self.name}: ")
        self.note(self.name, level, "%s -> %s%s", self.view.state, view.state, sep(why))

    def _poll(self, trusted: bool = False) -> TargetView:
        v = self.view
        now = time.monotonic_ns()
        reader = self.reader
        state_now = state_byte(reader)
        probe = not (trusted and state_now == layout.STATE_READY)
        if state_now == layout.STATE_CLOSED and not os.path.lexists(reader.path):
            # The writer marked the segment CLOSED before unlinking it: a clean shutdown,
            # not a crash ("dead ... not found" sent operators looking for one). Kept until
            # the name is forgotten or a new writer creates it again.
            return replace(
                v,
                state=DEAD,
                error=dead_message(self.name, closed=True),
                error_kind=CLOSED_KIND,
                last_poll_mono_ns=now,
            )
        if reader.mm is None or (probe and reader.replaced()):
            error = reader.attach()
            if error is not None:
                return self._failed(v, error, now)
        capacity = reader.header.slot_capacity if reader.header is not None else 0
        if capacity > self.budget.max_payload_bytes:
            # Refused before a single payload byte is copied.
            return self._over_budget(
                v,
                OverBudget(
                    "payload_bytes",
                    f"slot of {capacity} bytes > --max-payload-bytes "
                    f"{self.budget.max_payload_bytes}",
                ),
                now,
            )
        try:
            result = reader.read(size_check=probe)
        except OverBudget as e:  # raised by the bounded decoder
            return self._over_budget(v, e, now)
        if isinstance(result, ReadError):
            return self._failed(v, result, now)
        rejected: dict[str, int] = {}
        key = (result.incarnation, result.seq)
        checked = key == self._checked and v.last is not None
        if checked:
            # The same snapshot as last poll (only the heartbeat moved): checked already.
            result = msgspec.structs.replace(result, snapshot=v.last.snapshot)
        else:
            # budget.py's checks, each record decided whole in C where it is in range.
            facts = fastcheck.Facts(result.snapshot)
            try:
                fastcheck.check(result.snapshot, self.budget, facts)
            except OverBudget as e:
                return self._over_budget(v, e, now)
            wrong = identity_error(result.snapshot)
            if wrong is not None:
                return self._failed(v, Corrupt(f"segment {self.name}: {wrong}"), now)
            snapshot, rejected = fastcheck.sanitize(result.snapshot, facts)
            for f in result.rejected:  # wrong types, already None from the reader
                rejected[f] = rejected.get(f, 0) + 1
            if rejected:
                result = msgspec.structs.replace(result, snapshot=snapshot)  # a Struct
            self._checked = key
            self._cost_of = result.snapshot
        if self.shed:  # read (for its size) but not kept, nor exported
            return self.shed_view(v, now)
        restarts = v.writer_restarts_total
        if self._incarnation and result.incarnation != self._incarnation:
            restarts += 1
        self._incarnation = result.incarnation
        still = self._still_for(result, now)  # dead ones too: their age is on our clock
        offset = self._clock_offset(result)
        if not checked:  # stamps later than now on the writer's clock: rejected (budget.py)
            slack = STAMP_SLACK_NS if offset else 0
            snapshot = reject_future_stamps(result.snapshot, now - offset + slack, rejected)
            if snapshot is not result.snapshot:
                result = msgspec.structs.replace(result, snapshot=snapshot)
                self._cost_of = snapshot
            # Checked and kept as read (no value rejected): its bytes, for the gateway's
            # compiled check of the next step (gateway_step).
            raw = reader.last_bytes
            whole = not rejected and raw is not None and raw[0] == result.seq
            self.fast_base = (result.incarnation, *raw) if whole else None
        if state_byte(reader) == layout.STATE_FAULTED:
            # The engine's own fatal-error path said so: dead now, though its process may
            # still hold the lock while it is torn down, and dead after, whoever stops it.
            state, kind = DEAD, FAULTED_KIND
            error = faulted_message(self.name, reader.writer_alive())
        elif probe and not reader.writer_alive():
            closed = _closed(reader)
            state, error = DEAD, dead_message(self.name, closed)
            kind = CLOSED_KIND if closed else WRITER_DEAD_KIND
        elif still > self.stale_after:
            state = STALE
            error = stale_message(self.name, result, still, self.stale_after)
            kind = PUBLISH_FAILING_KIND if result.publish_failing else STALE_KIND
        else:
            state, error, kind = UP, "", ""
        values = v.rejected_values_total
        if rejected:
            values = dict(values)
            for f, n in rejected.items():
                values[f] = values.get(f, 0) + n
        return _evolve(
            v,
            state=state,
            error=error,
            error_kind=kind,
            last=result,
            progress_mono_ns=self._beat_seen,
            clock_offset_ns=offset,
            last_poll_mono_ns=now,
            writer_restarts_total=restarts,
            read_retries_total=v.read_retries_total + result.attempts - 1,
            rejected_values_total=values,
        )

    def budget_cost(self) -> int:
        """What it adds to the aggregate budget: its whole estimate while up or shed (it
        would be served), else its health series only (values are exported only up)."""
        if self.shed or self.view.up:
            return self.cost
        last = self.view.last
        return health_estimate(self.name, None if last is None else last.snapshot)

    def shed_view(self, v: TargetView, now: int) -> TargetView:
        return replace(
            v,
            state=REFUSED,
            error=f"segment {self.name}: over budget: {self.shed}",
            error_kind=OVER_BUDGET,
            last=None,
            last_poll_mono_ns=now,
            budget_refusals_total=bump(v.budget_refusals_total, "total"),
        )

    def _over_budget(self, v: TargetView, e: OverBudget, now: int) -> TargetView:
        # The over-budget snapshot is never kept: health series keep the last good labels.
        return replace(
            v,
            state=REFUSED,
            error=f"segment {self.name}: over budget: {e}",
            error_kind=OVER_BUDGET,
            last_poll_mono_ns=now,
            budget_refusals_total=bump(v.budget_refusals_total, e.limit),
        )

    def _failed(self, v: TargetView, error: ReadError, now: int) -> TargetView:
        if isinstance(error, Corrupt):
            state = CORRUPT
        elif error.kind == "refused" or error.kind == "version_mismatch":
            state = REFUSED
        elif error.kind == "contended":
            # Transient: the writer lapped every retry. Keep the previous state; an up one
            # stays up, with no error (error_kind is null only while up, and always then).
            state = v.state
            if state == UP:
                return replace(
                    v,
                    last_poll_mono_ns=now,
                    read_errors_total=bump(v.read_errors_total, error.kind),
                )
        elif v.last is not None and not self.reader.writer_alive():
            state = DEAD
        else:
            state = NOT_READY
        return replace(
            v,
            state=state,
            error=str(error),
            error_kind=error.kind,
            last_poll_mono_ns=now,
            read_errors_total=bump(v.read_errors_total, error.kind),
            decode_errors_total=v.decode_errors_total + (1 if isinstance(error, Corrupt) else 0),
        )

    def close(self) -> None:
        with self.lock:
            self.forgotten = True
            self.reader.close()

    def log_found(self) -> None:
        """The "found" line, once it is exported (or at once for an explicit name)."""
        view = self.view
        if view.state != NOT_READY:
            why = view.error.removeprefix(f"segment {self.name}: ")
            level = logging.INFO if view.state == UP else logging.WARNING  # corrupt, stale, ...
            self.note(self.name, level, "found, %s%s", view.state, sep(why))


def sep(why: str) -> str:
    """ ": why" for a log line, nothing when there is no why (no trailing space)."""
    return f": {why}" if why else ""
