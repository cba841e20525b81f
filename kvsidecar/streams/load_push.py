"""The load push: SGLang's ``LoadStat`` stream, per engine rank, for every engine kvsidecar
reads (docs/load-push.md).

A router that subscribes to an SGLang scheduler's load socket (``--load-publish-endpoint``;
llm-d-router's ``zmq-state-extractor``, engine ``sglang``) reads the same bytes from the
daemon, for vLLM, ATOM, kvcached or our demo as well. One PUB per DP rank on the endpoint's
port + dp_rank (SGLang's and vLLM's rule), bound at the rank's first sight, from one thread:

* every ``poll_interval`` each rank's segment is read fresh (`Target.poll`: the gateway's
  read, with every check the poller makes), and a LoadStat whose values differ from the
  last one sent goes out at once: one message per engine step whose values changed (steps
  closer together than the interval are seen as one);
* an unchanged one is re-sent once ``heartbeat`` seconds have passed (SGLang:
  ``LOAD_PUBLISH_HEARTBEAT_S``, 1 s), so a subscriber that just connected learns the state;
* a rank that is not up (dead, stale, closed, refused), shows no progress for longer than
  ``stale_after`` (the gateway's bound, 1.5 s), or is claimed by two live segments is sent
  nothing, as a dead engine's own publisher sends nothing: the subscriber's staleness takes
  over. A transition to or from silence is logged once.

The engine never waits for any of it: the agent writes shared memory, the daemon reads it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from kvsidecar.daemon.config import LoadPushOptions
from kvsidecar.daemon.target import Target, TargetView
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol import _seqlock, layout
from kvsidecar.streams.kv_events_wire import offset_endpoint_port
from kvsidecar.streams.kv_events_zmq import open_pub
from kvsidecar.streams.load_stat_wire import LOAD_TOPIC, LoadStat, encode, load_stat
from kvsidecar.streams.zmq_admission import ConnectionBudget

log = logging.getLogger("kvsidecar.load_push")

# A rank whose segment published nothing new since its last read is read whole (liveness,
# progress, a restarted writer) this often; in between, one 8-byte load of its published
# sequence says nothing changed (the loop's cost when idle: docs/benchmarks.md).
FULL_READ_S = 0.1


def _published(target: Target) -> int | None:
    """The segment's published sequence (one 8-byte copy), or None while it is not mapped."""
    with target.lock:
        mm = target.reader.mm
        if mm is None or target.forgotten:
            return None
        raw = _seqlock.copy_range(mm, layout.OFF_PUBLISHED_SEQ, 8)
    return None if raw is None else int.from_bytes(raw, "little")


class RankLoad:
    """One DP rank's PUB: what it last sent, and when."""

    def __init__(self, dp_rank: int, pub: zmq.Socket, heartbeat: float) -> None:
        self.dp_rank = dp_rank
        self.pub = pub
        self.heartbeat = heartbeat
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = -1  # the last sent (SGLang's count() starts at 0)
        self.last: LoadStat | None = None
        self.last_sent = 0.0
        self.silent_why: str | None = "not seen yet"
        self.read_seq = -1  # the published sequence of the last whole read, and when
        self.read_at = 0.0
        self.changed = self.resent = 0  # messages sent, by reason

    def offer(self, stat: LoadStat, now: float) -> bool:
        """Send `stat` if it differs from the last sent, or the last is `heartbeat` old."""
        if self.silent_why is not None:
            log.info("load push dp_rank %d: publishing (was: %s)", self.dp_rank, self.silent_why)
            self.silent_why = None
        changed = stat != self.last
        if not changed and now - self.last_sent < self.heartbeat:
            return False
        self.seq += 1
        try:
            self.pub.send_multipart(
                (LOAD_TOPIC, self.seq.to_bytes(8, "big"), encode(stat)), flags=zmq.NOBLOCK
            )
        except zmq.Again:  # PUB sheds at its high-water mark itself; never wait
            pass
        self.last, self.last_sent = stat, now
        if changed:
            self.changed += 1
        else:
            self.resent += 1
        return True

    def silence(self, why: str) -> None:
        if self.silent_why is None:
            log.info("load push dp_rank %d: sending nothing: %s", self.dp_rank, why)
        self.silent_why = why
        self.last = None  # the next one goes out at once, whatever it says


