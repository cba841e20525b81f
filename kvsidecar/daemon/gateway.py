"""The gateway endpoint: what an endpoint picker polls, one listener per engine rank.

A picker polls each endpoint (one per data-parallel rank: one InferencePool target port per
rank) every 50 ms. Each listener here answers for one DP rank of the pod's engine: listener
``i`` serves the segment whose ``dp_rank`` is ``i`` (optionally only of one ``role``). With
several roles (``--gateway.role prefill,decode``: both roles of a P/D pod, one daemon), role
``j`` has listeners of its own, dp_rank ``i`` on the base port + ``j * ranks + i``, each
answered by a `Gateway` of that role.

Fresh: the value served is the engine's latest published step when the request arrived,
never a cached poll cycle. A poll whose rank was fully checked less than `FULL_CHECK_EVERY`
ago (0.1 s), with no poll cycle since that changed who claims the rank
(`targets.Claims`), loads one word, the segment's published sequence:
unchanged, the answer built at that check is served again as it was (its bytes included,
see `kvsidecar.web.poll_server`); older, the poll reads that rank's segment under the
target's own lock with every check the poller makes (trust, budgets, identity, liveness,
progress); changed within the window (a writer publishing) and less than
`FULL_CHECK_EVERY` after the rank's last probed check, the same read and checks of the new
snapshot without the probes of the writer and the file (the path's stat, the size fstat,
the liveness lock probe: `Target.poll`'s ``trusted``). A writer's death or a hung engine is
so seen within 0.1 s of its last step, a segment replaced under a writer still publishing
within 0.1 s of the last probe, a new step at once. The poller's other targets and its
directory scans are never waited for (the TargetSet lock is not taken).

On the listener's compiled path a full check that answered 200 also leaves a compiled
check of the next steps (`gateway_step`, `_gatewaystep.c`): a new step whose bytes differ
from the checked ones only in counts and counters, or a quiet engine's heartbeat past the
window, is answered in C with the full check's probes every 0.1 s and its progress bound;
anything else is declined to the full check above.

A poll's cost is bounded whatever the directory holds: which segments claim a rank, and
whether two of them are up (ambiguous), is decided from the poller's own views once per
poll cycle that changed them; a poll then reads at most one segment (64 segments claiming
one rank made each poll read all 64).

A rank that is not up (stale, dead, closed, corrupt, refused, shed, not found, or claimed by
two live segments) is answered 503 with the reason on one line: a picker treats a non-200 as
a failed poll and never routes on those numbers as fresh. So is a rank that is up but has
shown no progress for longer than the gateway's own bound (``--gateway.stale-after``, 1.5 s):
the daemon's ``--stale-after`` (5 s) is an alerting verdict, while a picker stops trusting a
sample after 2 s; a hung (SIGSTOPped) engine core was served 200 with frozen numbers for 5 s.
"""

from __future__ import annotations

import errno
import logging
import mmap
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvsidecar.daemon.config import GatewayOptions
from kvsidecar.daemon.gateway_body import CONTENT_TYPE, timeless
from kvsidecar.daemon.gateway_step import STEP_HEADER, compiled_step
from kvsidecar.daemon.gateway_template import Templates
from kvsidecar.daemon.target import Target
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol import _seqlock
from kvsidecar.protocol.layout import OFF_PUBLISHED_SEQ
from kvsidecar.protocol.reader import Reading
from kvsidecar.settings import GATEWAY_LISTEN_ADDRESS, GATEWAY_STALE_AFTER
from kvsidecar.web.poll_server import FastSlot, PollServer, Route, response_start
from kvsidecar.web.sockets import bind

if TYPE_CHECKING:
    from kvsidecar.web.poll_tls import PollTLS

__all__ = [
    "ANY_ROLE",
    "METRICS_PATH",
    "OUTCOMES",
    "Gateway",
    "GatewayListenError",
    "listener_port",
    "start_gateway",
]

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"  # the picker's default path (metrics-data-source `path`)
_TEXT = "text/plain; charset=utf-8"
# Why a poll got its answer: a fixed set, the `outcome` label of
# kvsidecar_gateway_answers_total (never a value a client or a writer chooses).
OK = "ok"
ANY_ROLE = "any"  # the `role` label of listeners that serve segments of any role
OUTCOMES = (
    OK,
    "no_segment",  # no segment claims the rank (the engine's agent is not running)
    "ambiguous",  # two live segments claim it (two roles or instances in one pod)
    "not_fresh",  # up, but no progress for longer than --gateway.stale-after
    "not_up",  # its segment is dead, stale, corrupt, refused or not ready
    "not_found",  # a path other than /metrics (a client's mistake: no streak is logged)
)
FULL_CHECK_EVERY = 0.1  # seconds a full check's answer may be re-served on its sequence word

