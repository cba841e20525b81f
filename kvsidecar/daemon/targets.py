"""The targets of one daemon: found by the scan (scan.py), each polled (target.py), the
refused ones remembered (refusals.py), and the views exported once admitted and within
the aggregate budget (budget.over_total).

The poll loop runs on one thread (`start`) or at scrape time (`refresh_if_older`); both
take the set's lock, so discovery and polling never run twice at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

from kvsidecar.daemon.admission import Admission
from kvsidecar.daemon.budget import Budget, over_total
from kvsidecar.daemon.config import Discovery, Polling, Tuning
from kvsidecar.daemon.refusals import Refusals
from kvsidecar.daemon.scan import Scan
from kvsidecar.daemon.target import OVER_BUDGET, NameThrottle, Target, TargetView
from kvsidecar.web.poll_server import FastEpoch


class Claims(FastEpoch):
    """Which targets claim which rank, as of the last poll cycle: `version` moves only when
    that changes, so what a gateway decided from it (a rank's one candidate, or that two
    claim it) stays valid across cycles that changed nothing (every 0.25 s otherwise). A
    `FastEpoch`: the gateway listener's compiled path reads the version in C."""

    def __init__(self) -> None:
        self.version = 0
        self._key: tuple = ()

    def update(self, targets: Iterable[Target]) -> None:
        key = []
        for t in targets:
            last = t.view.last
            if last is not None:
                rt = last.snapshot.runtime
                key.append((t, t.shown, t.view.up, bool(t.shed), rt.role, rt.dp_rank))
        if tuple(key) != self._key:
            self._key = tuple(key)
            self.version += 1


class TargetSet:
    """All targets of one daemon: discovery, polling, and a consistent list of views."""

    def __init__(
        self,
        discovery: Discovery,
        *,
        polling: Polling | None = None,
        budget: Budget | None = None,
        admission: Admission | None = None,
        tuning: Tuning | None = None,
    ) -> None:
        polling = polling or Polling()
        tuning = tuning or Tuning()
        self.discovery = discovery
        self.polling = polling
        self.budget = budget or Budget()
        # How fast new names may become labels (None: no limit, as for dump and ls).
        self.admission = admission
        self.waiting = 0  # targets followed but not exported: waiting for admission
        self.targets: dict[str, Target] = {}
        self._note = NameThrottle()  # per-name log lines (found, gone, state changes)
        self.refusals = Refusals(
            discovery.shm_dir,
            discovery.max_targets,
            max_refused=tuning.max_refused,
            summary_interval=tuning.summary_interval,
        )
        self.scan = Scan(
            discovery,
            self.targets,
            self.refusals,
            polling=polling,
            budget=self.budget,
            tuning=tuning,
            note=self._note,
        )
        self.version = 0  # bumped on every poll cycle: invalidates rendered output
        # Bumped on a poll cycle that changed who claims which rank (gateway.py's
        # candidates: each target's role, rank, and whether it is shown, up or shed).
        self.claims = Claims()
        self.last_poll_mono_ns = 0
        self.last_poll_duration_s = 0.0
        self.polls_total = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def stale_after(self) -> float:
        return self.polling.stale_after

    @property
    def poll_interval(self) -> float:
        return self.polling.poll_interval

    # -- what the scan found and refused (the collector, the JSON API, dump/ls) ----------

    @property
    def discovery_error(self) -> str:
        """ "" while listing the directory works, else why not."""
        return self.scan.discovery_error

    @property
    def discovery_errors_total(self) -> dict[str, int]:
        return self.scan.discovery_errors_total

    @property
    def refusals_total(self) -> dict[str, int]:
        return self.refusals.total

    @property
    def refused(self) -> dict[str, str]:
        return self.refusals.refused

    @property
    def refused_count(self) -> int:
        return self.refusals.count

    @property
    def unremembered(self) -> int:
        return self.refusals.unremembered

    @property
    def max_refused(self) -> int:
        return self.refusals.max_refused

    def refused_files(self, limit: int) -> list[tuple[str, str, str]]:
        return self.refusals.files(limit)

    def refused_by_reason(self) -> dict[str, int]:
        return self.refusals.by_reason()

    def discover(self) -> None:
        self.scan.discover()

    def _admit(self) -> None:
        """Export the hidden targets that may mint a `segment` label now.

        A target with no good reading stays hidden `confirm_after` (a file that vanishes
        within a scan interval mints nothing); then, with an `Admission`, a name never
        exported before waits for a token, live targets first, then the one followed
        longest (admission.py). Hidden targets log nothing: each is counted once as
        `admission` in the refusal summary.
        """
        now = time.monotonic()
        confirm_after = self.discovery.confirm_after
        hidden = [
            t
            for t in self.targets.values()
            if not t.shown and (t.view.last is not None or now - t.admitted_mono >= confirm_after)
        ]
        if self.admission is not None:
            hidden.sort(key=lambda t: (not t.ever_up, t.admitted_mono))
            admitted = set(self.admission.admit(t.name for t in hidden))
        else:
            admitted = {t.name for t in hidden}
        for t in hidden:
            if t.name in admitted:
                t.shown = True
                t.log_found()
            elif not t.waited and self.admission is not None:
                t.waited = True
                why = f"{self.discovery.shm_dir}/{t.name}: {self.admission.why_waiting()}"
                self.refusals.refuse(t.name, "admission", message=why)
        self.waiting = len(hidden) - len(admitted)

    # -- polling --------------------------------------------------------------

    def poll_all(self) -> None:
        with self._lock:
            self._poll_locked()

    def _poll_locked(self) -> None:
        t0 = time.monotonic()
        if t0 - self.scan.last_scan >= self.discovery.rediscover_interval or not self.targets:
            self.scan.discover()
        for name, target in list(self.targets.items()):
            view = target.poll(log_transitions=target.shown)
            if not target.explicit and view.error_kind == "not_found" and view.last is None:
                # Vanished before it could ever be read: forget it now, not at the next scan.
                self.targets.pop(name).close()
                self.refusals.refuse(name, "vanished")
        self._admit()
        self._apply_total_budget()
        self.claims.update(self.targets.values())
        self.version += 1
        self.polls_total += 1
        self.last_poll_mono_ns = time.monotonic_ns()
        self.last_poll_duration_s = time.monotonic() - t0

    def _apply_total_budget(self) -> None:
        """Keep targets while their exposition fits ``max_exposition_bytes`` together, by
        seniority: those served longest first, then those found first; shed the others
        with a reason (budget.over_total decides). Keeping the smallest let 72 slightly
        smaller junk targets of the engine's uid shed the real engine; "always at least
        one" let one target alone take the daemon to 444 MB."""
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
        fixed = sum(t.budget_cost() for t in self.targets.values() if t.shown and t not in ranked)
        costs = {t.name: t.budget_cost() for t in costed}
        shed = over_total(costs.items(), fixed, limit)
        for t in costed:
            if t.name not in shed:
                t.shed = ""  # served again from the next poll
                if t.served_since is None and t.view.up:
                    t.served_since = now
                continue
            t.served_since = None  # shed: it queues again behind those served meanwhile
            if not t.shed:
                t.shed = (
                    f"the targets together would export ~{shed[t.name] / 2**20:.1f} MiB "
                    f"> --max-exposition-bytes {limit} (this one ~{costs[t.name] / 2**10:.0f} "
                    "KiB; those served longest are kept first)"
                )
                t.view = t.shed_view(t.view, time.monotonic_ns())
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
            self._stop.wait(max(0.0, self.polling.poll_interval - (time.monotonic() - start)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            for target in self.targets.values():
                target.close()
            self.targets.clear()