class LoadPushService:
    """Reads each rank of `targets` every ``options.poll_interval`` and publishes its
    LoadStat (the module doc); `step` is one round, `start` runs them on a thread."""

    def __init__(
        self,
        targets: TargetSet,
        options: LoadPushOptions,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.targets = targets
        self.options = options
        self._clock = clock
        self._ctx = zmq.Context()
        self.admission = ConnectionBudget(
            self._ctx, options.max_connections, "--load-push.max-connections", "load push"
        )
        self.ranks: dict[int, RankLoad] = {}
        self.refused: dict[int, str] = {}  # ranks whose port could not be bound, and why
        self._version = -1
        self._by_rank: dict[int, list[Target]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    def counts(self) -> dict[tuple[int, str], int]:
        """Messages sent by (dp_rank, reason): changed or resent (the collector's thread)."""
        out = {}
        for rank in list(self.ranks.values()):
            out[(rank.dp_rank, "changed")] = rank.changed
            out[(rank.dp_rank, "resent")] = rank.resent
        return out

    def start(self) -> None:
        self.admission.start()
        self._thread = threading.Thread(target=self._run, name="load-push", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for rank in self.ranks.values():
            rank.pub.close(linger=0)
        self.admission.stop()
        self._ctx.term()

    def _run(self) -> None:
        try:
            # time.sleep, not Event.wait: less CPU per wake-up (42 against 67 us measured on
            # the loaded 2-vCPU host), and 200 wake-ups a second are the idle loop's cost.
            while not self._stop.is_set():
                time.sleep(self.options.poll_interval)
                self.step()
        except Exception as e:  # a bug: say so, never take the daemon down
            self.error = f"{type(e).__name__}: {e}"
            log.exception("load push stopped")

    def step(self) -> None:
        now = self._clock()
        for dp_rank, candidates in self._candidates().items():
            rank = self._rank(dp_rank)
            if rank is None:
                continue
            if (
                len(candidates) == 1
                and rank.last is not None
                and now - rank.read_at < FULL_READ_S
                and _published(candidates[0]) == rank.read_seq
            ):
                rank.offer(rank.last, now)  # nothing new: only a due re-send goes out
                continue
            views = [t.poll(log_transitions=True) for t in candidates]
            up = [v for v in views if v.up and v.last is not None]
            if len(up) > 1:
                names = ", ".join(v.name for v in up)
                rank.silence(f"segments {names} all claim it: pass --load-push.role")
            elif not up:
                rank.silence(_not_up(views[0]))
            else:
                view = up[0]
                still = view.age_seconds(view.last_poll_mono_ns) or 0.0
                if still > self.options.stale_after:
                    rank.silence(f"{view.name}: no progress for {still:.1f}s (hung or stopped?)")
                else:
                    assert view.last is not None
                    rank.read_seq, rank.read_at = view.last.seq, now
                    rank.offer(load_stat(view.last.snapshot), now)

    def _rank(self, dp_rank: int) -> RankLoad | None:
        rank = self.ranks.get(dp_rank)
        if rank is not None or dp_rank in self.refused:
            return rank
        endpoint = offset_endpoint_port(self.options.endpoint, dp_rank)
        try:
            pub = open_pub(self._ctx, endpoint, self.options.hwm, self.admission)
        except (zmq.ZMQError, ValueError) as e:
            self.refused[dp_rank] = f"cannot bind {endpoint}: {e}"
            log.warning("load push dp_rank %d: %s; not published", dp_rank, self.refused[dp_rank])
            return None
        rank = self.ranks[dp_rank] = RankLoad(dp_rank, pub, self.options.heartbeat)
        log.info("load push for dp_rank %d: PUB %s (SGLang's LoadStat)", dp_rank, rank.endpoint)
        return rank

    def _candidates(self) -> dict[int, list[Target]]:
        """Shown targets by the DP rank their latest snapshot says (of --load-push.role);
        rebuilt when a poll cycle changed the set."""
        version = self.targets.version
        if version != self._version:
            role = self.options.role
            by_rank: dict[int, list[Target]] = {}
            for t in list(self.targets.targets.values()):
                last = t.view.last
                if not t.shown or last is None:
                    continue
                rt = last.snapshot.runtime
                if role is not None and rt.role != role:
                    continue
                by_rank.setdefault(rt.dp_rank, []).append(t)
            self._by_rank, self._version = by_rank, version
        return self._by_rank


def _not_up(view: TargetView) -> str:
    return f"{view.name}: {view.state}: {view.error or 'not up'}"