Answer = tuple[int, bytes, str, bytes]


@dataclass(frozen=True)
class _Checked:
    """A rank's last full check that answered 200: re-served while the segment's
    published sequence is still `seq`, the claims still at `version`, until `until`;
    a moved sequence is checked without the probes until `probed_until` (the end of the
    window of the last check that probed the writer and the file)."""

    version: int
    mm: mmap.mmap
    seq: int
    until: float
    answer: Answer
    probed_until: float


class Gateway:
    """Routes for `kvsidecar.web.poll_server.PollServer`: ``route(rank)`` answers one rank."""

    def __init__(
        self,
        targets: TargetSet,
        *,
        role: str | None = None,
        stale_after: float = GATEWAY_STALE_AFTER.default,
    ) -> None:
        self.targets = targets
        self.role = role
        self.label = role or ANY_ROLE  # the `role` label of its answers
        self._who = f"{role} " if role else ""  # in log lines and /-/ready
        self.stale_after = stale_after
        self._version = -1
        self._by_rank: dict[int, list[Target]] = {}
        # Answers by (dp_rank, outcome), read by the collector from another thread; each
        # rank's last outcome, so a 503 streak is logged once, at its start and its end.
        self.answers: dict[tuple[int, str], int] = {}
        self.last_outcome: dict[int, tuple[str, str]] = {}
        self.transitions = 0  # bumped at each logged change (readiness is cached on it)
        self._lock = threading.Lock()
        # Per segment: the body of its last (incarnation, seq), while no age is in it.
        self._bodies: dict[str, tuple[tuple[int, int], bytes]] = {}
        self._templates = Templates()  # each identity's text: a new step formats numbers
        self._start = response_start(200, CONTENT_TYPE)  # a 200's bytes before its length
        self._checked: dict[int, _Checked] = {}  # per rank
        # Per rank, the same check for the listener's compiled path (poll_server.FastSlot).
        self._slots: dict[int, FastSlot] = {}
        self._ambiguous: dict[int, str] = {}  # per rank, as the claims stand: who claims it
        self.full_checks = 0  # polls that read a segment (the others loaded one word)
        self.segment_reads = 0  # segments read by those (at most one each)

    def route(self, dp_rank: int) -> Route:
        def answer(path: str) -> tuple[int, bytes, str, bytes]:
            if path != METRICS_PATH:
                self._count(dp_rank, "not_found")
                return 404, f"not found: the gateway serves {METRICS_PATH}\n".encode(), _TEXT, b""
            return self.answer(dp_rank)

        answer.fast_slot = self._slot(dp_rank)  # type: ignore[attr-defined]
        return answer

    def _slot(self, dp_rank: int) -> FastSlot:
        slot = self._slots.get(dp_rank)
        if slot is None:
            slot = self._slots[dp_rank] = FastSlot()
            slot.off, slot.epoch = OFF_PUBLISHED_SEQ, self.targets.claims
        return slot

    def _keep(self, dp_rank: int, checked: _Checked | None) -> None:
        """The rank's last full check that answered 200 (None: none to re-serve), for
        both paths: `_checked` here, and the rank's slot for the compiled one."""
        slot = self._slot(dp_rank)
        slot.answer = slot.out = slot.advance = None
        if checked is None:
            self._checked.pop(dp_rank, None)
            return
        self._checked[dp_rank] = checked
        slot.mm, slot.seq, slot.until = checked.mm, checked.seq, checked.until
        slot.version = checked.version
        slot.answer = checked.answer  # last: the slot is whole before it can be served

    def routes(self, ranks: int) -> Sequence[Route]:
        return [self.route(r) for r in range(ranks)]

    def answer(self, dp_rank: int) -> tuple[int, bytes, str, bytes]:
        """(status, body, content type, extra headers) for one poll of `dp_rank`; counted
        by outcome, and a change of outcome logged once."""
        checked = self._checked.get(dp_rank)
        moved: _Checked | None = None  # a window whose writer moved its word: probed already
        if (
            checked is not None
            and checked.version == self.targets.claims.version
            and time.monotonic() < checked.until
        ):
            seq = self._published_seq(checked.mm)
            if seq == checked.seq:
                self._count(dp_rank, OK)
                return checked.answer  # the same tuple: the server re-sends its bytes
            if seq is not None and time.monotonic() < checked.probed_until:
                moved = checked
        self._keep(dp_rank, None)
        outcome, answer = self._answer(dp_rank, moved)
        self._count(dp_rank, outcome)
        last = self.last_outcome.get(dp_rank)
        if last is None or last[0] != outcome:
            self._transition(dp_rank, last, outcome, answer[1])
        return answer

    def counts(self) -> dict[tuple[int, str], int]:
        """Answers by (dp_rank, outcome): those counted here, and the 200s the listener's
        compiled path served from each rank's slot (counted there, in C)."""
        with self._lock:
            counts = dict(self.answers)
        for rank, slot in list(self._slots.items()):
            if slot.served:
                counts[(rank, OK)] = counts.get((rank, OK), 0) + slot.served
        return counts

    def not_ok(self) -> dict[str, str]:
        """The ranks whose last poll was not answered 200 (as `/-/ready` names them: with
        the role when the listener serves one), and why (their outcome)."""
        return {
            f"{self._who}dp_rank {r}": o
            for r, (o, _) in sorted(self.last_outcome.items())
            if o != OK
        }

    def _count(self, dp_rank: int, outcome: str) -> None:
        key = (dp_rank, outcome)
        with self._lock:
            self.answers[key] = self.answers.get(key, 0) + 1

    def _transition(
        self, dp_rank: int, last: tuple[str, str] | None, outcome: str, body: bytes
    ) -> None:
        why = body.decode(errors="replace").strip()[:300] if outcome != OK else ""
        self.last_outcome[dp_rank] = (outcome, why)
        self.transitions += 1
        if outcome != OK:
            log.warning(
                "gateway %sdp_rank %d: answering 503 (%s): %s", self._who, dp_rank, outcome, why
            )
        elif last is not None:
            log.info(
                "gateway %sdp_rank %d: answering 200 again (was %s)", self._who, dp_rank, last[0]
            )

    @staticmethod
    def _published_seq(mm: mmap.mmap) -> int | None:
        try:
            return _seqlock.kv_load_u64(mm, OFF_PUBLISHED_SEQ)
        except (ValueError, OSError):  # unmapped (re-attached) or its pages gone: re-check
            return None

    def _answer(self, dp_rank: int, moved: _Checked | None = None) -> tuple[str, Answer]:
        """The full check. With `moved` (the rank's check of this window, whose segment's
        word has moved since: a writer publishing), the probes of the writer and the file
        are skipped while the target still holds that map (`Target.poll`'s `trusted`),
        and the probed check's window is kept (`probed_until`, never extended): the
        probes run again at least every `FULL_CHECK_EVERY`, however often the word moves.
        The re-serve window (`until`) starts at each check, probed or not, as a step
        is seen: a writer gone after its last step is seen when it ends, as before."""
        self.full_checks += 1
        version = self.targets.claims.version
        candidates = self._candidates(dp_rank)
        if not candidates:
            who = f"dp_rank {dp_rank}" + (f" with role {self.role}" if self.role else "")
            why = f"no segment for {who}: is the engine's agent running?\n"
            return "no_segment", (503, why.encode(), _TEXT, b"")
        names = self._ambiguous.get(dp_rank)
        if names is not None:
            why = (
                f"segments {names} all claim dp_rank {dp_rank}: pass --gateway.role, or run "
                "one engine instance per pod\n"
            )
            return "ambiguous", (503, why.encode(), _TEXT, b"")
        # The read that makes the answer fresh: the one candidate (up at the last poll
        # cycle's look, if any was) polled now.
        target = candidates[0]
        self.segment_reads += 1
        mm = target.reader.mm
        view = target.poll(log_transitions=True, trusted=moved.mm if moved else None)
        if view.up and view.last is not None:
            last = view.last
            # Progress on the daemon's clock, as the poll that just ran judged it.
            still = view.age_seconds(view.last_poll_mono_ns) or 0.0
            if still > self.stale_after:
                why = (
                    f"{view.name}: not fresh: no progress for {still:.2f}s > "
                    f"--gateway.stale-after {self.stale_after:g}s (hung or stopped?)\n"
                )
                return "not_fresh", (503, why.encode(), _TEXT, b"")
            # Which step was served, for whoever checks freshness (the body stays lean).
            step = b"%s%d\r\n" % (STEP_HEADER, last.snapshot.runtime.step)
            body, timeless_body = self._body(view.name, last, view.clock_offset_ns)
            answer = (200, body, CONTENT_TYPE, step)
            mm = target.reader.mm if target.reader.mm is mm else None
            if timeless_body and mm is not None:
                # Never past the moment the check's own progress bound would answer 503.
                now = time.monotonic()
                until = now + min(FULL_CHECK_EVERY, self.stale_after - still)
                probed = now + FULL_CHECK_EVERY
                if moved is not None and moved.mm is mm:
                    probed = min(probed, moved.probed_until)  # never extended
                self._keep(dp_rank, _Checked(version, mm, last.seq, until, answer, probed))
                # The next steps answered in C while only counts move (gateway_step).
                self._slot(dp_rank).advance = compiled_step(
                    target,
                    last,
                    self._templates,
                    self._start,
                    every=FULL_CHECK_EVERY,
                    stale_after=self.stale_after,
                    probed_until=probed,
                    progress=now - still,
                )
            return OK, answer
        why = f"{view.name}: {view.state}: {view.error or 'not up'}\n"
        return "not_up", (503, why.encode(), _TEXT, b"")

    def _body(self, name: str, last: Reading, clock_offset_ns: int) -> tuple[bytes, bool]:
        """The body, and whether it depends on the snapshot alone (no age in it)."""
        key = (last.incarnation, last.seq)
        cached = self._bodies.get(name)
        if cached is not None and cached[0] == key:
            return cached[1], True
        # Ages on the writer's clock: ours less the offset of a writer in another time
        # namespace (as the collector does; without it the age was the offset, 1000s of s).
        body = self._templates.render(last.snapshot, time.monotonic_ns() - clock_offset_ns)
        if timeless(last.snapshot):
            if len(self._bodies) > 1024:  # names come and go: never grow without bound
                self._bodies.clear()
            self._bodies[name] = (key, body)
            return body, True
        self._bodies.pop(name, None)
        return body, False

    def _candidates(self, dp_rank: int) -> list[Target]:
        """The targets whose latest identity says this rank, those up first, and whether
        two are up (ambiguous); decided once per change of the claims, from the poller's
        own views (identity can change only with a new snapshot, which a poll brings)."""
        version = self.targets.claims.version
        if version != self._version:
            by_rank: dict[int, list[Target]] = {}
            for t in list(self.targets.targets.values()):
                last = t.view.last
                if not t.shown or last is None:
                    continue
                rt = last.snapshot.runtime
                if self.role is not None and rt.role != self.role:
                    continue
                by_rank.setdefault(rt.dp_rank, []).append(t)
            ambiguous: dict[int, str] = {}
            for rank, targets in by_rank.items():
                targets.sort(key=lambda t: not t.view.up)  # stable: found first, first
                up = [t.name for t in targets if t.view.up]
                if len(up) > 1:
                    ambiguous[rank] = ", ".join(up)
            self._by_rank, self._ambiguous, self._version = by_rank, ambiguous, version
        return self._by_rank.get(dp_rank, [])


