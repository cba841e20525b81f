"""Targets: one per segment, each with its state, last good snapshot and counters.

A `Target` is polled by one thread at a time (`TargetSet` holds the lock);
readers of its state (the collector, the JSON API) only ever see an immutable
`TargetView` that the poll swaps in whole, so a scrape never observes a
half-updated target.

The shm directory is shared with other local users, so discovery is built to
cost little whatever they put there: a refused file is remembered by its
identity (in one int, up to MAX_REFUSED files) and costs at most an ``lstat`` per
rescan, a listing is paced by what it cost (at most 1/LISTING_PACE of a core however
often the directory changes), refusals are counted and summarized in one log line
per interval, the number of followed targets is capped, a file that vanished before
it could be read mints nothing, and a failing ``listdir`` keeps every known target
(see docs/security.md).
"""

from __future__ import annotations

import collections
import errno
import heapq
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass, field, replace

import msgspec

from kvsidecar.daemon.admission import Admission
from kvsidecar.daemon.budget import (
    BoundedSnapshotDecoder,
    Budget,
    OverBudget,
    check,
    exposition_estimate,
    health_estimate,
    identity_error,
    sanitize,
)
from kvsidecar.discovery import iter_segments
from kvsidecar.protocol import _seqlock, layout
from kvsidecar.protocol.names import DEFAULT_SHM_DIR
from kvsidecar.protocol.reader import (
    Corrupt,
    ReadError,
    Reading,
    SegmentReader,
    dead_message,
    stale_message,
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

# Why a discovered file is not followed (label reason of kvsidecar_segment_refusals_total).
REFUSAL_REASONS = (
    "symlink",
    "not_regular",
    "foreign_owner",
    "version",  # a newer (or older) major layout or schema version: upgrade the daemon
    "unreadable",  # the reader refused it: permissions, bad name, ...
    "vanished",  # gone before it could be read
    "max_targets",
    "admission",  # a new name waited for a token (admission.py): counted once per target
)
DEFAULT_MAX_TARGETS = 256
SUMMARY_INTERVAL = 60.0  # seconds between two refusal-summary / discovery-error log lines
# While the directory is unchanged, this many refused files are re-lstat'ed per scan (a
# file edited or chowned in place is noticed within a few scans, at a bounded cost).
RECHECK_PER_SCAN = 4096
_MTIME_SETTLE_NS = 2_000_000_000  # tmpfs mtimes are coarse: trust one only once it is this old
# Refused files remembered at most: beyond it a refused file is not remembered (nor
# counted: kvsidecar_segment_refusals_total is then a lower bound), it is lstat'ed again
# at each listing and still never followed. An entry is one int and its name: ~160 bytes.
MAX_REFUSED = 16_384
# A listing (and what it leads to) that cost d CPU-seconds is not repeated before
# LISTING_PACE * d: however often another user changes the directory, discovery takes at
# most 1/LISTING_PACE of a core, and a new engine is found within about that long.
LISTING_PACE = 20
LISTING_FREE_S = 0.005  # a listing cheaper than this is not paced (a small directory)
# While refused files are not remembered, an unchanged directory is listed again this
# often, so one of them edited or chowned in place is still noticed.
RELIST_UNREMEMBERED_S = 60.0
# Reader refusals that are the daemon's own shortage, not the file's fault: retry, never cache.
_TRANSIENT = {
    os.strerror(e): errno.errorcode[e] for e in (errno.EMFILE, errno.ENFILE, errno.ENOMEM)
}

log = logging.getLogger("kvsidecar.targets")
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
    error_kind: str = ""  # ReadError.kind, or OVER_BUDGET
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
        read 500 s old. At first sight its own age is believed up to just past
        stale_after (Target._still_for)."""
        if self.last is None:
            return None
        if not self.progress_mono_ns:
            return self.last.age_seconds(now_mono_ns)
        now = time.monotonic_ns() if now_mono_ns is None else now_mono_ns
        return max(0, now - self.progress_mono_ns) / 1e9


CLOSED_KIND = "closed"  # error_kind of a target whose writer closed it cleanly
PUBLISH_FAILING_KIND = "publish_failing"  # error_kind of a stale target failing to publish


def _closed(reader: SegmentReader) -> bool:
    """The mapped (old) segment's state byte says CLOSED; a guarded copy, never a SIGBUS."""
    raw = _seqlock.copy_range(reader.mm, layout.OFF_STATE, 1)
    return raw is not None and raw[0] == layout.STATE_CLOSED


def _bump(counts: dict[str, int], key: str, n: int = 1) -> dict[str, int]:
    out = dict(counts)
    out[key] = out.get(key, 0) + n
    return out


class Target:
    """One segment name, followed across writer restarts."""

    def __init__(
        self,
        name: str,
        shm_dir: str,
        *,
        stale_after: float,
        allowed_uids: frozenset[int] | None = None,
        budget: Budget | None = None,
        explicit: bool = False,
        note: NameThrottle | None = None,
    ) -> None:
        self.name = name
        self.note = note or NameThrottle()  # its log lines, throttled per name
        self.stale_after = stale_after
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

    @property
    def cost(self) -> int:
        """exposition_estimate of the last good snapshot (0 before one): the aggregate budget."""
        snapshot = self._cost_of
        if snapshot is None:
            return 0
        if self._cost[0] is not snapshot:
            self._cost = (snapshot, exposition_estimate(snapshot, self.name))
        return self._cost[1]

    def poll(self, log_transitions: bool = True) -> TargetView:
        """Attach if needed, read, classify. Never raises."""
        with self.lock:
            if self.forgotten:
                return replace(self.view, state=NOT_READY, error=f"segment {self.name}: forgotten")
            try:
                view = self._poll()
            except Exception as e:  # a bug must not take the daemon down with it
                view = replace(self.view, state=CORRUPT, error=f"internal error: {e!r}")
            if log_transitions and view.state != self.view.state:
                self._log_transition(view)
            if view.state == DEAD and self.view.state != DEAD:
                self.dead_since = time.monotonic()
            self.view = view
            self.ever_up = self.ever_up or view.up
            return view

    def _still_for(self, result: Reading, now: int) -> float:
        """Seconds, on the daemon's clock, since the writer last showed progress. At first
        sight the writer's own age is believed up to just past stale_after (so an engine
        already hung reads stale at once when the clocks agree); after that only a
        changed heartbeat or sequence counts, whatever the writer's clock says."""
        beat = (result.incarnation, result.heartbeat_mono_ns, result.seq)
        if self._beat is None or beat[0] != self._beat[0]:
            age = min(max(0.0, result.age_seconds(now)), self.stale_after + 1.0)
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
        self.note(self.name, level, "%s -> %s%s", self.view.state, view.state, _sep(why))

    def _poll(self) -> TargetView:
        v = self.view
        now = time.monotonic_ns()
        reader = self.reader
        if reader.mm is not None and _closed(reader) and not os.path.lexists(reader.path):
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
        if reader.mm is None or reader.replaced():
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
            result = reader.read()
        except OverBudget as e:  # raised by the bounded decoder
            return self._over_budget(v, e, now)
        if isinstance(result, ReadError):
            return self._failed(v, result, now)
        rejected: dict[str, int] = {}
        key = (result.incarnation, result.seq)
        if key == self._checked and v.last is not None:
            # The same snapshot as last poll (only the heartbeat moved): checked already.
            result = msgspec.structs.replace(result, snapshot=v.last.snapshot)
        else:
            try:
                check(result.snapshot, self.budget)
            except OverBudget as e:
                return self._over_budget(v, e, now)
            wrong = identity_error(result.snapshot)
            if wrong is not None:
                return self._failed(v, Corrupt(f"segment {self.name}: {wrong}"), now)
            snapshot, rejected = sanitize(result.snapshot)
            for f in result.rejected:  # wrong types, already None from the reader
                rejected[f] = rejected.get(f, 0) + 1
            if rejected:
                result = msgspec.structs.replace(result, snapshot=snapshot)  # a Struct
            self._checked = key
            self._cost_of = result.snapshot
        if self.shed:  # read (for its size) but not kept, nor exported
            return self._shed_view(v, now)
        restarts = v.writer_restarts_total
        if self._incarnation and result.incarnation != self._incarnation:
            restarts += 1
        self._incarnation = result.incarnation
        kind = ""
        still = self._still_for(result, now)  # dead ones too: their age is on our clock
        if not reader.writer_alive():
            closed = _closed(reader)
            state, error = DEAD, dead_message(self.name, closed)
            kind = CLOSED_KIND if closed else ""
        elif still > self.stale_after:
            state = STALE
            error = stale_message(self.name, result, still, self.stale_after)
            kind = PUBLISH_FAILING_KIND if result.publish_failing else ""
        else:
            state, error = UP, ""
        values = v.rejected_values_total
        if rejected:
            values = dict(values)
            for f, n in rejected.items():
                values[f] = values.get(f, 0) + n
        return replace(
            v,
            state=state,
            error=error,
            error_kind=kind,
            last=result,
            progress_mono_ns=self._beat_seen,
            clock_offset_ns=self._clock_offset(result),
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

    def _shed_view(self, v: TargetView, now: int) -> TargetView:
        return replace(
            v,
            state=REFUSED,
            error=f"segment {self.name}: over budget: {self.shed}",
            error_kind=OVER_BUDGET,
            last=None,
            last_poll_mono_ns=now,
            budget_refusals_total=_bump(v.budget_refusals_total, "total"),
        )

    def _over_budget(self, v: TargetView, e: OverBudget, now: int) -> TargetView:
        # The over-budget snapshot is never kept: health series keep the last good labels.
        return replace(
            v,
            state=REFUSED,
            error=f"segment {self.name}: over budget: {e}",
            error_kind=OVER_BUDGET,
            last_poll_mono_ns=now,
            budget_refusals_total=_bump(v.budget_refusals_total, e.limit),
        )

    def _failed(self, v: TargetView, error: ReadError, now: int) -> TargetView:
        if isinstance(error, Corrupt):
            state = CORRUPT
        elif error.kind == "refused" or error.kind == "version_mismatch":
            state = REFUSED
        elif error.kind == "contended":
            # Transient: the writer lapped every retry. Keep the previous state.
            state = v.state
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
            read_errors_total=_bump(v.read_errors_total, error.kind),
            decode_errors_total=v.decode_errors_total + (1 if isinstance(error, Corrupt) else 0),
        )

    def close(self) -> None:
        with self.lock:
            self.forgotten = True
            self.reader.close()


class OpenDirectory(OSError):
    """The segment directory lets any user delete or replace what is in it."""


def _refuse_open_directory(path: str, st: os.stat_result) -> None:
    # World-writable without the sticky bit: any local user can unlink the live segment
    # (the engine is not told) or rename their own file in its place. /dev/shm is 1777.
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise OpenDirectory(
            errno.EPERM,
            f"refusing {path}: writable by every user (mode {stat.S_IMODE(st.st_mode):04o}, "
            "not sticky), so anyone could delete or replace a live segment; "
            f"chmod 0750 {path} (or remove it: the agent creates it private)",
        )


# A remembered refusal is one int, not an object with five fields (44 bytes, not ~170, and
# not tracked by the garbage collector): bits 0-63 the inode from readdir (a replaced file
# is noticed without a stat), 64-127 the _file_key (an edited file is looked at again),
# 128-131 the reason, 132-139 the listing that last saw it (so a listing marks what it
# sees in place, building no set of 16,384 names), 140- the owner's uid + 1 (for a
# foreign_owner message that names it).
_M64 = (1 << 64) - 1
_GEN_SHIFT, _GEN_MASK = 132, 255
_REASON_CODE = {r: i for i, r in enumerate(REFUSAL_REASONS)}
# Which refusals the JSON API names first: an engine the daemon will not follow before
# files an lstat refuses (another user's, symlinks, FIFOs), which a neighbour can flood.
_REFUSED_ORDER = {
    r: i
    for i, r in enumerate(
        ("version", "unreadable", "max_targets", "admission", "vanished", "not_regular",
         "symlink", "foreign_owner")
    )
}  # fmt: skip


def _pack(ino: int, key: int, reason: str, uid: int, gen: int) -> int:
    return (ino & _M64) | key << 64 | _REASON_CODE[reason] << 128 | gen << 132 | (uid + 1) << 140


def _ino(entry: int) -> int:
    return entry & _M64


def _key(entry: int) -> int:
    return entry >> 64 & _M64


def _reason(entry: int) -> str:
    return REFUSAL_REASONS[entry >> 128 & 15]


def _gen(entry: int) -> int:
    return entry >> _GEN_SHIFT & _GEN_MASK


def _with_gen(entry: int, gen: int) -> int:
    return entry & ~(_GEN_MASK << _GEN_SHIFT) | gen << _GEN_SHIFT


def _uid(entry: int) -> int:
    return (entry >> 140) - 1


def _file_key(st: os.stat_result) -> int:
    """What changes when a file is replaced, edited or chowned in place."""
    return hash((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)) & _M64


def _sep(why: str) -> str:
    """ ": why" for a log line, nothing when there is no why (no trailing space)."""
    return f": {why}" if why else ""


def _transient_cause(error: str) -> str | None:
    for text, cause in _TRANSIENT.items():
        if error.endswith(text):
            return cause
    return None


class TargetSet:
    """All targets of one daemon: discovery, polling, and a consistent list of views."""

    def __init__(
        self,
        shm_dir: str,
        *,
        prefix: str = "",
        names: list[str] | None = None,
        pattern: str | None = None,
        stale_after: float = 5.0,
        poll_interval: float = 0.25,
        rediscover_interval: float = 1.0,
        allowed_uids: frozenset[int] | None = None,
        budget: Budget | None = None,
        max_targets: int = DEFAULT_MAX_TARGETS,
        confirm_after: float = 0.0,
        summary_interval: float = SUMMARY_INTERVAL,
        recheck_per_scan: int = RECHECK_PER_SCAN,
        admission: Admission | None = None,
        max_refused: int = MAX_REFUSED,
    ) -> None:
        self.shm_dir = shm_dir
        self.prefix = prefix
        self.explicit = list(names or [])
        self.pattern = pattern
        self.stale_after = stale_after
        self.poll_interval = poll_interval
        self.rediscover_interval = rediscover_interval
        self.allowed_uids = allowed_uids
        self.budget = budget or Budget()
        self.max_targets = max_targets
        # A new target with no good reading stays hidden this long, so a file that
        # vanishes within a scan interval never mints a series.
        self.confirm_after = confirm_after
        # How fast new names may become labels (None: no limit, as for dump and ls).
        self.admission = admission
        self.waiting = 0  # targets followed but not exported: waiting for admission
        self.summary_interval = summary_interval
        self.recheck_per_scan = recheck_per_scan
        self._recheck_queue: list[str] = []
        self.targets: dict[str, Target] = {}
        self.max_refused = max_refused
        self._refused: dict[str, int] = {}  # name -> _pack(...)
        self._messages: dict[str, str] = {}  # the few refusals whose message is not rebuilt
        self.unremembered = 0  # refused files of the last listing with no room in _refused
        self._overflow = 0  # counting them during a listing
        self._gen = 0  # the current listing's number (mod 256), marked on what it sees
        self._unremembered_logged = 0
        self._next_listing = 0.0  # monotonic time before which the directory is not listed
        self._relist_at = float("inf")  # an unchanged directory is listed again then
        self._note = NameThrottle()  # per-name log lines (found, gone, state changes)
        self.refusals_total: dict[str, int] = {}  # by reason: each refused file counted once
        self.discovery_errors_total: dict[str, int] = {}  # by cause (errno name)
        self.discovery_error = ""  # "" while listing the directory works
        self.version = 0  # bumped on every poll cycle: invalidates rendered output
        self.last_poll_mono_ns = 0
        self.last_poll_duration_s = 0.0
        self.polls_total = 0
        self._last_discovery = 0.0
        self._dir_key: tuple[int, int, int, int] | None = None
        self._pending: dict[str, int] = {}  # refusals since the last summary line
        self._pending_example = ""
        self._last_summary = float("-inf")
        self._error_logged: dict[str, float] = {}
        self._waiting_logged = False  # "the default directory does not exist yet", once
        self._default_dir_said: tuple | None = None  # what _warn_default_dir last warned of
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- discovery ------------------------------------------------------------

    @property
    def refused(self) -> dict[str, str]:
        """Discovered files not followed now and remembered: name -> why."""
        return {
            n: self._messages.get(n) or self._message(n, _reason(e), _uid(e))
            for n, e in self._refused.items()
        }

    @property
    def refused_count(self) -> int:
        """Files not followed now: those remembered, and those beyond MAX_REFUSED."""
        return len(self._refused) + self.unremembered

    def refused_files(self, limit: int) -> list[tuple[str, str, str]]:
        """(name, reason, why) of at most `limit` refused files, for the JSON API: the
        reasons an operator acts on first (version, unreadable, max_targets...), then by
        name, so a flood of foreign files cannot hide an engine refused for its version."""
        # list() copies the items atomically; the poller may change the dict meanwhile.
        entries = list(self._refused.items())
        first = heapq.nsmallest(
            limit, entries, key=lambda e: (_REFUSED_ORDER.get(_reason(e[1]), 99), e[0])
        )
        return [
            (n, _reason(e), self._messages.get(n) or self._message(n, _reason(e), _uid(e)))
            for n, e in first
        ]

    def refused_by_reason(self) -> dict[str, int]:
        """Files refused now and remembered, by reason (a bounded label set)."""
        counts: dict[str, int] = {}
        for entry in list(self._refused.values()):
            reason = _reason(entry)
            counts[reason] = counts.get(reason, 0) + 1
        return counts

    def _message(self, name: str, reason: str, uid: int = -1) -> str:
        path = os.path.join(self.shm_dir, name)
        owner = f"owned by uid {uid}, " if uid >= 0 else ""
        return {
            "symlink": f"{path} is a symlink: refused (segments are never followed)",
            "not_regular": f"{path} is not a regular file (FIFO/device?): refused",
            "foreign_owner": f"{path} is {owner}not an allowed writer: pass --allow-uid "
            f"{uid if uid >= 0 else 'UID'} to trust it",
            "max_targets": f"{path}: already following --max-targets {self.max_targets} segments",
        }.get(reason, f"{path}: refused ({reason})")

    def discover(self) -> None:
        """Add new segments, forget segments whose file is gone (explicit names are kept).

        A discovered file we refuse (symlink, FIFO, foreign owner, newer major
        version, over --max-targets) does not become a target: anyone who can
        write the shm directory could otherwise mint series. It is counted once
        per file identity, summarized in the log, and looked at again only when
        it changes (or its slot frees up, for --max-targets).
        """
        now = time.monotonic()
        self._last_discovery = now
        cpu = time.thread_time()
        try:
            st = os.stat(self.shm_dir)
            _refuse_open_directory(self.shm_dir, st)
            if self.shm_dir == DEFAULT_SHM_DIR:
                self._warn_default_dir(st)
            # ctime too: a chmod (an unreadable directory) must be seen at once.
            dir_key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
            # Unchanged: nothing was added, removed or renamed since the last listing.
            # Changed too soon: the last listing's cost says wait (a flood of changes).
            if (dir_key == self._dir_key and now < self._relist_at) or now < self._next_listing:
                self._discovery_ok()
                self._recheck_some()
                self._flush_summary(now)
                return
            seen, todo = self._list()
        except FileNotFoundError as e:
            if self.shm_dir != DEFAULT_SHM_DIR:
                self._discovery_failed(e, now)
                return
            # The agent creates the default directory with the first engine: until then
            # there is no segment (not an error), and nothing known can be kept either.
            if not self._waiting_logged:  # once: say where we look, or nothing shows it
                log.info(
                    "%s does not exist yet: no segments until the first engine's agent creates it",
                    self.shm_dir,
                )
                self._waiting_logged = True
            self._discovery_ok()
            self._dir_key = None
            self._refused.clear()
            self._rescan(set(), [])
            self.unremembered = 0
            self._flush_summary(now)
            return
        except OSError as e:
            self._discovery_failed(e, now)
            return  # keep every known target: a listing error is not "no segments"
        self._discovery_ok()
        settled = time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > _MTIME_SETTLE_NS
        self._dir_key = dir_key if settled else None
        self._rescan(seen, todo)
        self.unremembered = self._overflow
        self._relist_at = now + RELIST_UNREMEMBERED_S if self.unremembered else float("inf")
        cost = time.thread_time() - cpu
        self._next_listing = now + LISTING_PACE * cost if cost > LISTING_FREE_S else 0.0
        self._flush_summary(now)

    def _list(self) -> tuple[set[str], list[tuple[str, int]]]:
        """One pass over the directory, keeping nothing per entry: the targets it lists,
        and the (name, inode) to consider (new or replaced files an lstat does not
        refuse, explicit names, --max-targets retries). A new file that an lstat refuses
        (foreign owner, symlink, FIFO) is refused here; each remembered refusal listed is
        marked with this listing's number."""
        targets, refused, explicit = self.targets, self._refused, set(self.explicit)
        gen = self._gen = (self._gen + 1) & _GEN_MASK
        room = len(targets) < self.max_targets
        # At the cap, files refused for it are looked at again, a few per scan, while a
        # target that was never up holds a slot: a live engine may take that slot.
        retry = self.recheck_per_scan if room or self._junk() is not None else 0
        seen: set[str] = set()  # bounded: targets only
        todo = []
        self._overflow = 0
        for name, ino in iter_segments(self.shm_dir, self.prefix, self.pattern):
            if name in targets:
                seen.add(name)
                continue
            entry = refused.get(name)
            # The same refused file as before costs nothing (the inode comes from readdir).
            if entry is not None and _ino(entry) == ino:
                refused[name] = _with_gen(entry, gen)
                if _reason(entry) == "max_targets" and retry:
                    retry -= 1
                    todo.append((name, ino))
                continue
            if name in explicit or self._screen(name, ino) is not None:
                todo.append((name, ino))
        return seen, todo

    def _recheck_some(self) -> None:
        """Re-lstat the next slice of refused files; look again at those that changed."""
        queue = self._recheck_queue
        if not queue:
            queue = self._recheck_queue = [
                n for n, e in self._refused.items() if _reason(e) != "max_targets"
            ]
        batch = queue[-self.recheck_per_scan :]
        del queue[-self.recheck_per_scan :]
        explicit = set(self.explicit)
        for name in batch:
            entry = self._refused.get(name)
            if entry is None:
                continue
            try:
                st = os.lstat(self.shm_dir + "/" + name)
            except OSError:
                continue  # gone: the directory changed, the next scan sees it
            if _file_key(st) != _key(entry):
                self._consider(name, _ino(entry), name in explicit)

    def _rescan(self, seen: set[str], todo: list[tuple[str, int]]) -> None:
        """After a listing: forget what it no longer shows (targets not in `seen`,
        refusals it did not mark), then consider `todo`."""
        explicit = set(self.explicit)
        for name in sorted(self.targets.keys() - seen - explicit):
            if self.targets[name].shown:  # a hidden one was never logged as found
                self._note(name, logging.INFO, "gone, forgetting it")
            self.targets.pop(name).close()
        gen = self._gen
        for name in [n for n, e in self._refused.items() if _gen(e) != gen]:
            del self._refused[name]
        for name in [n for n in self._messages if n not in self._refused]:
            del self._messages[name]
        todo.extend((n, 0) for n in explicit - self.targets.keys() - {n for n, _ in todo})
        for name, ino in sorted(todo, key=lambda t: (t[0] not in explicit, t[0])):
            self._consider(name, ino, name in explicit)

    def _junk(self) -> Target | None:
        """What a live engine may displace at --max-targets: the target admitted longest ago
        that has never been up (dead, empty or corrupt from its first read), else the one
        dead longest (a crash loop's leftovers: 256 segments up once, then dead, kept a new
        engine out for as long as their files remained)."""
        never_up = [t for t in self.targets.values() if not t.ever_up and not t.explicit]
        if never_up:
            return min(never_up, key=lambda t: t.admitted_mono)
        dead = [t for t in self.targets.values() if t.view.state == DEAD and not t.explicit]
        return min(dead, key=lambda t: t.dead_since) if dead else None

    def _screen(self, name: str, ino: int) -> int | None:
        """What an lstat says of a discovered file: None if that settles it (refused now,
        refused before and unchanged, or vanished), else its _file_key (0: no lstat)."""
        try:
            st = os.lstat(self.shm_dir + "/" + name)
        except FileNotFoundError:
            self._refuse(name, "vanished")
            return None
        except OSError:
            return 0
        entry = self._refused.get(name)
        if entry is None and len(self._refused) >= self.max_refused:
            # No room to remember it: refused again at each listing, so keep this cheap.
            if self._classify(st) is None:
                return _file_key(st)
            self._overflow += 1
            return None
        key = _file_key(st)
        if entry is not None and _key(entry) == key and _reason(entry) != "max_targets":
            self._refused[name] = _pack(ino, key, _reason(entry), _uid(entry), self._gen)
            return None  # unchanged since it was refused
        reason = self._classify(st)
        if reason is None:
            return key
        # A directory is not a FIFO or a device: say what it is (rare: kept).
        why = f"{self.shm_dir}/{name} is a directory: refused" if stat.S_ISDIR(st.st_mode) else None
        self._refuse(name, reason, ino, key, why, uid=st.st_uid)
        return None

    def _consider(self, name: str, ino: int, explicit: bool) -> None:
        key = 0
        if not explicit:
            screened = self._screen(name, ino)
            if screened is None:
                return
            key = screened
        full = not explicit and len(self.targets) >= self.max_targets
        if full and self._junk() is None:
            self._refuse(name, "max_targets", ino, key)
            return
        target = Target(
            name,
            self.shm_dir,
            stale_after=self.stale_after,
            allowed_uids=self.allowed_uids,
            budget=self.budget,
            explicit=explicit,
            note=self._note,
        )
        view = target.poll(log_transitions=False)
        if full:
            junk = self._junk()
            if not view.up or junk is None:  # junk never displaces junk
                target.close()
                self._refuse(name, "max_targets", ino, key)
                return
            log.warning(
                "%s: --max-targets %d reached: dropping %s (%s: %s) for it",
                name, self.max_targets, junk.name,
                "dead" if junk.ever_up else "never up", junk.view.state,
            )  # fmt: skip
            self.targets.pop(junk.name).close()
            self._refuse(junk.name, "max_targets")
        if not explicit:
            if view.error_kind == "not_found":
                target.close()
                self._refuse(name, "vanished")
                return
            if view.state == REFUSED and view.error_kind != OVER_BUDGET:
                target.close()
                cause = _transient_cause(view.error)
                if cause is not None:  # our shortage (fds, memory): retry next scan
                    self.discovery_errors_total = _bump(self.discovery_errors_total, cause)
                    self._log_error(cause, f"cannot open segments: {view.error}")
                    return
                reason = "version" if view.error_kind == "version_mismatch" else "unreadable"
                self._refuse(name, reason, ino, key, view.error)
                return
        if explicit:  # the others are logged once admitted (_admit)
            self._log_found(target)
        self._refused.pop(name, None)
        self.targets[name] = target

    def _log_found(self, target: Target) -> None:
        view = target.view
        if view.state != NOT_READY:
            why = view.error.removeprefix(f"segment {target.name}: ")
            level = logging.INFO if view.state == UP else logging.WARNING  # corrupt, stale, ...
            self._note(target.name, level, "found, %s%s", view.state, _sep(why))

    def _admit(self) -> None:
        """Export the hidden targets that may mint a `segment` label now.

        A target with no good reading stays hidden `confirm_after` (a file that vanishes
        within a scan interval mints nothing); then, with an `Admission`, a name never
        exported before waits for a token, live targets first, then the one followed
        longest (admission.py). Hidden targets log nothing: each is counted once as
        `admission` in the refusal summary.
        """
        now = time.monotonic()
        hidden = [
            t
            for t in self.targets.values()
            if not t.shown
            and (t.view.last is not None or now - t.admitted_mono >= self.confirm_after)
        ]
        if self.admission is not None:
            hidden.sort(key=lambda t: (not t.ever_up, t.admitted_mono))
            admitted = set(self.admission.admit(t.name for t in hidden))
        else:
            admitted = {t.name for t in hidden}
        for t in hidden:
            if t.name in admitted:
                t.shown = True
                self._log_found(t)
            elif not t.waited and self.admission is not None:
                t.waited = True
                why = f"{self.shm_dir}/{t.name}: {self.admission.why_waiting()}"
                self._refuse(t.name, "admission", message=why)
        self.waiting = len(hidden) - len(admitted)

    def _classify(self, st: os.stat_result) -> str | None:
        """What an lstat alone tells (no open): the reader checks again on its descriptor."""
        if stat.S_ISLNK(st.st_mode):
            return "symlink"
        if not stat.S_ISREG(st.st_mode):
            return "not_regular"
        if self.allowed_uids is not None and st.st_uid not in self.allowed_uids:
            return "foreign_owner"
        return None

    def _refuse(
        self,
        name: str,
        reason: str,
        ino: int | None = None,
        key: int = 0,
        message: str | None = None,
        uid: int = -1,
    ) -> None:
        """Count a refusal; with ino, remember the file so it is not looked at again.
        A file refused again for the same reason (same inode) is not counted again. With
        MAX_REFUSED files remembered, a new one is neither remembered nor counted (it is
        refused again at each listing: counting it each time would overstate)."""
        old = self._refused.get(name)
        if ino is not None:
            if old is None and len(self._refused) >= self.max_refused:
                self._overflow += 1  # _screen's shortcut does the same
                return
            self._refused[name] = _pack(ino, key, reason, uid, self._gen)
            if message is None:
                self._messages.pop(name, None)
            else:
                self._messages[name] = message
            if old is not None and _ino(old) == ino and _reason(old) == reason:
                return
        self.refusals_total = _bump(self.refusals_total, reason)
        self._pending[reason] = self._pending.get(reason, 0) + 1
        if not self._pending_example:
            self._pending_example = f"{name}: {message or self._message(name, reason, uid)}"

    def _flush_summary(self, now: float) -> None:
        """One log line per interval for every refusal since the last one."""
        if not self.unremembered:
            self._unremembered_logged = 0
        more = self.unremembered and self.unremembered != self._unremembered_logged
        if not (self._pending or more) or now - self._last_summary < self.summary_interval:
            return
        if self.summary_interval == float("inf"):
            return  # dump/ls list the refusals themselves: no second copy in a log line
        if self._pending:
            total = sum(self._pending.values())
            kinds = ", ".join(f"{n} {r}" for r, n in sorted(self._pending.items()))
            example = self._pending_example
            log.warning("refused %d file(s) in %s (%s); e.g. %s", total, self.shm_dir, kinds,
                        example)  # fmt: skip
        if more:
            log.warning(
                "%d more refused file(s) in %s beyond the %d remembered: refused again at each "
                "listing, not counted in kvsidecar_segment_refusals_total",
                self.unremembered, self.shm_dir, self.max_refused,
            )  # fmt: skip
        self._unremembered_logged = self.unremembered
        self._pending, self._pending_example = {}, ""
        self._last_summary = now

    def _warn_default_dir(self, st: os.stat_result) -> None:
        """Warn, once per change, of a default directory that is a symlink or owned by a
        user we do not trust: /dev/shm is writable by everyone, so whoever created it first
        chose where segments are read from, and may replace any of them (issue 31)."""
        path = self.shm_dir
        try:
            link = os.readlink(path) if os.path.islink(path) else None
        except OSError:
            link = None
        trusted = {os.geteuid(), 0} | set(self.allowed_uids or ())
        foreign = self.allowed_uids is not None and st.st_uid not in trusted
        said = (st.st_dev, st.st_ino, st.st_uid, link) if link or foreign else None
        if said == self._default_dir_said:
            return
        self._default_dir_said = said
        if link is not None:
            log.warning(
                "%s is a symlink to %s: whoever created it chose the directory segments are "
                "read from; remove it (the agent creates the directory, private) or pass "
                "--shm-dir with the real path", path, link,
            )  # fmt: skip
        if foreign:
            log.warning(
                "%s is owned by uid %d, not by this daemon's user, root or an --allow-uid: "
                "that user can delete or replace any segment in it; if the engine runs as "
                "uid %d pass --allow-uid %d, else remove the directory (the agent creates "
                "it 0750)", path, st.st_uid, st.st_uid, st.st_uid,
            )  # fmt: skip

    def _discovery_failed(self, e: OSError, now: float) -> None:
        cause = errno.errorcode.get(e.errno or 0, "other")
        self.discovery_errors_total = _bump(self.discovery_errors_total, cause)
        self.discovery_error = f"cannot list {self.shm_dir}: {e.strerror or e} ({cause})"
        self._dir_key = None
        self._log_error(
            cause, f"{self.discovery_error}; keeping the {len(self.targets)} known target(s)"
        )

    def _log_error(self, cause: str, message: str) -> None:
        now = time.monotonic()
        if now - self._error_logged.get(cause, float("-inf")) >= self.summary_interval:
            self._error_logged[cause] = now
            log.warning("%s (logged once per %.0f s)", message, self.summary_interval)

    def _discovery_ok(self) -> None:
        if self.discovery_error:
            log.info("listing %s works again", self.shm_dir)
            self.discovery_error = ""

    # -- polling --------------------------------------------------------------

    def poll_all(self) -> None:
        with self._lock:
            self._poll_locked()

    def _poll_locked(self) -> None:
        t0 = time.monotonic()
        if t0 - self._last_discovery >= self.rediscover_interval or not self.targets:
            self.discover()
        for name, target in list(self.targets.items()):
            view = target.poll(log_transitions=target.shown)
            if not target.explicit and view.error_kind == "not_found" and view.last is None:
                # Vanished before it could ever be read: forget it now, not at the next scan.
                self.targets.pop(name).close()
                self._refuse(name, "vanished")
        self._admit()
        self._apply_total_budget()
        self.version += 1
        self.polls_total += 1
        self.last_poll_mono_ns = time.monotonic_ns()
        self.last_poll_duration_s = time.monotonic() - t0

    def _apply_total_budget(self) -> None:
        """Keep targets while their exposition fits ``max_exposition_bytes`` together, by
        seniority: those served longest first, then those found first; shed the others
        with a reason. Keeping the smallest let 72 slightly smaller junk targets of the
        engine's uid shed the real engine; "always at least one" let one target alone
        take the daemon to 444 MB."""
        limit = self.budget.max_exposition_bytes
        # Served, or shed by this budget (they may fit again); not those over their own,
        # nor hidden ones (they export nothing).
        costed = sorted(
            (
                t
                for t in self.targets.values()
                if t.shown and (t.shed or (t.cost and t.view.error_kind != OVER_BUDGET))
            ),
            key=lambda t: (t.served_since is None, t.served_since or t.admitted_mono, t.name),
        )
        now = time.monotonic()
        ranked = set(costed)
        total = sum(t.budget_cost() for t in self.targets.values() if t.shown and t not in ranked)
        for t in costed:
            cost = t.budget_cost()
            if total + cost <= limit:
                total += cost
                t.shed = ""  # served again from the next poll
                if t.served_since is None and t.view.up:
                    t.served_since = now
                continue
            t.served_since = None  # shed: it queues again behind those served meanwhile
            if not t.shed:
                t.shed = (
                    f"the targets together would export ~{(total + cost) / 2**20:.1f} MiB "
                    f"> --max-exposition-bytes {limit} (this one ~{cost / 2**10:.0f} KiB; "
                    "those served longest are kept first)"
                )
                t.view = t._shed_view(t.view, time.monotonic_ns())
                # Throttled per name: one flapping target logged 35 lines in 20 s.
                self._note(t.name, logging.WARNING, "shed: %s", t.shed)

    def refresh_if_older(self, max_age: float) -> None:
        """Read fresh at scrape time when the last poll is older than max_age."""
        if (time.monotonic_ns() - self.last_poll_mono_ns) / 1e9 <= max_age:
            return
        with self._lock:
            if (time.monotonic_ns() - self.last_poll_mono_ns) / 1e9 > max_age:
                self._poll_locked()

    def views(self) -> list[TargetView]:
        """The exported targets: explicit ones, and the others once admitted (_admit)."""
        return [t.view for t in list(self.targets.values()) if t.shown]

    # -- background thread ------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvsidecar-poller", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            self.poll_all()
            self._stop.wait(max(0.0, self.poll_interval - (time.monotonic() - start)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            for target in self.targets.values():
                target.close()
            self.targets.clear()
