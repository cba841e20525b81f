"""Targets: one per segment, each with its state, last good snapshot and counters.

A `Target` is polled by one thread at a time (`TargetSet` holds the lock);
readers of its state (the collector, the JSON API) only ever see an immutable
`TargetView` that the poll swaps in whole, so a scrape never observes a
half-updated target.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace

from kvsidecar.discovery import list_segments
from kvsidecar.protocol.reader import Corrupt, ReadError, Reading, SegmentReader

UP, STALE, DEAD, CORRUPT, NOT_READY, REFUSED = (
    "up",
    "stale",
    "dead",
    "corrupt",
    "not_ready",
    "refused",
)
STATES = (UP, STALE, DEAD, CORRUPT, NOT_READY, REFUSED)

log = logging.getLogger("kvsidecar.targets")


@dataclass(frozen=True)
class TargetView:
    """What the outside world sees of a target; replaced whole on every poll."""

    name: str
    state: str = NOT_READY
    error: str = ""
    last: Reading | None = None  # last good reading, kept across dead/stale/corrupt
    last_poll_mono_ns: int = 0
    writer_restarts_total: int = 0
    read_retries_total: int = 0
    decode_errors_total: int = 0
    read_errors_total: dict[str, int] = field(default_factory=dict)

    @property
    def up(self) -> bool:
        return self.state == UP

    def age_seconds(self, now_mono_ns: int | None = None) -> float | None:
        return None if self.last is None else self.last.age_seconds(now_mono_ns)


class Target:
    """One segment name, followed across writer restarts."""

    def __init__(
        self,
        name: str,
        shm_dir: str,
        *,
        stale_after: float,
        allowed_uids: frozenset[int] | None = None,
    ) -> None:
        self.name = name
        self.stale_after = stale_after
        self.reader = SegmentReader(name, shm_dir=shm_dir, allowed_uids=allowed_uids)
        self.view = TargetView(name=name)
        self._incarnation = 0

    def poll(self, log_transitions: bool = True) -> TargetView:
        """Attach if needed, read, classify. Never raises."""
        try:
            view = self._poll()
        except Exception as e:  # a bug must not take the daemon down with it
            view = replace(self.view, state=CORRUPT, error=f"internal error: {e!r}")
        if log_transitions and view.state != self.view.state:
            level = logging.INFO if view.state == UP else logging.WARNING
            log.log(level, "%s: %s -> %s %s", self.name, self.view.state, view.state, view.error)
        self.view = view
        return view

    def _poll(self) -> TargetView:
        v = self.view
        now = time.monotonic_ns()
        reader = self.reader
        if reader.mm is None or reader.replaced():
            error = reader.attach()
            if error is not None:
                return self._failed(v, error, now)
        result = reader.read()
        if isinstance(result, ReadError):
            return self._failed(v, result, now)
        restarts = v.writer_restarts_total
        if self._incarnation and result.incarnation != self._incarnation:
            restarts += 1
        self._incarnation = result.incarnation
        if not reader.writer_alive():
            state, error = DEAD, f"segment {self.name}: writer is gone (no process holds its lock)"
        elif result.age_seconds(now) > self.stale_after:
            state = STALE
            error = (
                f"segment {self.name}: heartbeat {result.age_seconds(now):.1f}s old "
                f"(> {self.stale_after}s): engine hung or stopped"
            )
        else:
            state, error = UP, ""
        return replace(
            v,
            state=state,
            error=error,
            last=result,
            last_poll_mono_ns=now,
            writer_restarts_total=restarts,
            read_retries_total=v.read_retries_total + result.attempts - 1,
        )

    def _failed(self, v: TargetView, error: ReadError, now: int) -> TargetView:
        errors = dict(v.read_errors_total)
        errors[error.kind] = errors.get(error.kind, 0) + 1
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
            last_poll_mono_ns=now,
            read_errors_total=errors,
            decode_errors_total=v.decode_errors_total + (1 if isinstance(error, Corrupt) else 0),
        )

    def close(self) -> None:
        self.reader.close()


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
    ) -> None:
        self.shm_dir = shm_dir
        self.prefix = prefix
        self.explicit = list(names or [])
        self.pattern = pattern
        self.stale_after = stale_after
        self.poll_interval = poll_interval
        self.rediscover_interval = rediscover_interval
        self.allowed_uids = allowed_uids
        self.targets: dict[str, Target] = {}
        self.refused: dict[str, str] = {}  # name -> why, for discovered files we will not read
        self.version = 0  # bumped on every poll cycle: invalidates rendered output
        self.last_poll_mono_ns = 0
        self.last_poll_duration_s = 0.0
        self.polls_total = 0
        self._last_discovery = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- discovery ------------------------------------------------------------

    def discover(self) -> None:
        """Add new segments, forget segments whose file is gone (explicit names are kept).

        A discovered file we refuse (symlink, FIFO, foreign owner, newer major
        version) does not become a target: anyone who can write the shm
        directory could otherwise mint series. It is logged once per reason,
        counted in ``refused``, and looked at again at the next discovery.
        """
        listed = list_segments(self.shm_dir, self.prefix, self.pattern)
        found = set(self.explicit) | set(listed)
        refused: dict[str, str] = {}
        for name in sorted(found - self.targets.keys()):
            target = Target(
                name, self.shm_dir, stale_after=self.stale_after, allowed_uids=self.allowed_uids
            )
            view = target.poll(log_transitions=False)
            if view.state == REFUSED and name not in self.explicit:
                target.close()
                refused[name] = view.error
                if self.refused.get(name) != view.error:
                    log.warning("refusing %s: %s", name, view.error)
                continue
            if view.state != NOT_READY:
                log.info("%s: found, %s %s", name, view.state, view.error)
            self.targets[name] = target
        self.refused = refused
        for name in list(self.targets.keys() - found):
            log.info("%s: gone, forgetting it", name)
            self.targets.pop(name).close()
        self._last_discovery = time.monotonic()

    # -- polling --------------------------------------------------------------

    def poll_all(self) -> None:
        with self._lock:
            self._poll_locked()

    def _poll_locked(self) -> None:
        t0 = time.monotonic()
        if t0 - self._last_discovery >= self.rediscover_interval or not self.targets:
            self.discover()
        for target in list(self.targets.values()):
            target.poll()
        self.version += 1
        self.polls_total += 1
        self.last_poll_mono_ns = time.monotonic_ns()
        self.last_poll_duration_s = time.monotonic() - t0

    def refresh_if_older(self, max_age: float) -> None:
        """Read fresh at scrape time when the last poll is older than max_age."""
        if (time.monotonic_ns() - self.last_poll_mono_ns) / 1e9 <= max_age:
            return
        with self._lock:
            if (time.monotonic_ns() - self.last_poll_mono_ns) / 1e9 > max_age:
                self._poll_locked()

    def views(self) -> list[TargetView]:
        return [t.view for t in list(self.targets.values())]

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