class GatewayListenError(Exception):
    """A gateway listener could not be bound; the message names the address and the fix."""


def listener_port(port: int, ranks: int, role_index: int, dp_rank: int) -> int:
    """Role `role_index`'s listener for `dp_rank`: the base port + role_index * ranks +
    dp_rank (0: any free port)."""
    return port + role_index * ranks + dp_rank if port else 0


def start_gateway(
    targets: TargetSet, options: GatewayOptions, tls: PollTLS | None = None
) -> PollServer:
    """Bind one listener per DP rank (port, port + 1, ...) and serve them on a thread of
    their own, over TLS when `tls` is given (`--gateway.web-config-file`). Port 0 binds the
    first on any free port and the others on free ports too."""
    (host, port), ranks = options.address, options.ranks
    roles: tuple[str | None, ...] = options.roles or (None,)
    socks: list[socket.socket] = []
    try:
        for i, role in enumerate(roles):
            for rank in range(ranks):
                at = listener_port(port, ranks, i, rank)
                try:
                    socks.append(bind(host, at))
                except OSError as e:
                    why = e.strerror or str(e)
                    if e.errno == errno.EADDRINUSE:
                        why = "port in use by another process"
                    shown = f"[{host}]" if ":" in host else host
                    whose = f"{role} " if role else ""
                    raise GatewayListenError(
                        f"cannot listen on {shown}:{at} for the gateway's {whose}dp_rank "
                        f"{rank}: {why}: pass --gateway.listen-address "
                        f"({GATEWAY_LISTEN_ADDRESS.name}) with a base port whose next "
                        f"{len(roles) * ranks} ports are free"
                    ) from None
    except GatewayListenError:
        for s in socks:
            s.close()
        raise
    gateways = [Gateway(targets, role=role, stale_after=options.stale_after) for role in roles]
    server = PollServer(
        list(zip(socks, [route for g in gateways for route in g.routes(ranks)])),
        max_connections=options.max_connections,
        name="kvsidecar-gateway",
        tls=tls,
    )
    # Their answers, for the collector and /-/ready; and which listener serves what.
    server.gateways = gateways  # type: ignore[attr-defined]
    server.served = [  # type: ignore[attr-defined]
        f"{g._who}dp_rank {r}" for g in gateways for r in range(ranks)
    ]
    server.start()
    return server
