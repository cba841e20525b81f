"""The daemon's KV-event publisher: vLLM's ZMQ wire from the KV-event segments.

One `RankPublisher` per KV-event segment (one per engine DP rank), each on a thread of
its own with its own sockets: a PUB on the endpoint + dp_rank (vLLM's rule) and, when
configured, a ROUTER for vLLM's replay protocol. It follows the segment's ring every
``poll_interval`` and publishes what changed as one `EventBatch`; the engine never
waits for any of it (the agent writes shared memory, the daemon reads it).

No gap reaches a consumer silently:

* at the first sight of a writer incarnation (daemon start, engine restart): an
  ``AllBlocksCleared`` then a ``BlockStored`` for every cached block, parents first
  (the full state, from the table);
* the engine gone (its segment closed, unlinked or its writer dead): ``AllBlocksCleared``,
  so no consumer keeps a dead engine's blocks;
* the daemon fell behind the ring (overrun): the table is diffed against what was
  announced: ``BlockRemoved`` / ``BlockStored`` for exactly the blocks that changed;
* a replay request older than the replay buffer: the full state as of the last
  published sequence (``AllBlocksCleared`` + ``BlockStored``...) stamped with that
  sequence, then the end marker, so the consumer resumes live after it.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator

import msgspec
import zmq

from kvsidecar import discovery
from kvsidecar.daemon.config import KVEventsOptions
from kvsidecar.protocol import kv_events_layout as kvl
from kvsidecar.protocol.kv_events_reader import Block, KVEventsReader, Overrun, Record
from kvsidecar.protocol.reader import ReadError
from kvsidecar.streams import kv_events_budget, kv_events_state
from kvsidecar.streams.kv_events_budget import MemoryBudget, ShareExceeded
from kvsidecar.streams.kv_events_wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    offset_endpoint_port,
    signed_hashes,
    uses_signed_hashes,
)
from kvsidecar.streams.zmq_admission import ConnectionBudget

log = logging.getLogger("kvsidecar.kv_events")

# a resync's state is split into batches of this many events
MAX_EVENTS_PER_BATCH = kv_events_state.BATCH_EVENTS
MAX_RECORDS_PER_POLL = 16384
# An idle rank still publishes an empty batch (a new sequence number) this often, so a
# subscriber that (re)connected learns the sequence, sees a gap or a restarted
# publisher, and asks for a replay without waiting for the engine's next event.
HEARTBEAT_S = 1.0
# What one rank's publisher may hold, in bytes, whatever the engine or the clients do
# (docs/kv-events.md, "Memory"): the replay buffer keeps the last --kv-events.buffer-steps
# batches while they fit REPLAY_BUFFER_BYTES (older ones go first: a replay from before
# them gets the full state); an answer to a replay request is queued to its client a few
# messages at a time (REPLAY_QUEUE_MSGS: the ROUTER's SNDHWM, messages that share the
# buffer's bytes), at most MAX_PENDING_REPLAYS clients at once (the oldest request is
# dropped for a new one), and a client that takes nothing for REPLAY_STALL_S is dropped:
# a replay client that never reads holds a few messages, not the buffer. A subscriber
# that does not read is dropped by the PUB at its SNDHWM (at most PUB_QUEUE_MSGS messages;
# libzmq keeps one copy of each, which every subscriber's queue refers to), never waited
# for: batches are at most BATCH_BYTES of events (an event over it goes alone), so the
# queues of subscribers that stopped reading during a full state hold PUB_QUEUE_BYTES of
# it, not the state.
REPLAY_BUFFER_BYTES = 1024 * 1024
PUB_QUEUE_BYTES = 2 * 1024 * 1024
PUB_QUEUE_MSGS = PUB_QUEUE_BYTES // kv_events_state.BATCH_BYTES  # 256
REPLAY_QUEUE_MSGS = 16
MAX_PENDING_REPLAYS = 64
REPLAY_STALL_S = 5.0
# A full state is encoded a batch at a time, as the answers sending it need the next one
# (the live resync: as it is published); the batches between the slowest and the fastest
# replay answer sending it are kept while they fit STATE_WINDOW_BYTES (at least one): a
# faster answer waits for the slowest, which REPLAY_STALL_S drops if it stalls.
STATE_WINDOW_BYTES = 1024 * 1024
# The kernel's send buffer of each connection of the PUB and the ROUTER (SO_SNDBUF; Linux
# doubles it for its bookkeeping): socket memory counts against the container's cgroup
# like the daemon's own. Left to autotuning, a client that does not read grows it up to
# net.ipv4.tcp_wmem's maximum (4 MiB), once per connection: 64 such clients took 173 MiB.
SOCKET_SNDBUF = 64 * 1024
WAITING = -2
# A segment refused by the memory share is looked at again this often (replaced, or a
# share given back), not at every poll: attaching maps it. One whose full state found more
# cached blocks than the share holds, after this long: its check is a scan of the table.
REFUSED_RETRY_S = 1.0
OVER_RETRY_S = 30.0


def open_pub(
    ctx: zmq.Context, endpoint: str | None, hwm: int, admission: ConnectionBudget | None = None
) -> zmq.Socket:
    """A bound PUB that never lingers and sheds at ``hwm`` (the KV-event and load streams),
    its connections counted by ``admission`` (the stream's budget) when given."""
    pub = ctx.socket(zmq.PUB)
    try:
        pub.set_hwm(hwm)
        pub.setsockopt(zmq.SNDBUF, SOCKET_SNDBUF)
        pub.setsockopt(zmq.LINGER, 0)
        if admission is not None:
            admission.guard(pub, str(endpoint))
        pub.bind(endpoint)
    except Exception:
        pub.close()
        raise
    return pub


# The engine writes one BlockStored's blocks one record at a time (a few microseconds
# apart), and no record says "the last": a read can end inside a run. Its blocks so far
# are held until the next record shows whether the run goes on, or until no record came
# for this long (the engine's call is over), so that one vLLM event stays one event.
HOLD_S = 0.05


class _State:
    """What this publisher has announced, per slot: the version (0: nothing), hash,
    group and medium. Fixed arrays sized from the segment: 19 bytes per block."""

    def __init__(self, n_slots: int) -> None:
        self.n = n_slots
        self.clear()

    def clear(self) -> None:
        self.version = array("Q", bytes(8 * self.n))
        self.hash = array("Q", bytes(8 * self.n))
        self.group = array("H", bytes(2 * self.n))
        self.medium = bytearray(self.n)

    def announce(self, b: Block) -> None:
        self.version[b.slot] = b.version
        self.hash[b.slot] = b.block_hash
        self.group[b.slot] = b.group_idx
        self.medium[b.slot] = kvl.MEDIUM_CODES.get(b.medium, 0)

    def announce_rows(self, rows: kv_events_state.Rows) -> None:
        """`announce` for every row of a table read (in bulk: no Block per row)."""
        version, hashes, group, medium = self.version, self.hash, self.group, self.medium
        for slot, v, h, key in zip(rows.slots, rows.versions, rows.hashes, rows.keys):
            version[slot] = v
            hashes[slot] = h
            group[slot] = key[4]
            medium[slot] = key[2] if key[2] in kvl.MEDIA else 0

    def removal(self, slot: int) -> BlockRemoved:
        """The BlockRemoved of an announced slot, which it forgets."""
        self.version[slot] = 0
        return BlockRemoved(
            block_hashes=[self.hash[slot]],
            medium=kvl.MEDIA.get(self.medium[slot]),
            group_idx=self.group[slot],
        )


def _continues(prev: Block, b: Block) -> bool:
    """Whether b extends prev's BlockStored (vLLM: one request's run of full blocks)."""
    return (
        b.parent_hash == prev.block_hash
        and len(b.token_ids) == len(prev.token_ids)
        and (b.group_idx, b.medium, b.lora_id, b.lora_name, b.spec)
        == (prev.group_idx, prev.medium, prev.lora_id, prev.lora_name, prev.spec)
    )


def stored_event(reader: KVEventsReader, blocks: list[Block]) -> BlockStored:
    """One BlockStored for a run of blocks (each one's parent is the previous block)."""
    first = blocks[0]
    tokens: list[int] = []
    for b in blocks:
        tokens.extend(b.token_ids)
    lora_name = reader.lora_name(first.lora_name)
    # The group's KV-cache spec, as vLLM's KVCacheManager.take_events annotates it.
    spec = (reader.lora_name(first.spec) or "").split(" ")
    window = spec[1] if len(spec) > 1 and spec[1].isdigit() else None
    return BlockStored(
        block_hashes=[b.block_hash for b in blocks],
        parent_block_hash=first.parent_hash,
        token_ids=tokens,
        block_size=len(first.token_ids),
        lora_id=first.lora_id,
        medium=first.medium,
        lora_name=lora_name,
        extra_keys=[None if lora_name is None else (lora_name,) for _ in blocks],
        group_idx=first.group_idx,
        kv_cache_spec_kind=spec[0] or None,
        kv_cache_spec_sliding_window=None if window is None else int(window),
    )


def parents_first(blocks: list[Block]) -> list[Block]:
    """Blocks ordered so that a parent that is itself cached comes before its children
    (a consumer that drops orphans keeps every chain)."""
    by_hash = {b.block_hash: b for b in blocks}
    depth: dict[int, int] = {}
    for b in blocks:
        chain = []
        h: int | None = b.block_hash
        while h is not None and h in by_hash and h not in depth:
            chain.append(h)
            h = by_hash[h].parent_hash
            if len(chain) > len(by_hash):  # a cycle (corrupt hashes): stop
                break
        base = depth.get(h, -1) if h is not None else -1
        for i, x in enumerate(reversed(chain)):
            depth[x] = base + 1 + i
    return sorted(blocks, key=lambda b: (depth.get(b.block_hash, 0), b.slot))


class RankPublisher:
    """Follows one KV-event segment; publishes vLLM's wire for its DP rank."""

    def __init__(
        self,
        name: str,
        shm_dir: str,
        options: KVEventsOptions,
        ctx: zmq.Context,
        *,
        allowed_uids: frozenset[int] | None = None,
        clock: Callable[[], float] = time.time,
        budget: MemoryBudget | None = None,
        admission: ConnectionBudget | None = None,
    ) -> None:
        self.name = name
        self.admission = admission  # the service's connection budget (none: unbounded)
        # The daemon's publishers share one (kv_events_budget.py); alone, its own.
        self.budget = budget if budget is not None else MemoryBudget(options.memory_bytes)
        self._refused: str | None = None  # the refusal in force (logged when it began)
        self._retry_at = 0.0  # time.monotonic() of the next look at a refused segment
        self._slots = 0  # of the attached segment
        self._charged = 0  # cached blocks its share is charged for
        self._over: str | None = None  # a replay's full state found the share exceeded
        self.shm_dir = shm_dir
        self.options = options
        self.allowed_uids = allowed_uids
        self._ctx = ctx
        self._clock = clock
        self._topic = options.topic.encode()
        self._enc = msgspec.msgpack.Encoder()
        self._signed = uses_signed_hashes(name)  # SGLang's hash form
        self.reader: KVEventsReader | None = None
        self.dp_rank: int | None = None
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self.seq = -1  # the last published batch (vLLM starts at 0)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=options.buffer_steps)
        self.buffer_bytes = 0  # of the payloads in _buffer
        # Replay answers still to send: client -> [messages left (the last first),
        # monotonic time of the last one the client's queue took, the index of the next
        # batch of the full state it sends (-1: none, or all sent; WAITING: the state
        # being sent has moved on, it waits for the next)].
        self._pending: dict[bytes, list] = {}
        # The full state being sent, shared by the answers that send it: one at a time
        # (a request that cannot join it waits for it to end: WAITING).
        self._stream: _StateStream | None = None
        self._state: _State | None = None
        self._incarnation = 0
        self._next = 1  # the next ring record to read
        self._held: list[Block] = []  # a BlockStored run the last read ended in (HOLD_S)
        self._held_since = 0.0
        self._engine_gone = True  # nothing announced yet: no clear owed
        self._last_sent = 0.0  # time.monotonic() of the last batch
        self.stats = {"batches": 0, "events": 0, "resyncs": 0, "overruns": 0, "replays": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    # -- life --------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"kv-events-{self.name}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.poll_once()
                if self._pub is not None and time.monotonic() - self._last_sent >= HEARTBEAT_S:
                    self._publish([], heartbeat=True)
                # Detached (no engine yet, or gone): look for one 10 times a second.
                wait = self.options.poll_interval if self.reader is not None else 0.1
                self._serve_replay(max(wait, self.options.poll_interval))
        except Exception as e:  # a bug: say so, never take the daemon down
            self.error = f"{type(e).__name__}: {e}"
            log.exception("kv events publisher for %s stopped", self.name)
        finally:
            self._close()

    def _close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None

    # -- following the segment ------------------------------------------------------

    def poll_once(self) -> None:
        """Attach (or re-attach after a restart), then publish what changed."""
        reader = self.reader
        if reader is not None and (reader.replaced() or not reader.writer_alive()):
            reader.close()
            self.reader = reader = None
            self._gone("its segment was closed or replaced, or its writer died")
        if reader is None:
            reader = self._attach()
            if reader is None:
                return
        try:
            self._follow(reader)
            if self._over is not None:
                over, self._over = self._over, None
                raise ShareExceeded(over)
        except ShareExceeded as e:
            self._refuse(reader, str(e), OVER_RETRY_S)
        except ReadError as e:  # corrupt / truncated: treat as a gone engine, re-attach
            log.warning("kv events %s: %s", self.name, e)
            reader.close()
            self.reader = None
            self._gone(str(e))

    def _attach(self) -> KVEventsReader | None:
        if self._refused is not None and time.monotonic() < self._retry_at:
            return None
        reader = KVEventsReader(self.name, shm_dir=self.shm_dir, allowed_uids=self.allowed_uids)
        error = reader.attach()
        if error is not None:
            return None
        if not reader.writer_alive():
            reader.close()
            return None
        header = reader.header
        assert header is not None
        assert reader.geometry is not None
        self._slots = header.n_slots
        self._charged = kv_events_budget.cacheable(header.n_slots, reader.geometry.ring_cap)
        refusal = self.budget.reserve(self.name, self._slots, self._charged)
        if refusal is not None:
            self._refuse(reader, refusal, REFUSED_RETRY_S)
            return None
        if self._pub is None:
            try:
                self._bind(header.dp_rank)
            except zmq.ZMQError as e:  # the port is taken (another segment of this rank?)
                reader.close()
                self.budget.release(self.name)
                self.error = f"cannot bind for dp_rank {header.dp_rank}: {e}"
                log.warning("kv events %s: %s; not published", self.name, self.error)
                self._stop.set()
                return None
        elif header.dp_rank != self.dp_rank:
            log.warning(
                "kv events %s: the new writer says dp_rank %d, this publisher serves %d",
                self.name,
                header.dp_rank,
                self.dp_rank,
            )
        self.reader = reader
        self._state = _State(header.n_slots)
        self._incarnation = header.incarnation
        try:
            self._resync_full(reader)
        except ShareExceeded as e:
            self._refuse(reader, str(e), OVER_RETRY_S)
            return None
        if self._refused is not None:
            log.info("kv events %s: within --kv-events.memory-bytes now: published", self.name)
            self._refused = self.error = None
        return reader

    def _refuse(self, reader: KVEventsReader, refusal: str, retry: float) -> None:
        """Over the share: nothing of the segment is held, not its state, not its share
        (what was published of it is cleared); said once, when the refusal begins."""
        reader.close()
        if self.reader is reader:
            self.reader = None
        self._gone("over --kv-events.memory-bytes")
        self._state = None
        self.budget.release(self.name)
        self._retry_at = time.monotonic() + retry
        if self._refused is None:
            log.warning("%s", refusal)
        self._refused = self.error = refusal

    def _guarded(
        self, pick: Callable[[int, int, kv_events_state.Rows], kv_events_state.Rows]
    ) -> Callable[[int, int, kv_events_state.Rows], kv_events_state.Rows]:
        """A `scan` pick that charges the share for the rows it keeps past what the
        segment was charged for, before they are kept (ShareExceeded when they do not fit)."""
        kept = 0

        def guarded(first: int, end: int, rows: kv_events_state.Rows) -> kv_events_state.Rows:
            nonlocal kept
            rows = pick(first, end, rows)
            kept += rows.n
            if kept > self._charged:
                refusal = self.budget.reserve(self.name, self._slots, kept)
                if refusal is not None:
                    raise ShareExceeded(refusal)
                self._charged = kept
            return rows

        return guarded

    def _bind(self, dp_rank: int) -> None:
        o = self.options
        self.dp_rank = dp_rank
        pub = open_pub(
            self._ctx,
            offset_endpoint_port(o.endpoint, dp_rank),
            min(o.hwm, PUB_QUEUE_MSGS),
            self.admission,
        )
        try:
            replay = None
            if o.replay_endpoint:
                replay_at = offset_endpoint_port(o.replay_endpoint, dp_rank)
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                # A client's queue holds a few messages: the rest of its answer waits in
                # _pending (shared bytes) until it takes them, so a slow client still gets
                # the whole replay (vLLM 0.33's fix) and one that never reads costs little.
                replay.setsockopt(zmq.SNDHWM, REPLAY_QUEUE_MSGS)
                replay.setsockopt(zmq.SNDBUF, SOCKET_SNDBUF)
                replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue says so: Again
                if self.admission is not None:
                    self.admission.guard(replay, replay_at)
                try:
                    replay.bind(replay_at)
                except zmq.ZMQError:
                    replay.close()
                    raise
        except zmq.ZMQError:
            pub.close()
            raise
        self._pub, self._replay = pub, replay
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if replay is not None:
            self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info(
            "kv events for %s (dp_rank %d): PUB %s%s, topic %r",
            self.name,
            dp_rank,
            self.endpoint,
            f", replay {self.replay_endpoint}" if self.replay_endpoint else "",
            self.options.topic,
        )

    def _publish_held(self, reader: KVEventsReader) -> None:
        """The held run, as its BlockStored (before anything that follows it)."""
        if self._held:
            run, self._held = self._held, []
            state = self._state
            assert state is not None
            for b in run:
                state.announce(b)
            self._publish([stored_event(reader, run)])

    def _gone(self, why: str) -> None:
        self._held = []  # its blocks are cleared with the rest
        self._drop_stream()  # its batches are read from the table as they are sent
        if not self._engine_gone:
            log.info("kv events %s: engine gone (%s): AllBlocksCleared", self.name, why)
            self._publish([AllBlocksCleared()])
            if self._state is not None:
                self._state.clear()
        self._engine_gone = True

    def _resync_full(self, reader: KVEventsReader) -> None:
        """A new writer incarnation: clear, then the whole table (parents first), a
        batch at a time, each encoded as it is published."""
        self._held = []  # the whole table follows
        state = self._state
        assert state is not None
        state.clear()

        def announce(_first: int, _end: int, rows: kv_events_state.Rows) -> kv_events_state.Rows:
            state.announce_rows(rows)
            return rows

        def drop(slot: int) -> None:  # re-stored since the scan: the ring says it
            state.version[slot] = 0

        head, columns = kv_events_state.scan(reader, self._guarded(announce))
        self._next = head + 1
        self._engine_gone = False
        self.stats["resyncs"] += 1
        for events in kv_events_state.batches(reader, columns, drop, self._signed):
            self._publish(events, encoded=True)

    def _resync_diff(self, reader: KVEventsReader) -> None:
        """Overrun (the same writer): remove what is no longer cached, then store what is
        new or re-stored, parents first. Bounded as the full state is: the table read a
        chunk at a time (`kv_events_state.scan`), each chunk's removals published as they
        fill a batch, the changed rows kept as columns (16 bytes a row) and their stores
        encoded a batch at a time; nothing per cached block (a Python object per block,
        the whole table at once, before)."""
        self._publish_held(reader)  # first: the diff starts from what was published
        state = self._state
        assert state is not None
        g = reader.geometry
        assert g is not None
        removed: list[object] = []

        def changed(first: int, end: int, rows: kv_events_state.Rows) -> kv_events_state.Rows:
            now = dict(zip(rows.slots, rows.versions))
            version = state.version
            for slot in range(first, end):
                v = version[slot]
                if v and now.get(slot) != v:
                    removed.append(state.removal(slot))
            if len(removed) >= kv_events_state.BATCH_EVENTS:
                self._publish(removed)
                removed.clear()
            keep = [i for i, (s, v) in enumerate(zip(rows.slots, rows.versions)) if version[s] != v]
            rows = rows.subset(keep, g.block_size)
            state.announce_rows(rows)
            return rows

        def drop(slot: int) -> None:  # re-stored since the scan: the ring says it
            state.version[slot] = 0

        head, columns = kv_events_state.scan(reader, self._guarded(changed))
        self._publish(removed)
        self._next = head + 1
        self.stats["overruns"] += 1
        for events in kv_events_state.batches(reader, columns, drop, self._signed, cleared=False):
            self._publish(events, encoded=True)

    def _follow(self, reader: KVEventsReader) -> None:
        try:
            records = reader.records(self._next, MAX_RECORDS_PER_POLL)
        except Overrun as e:
            log.info("kv events %s: %s", self.name, e)
            self._resync_diff(reader)
            return
        if not records:
            if self._held and time.monotonic() - self._held_since >= HOLD_S:
                self._publish_held(reader)
            return
        self._next = records[-1].seq + 1
        events = self.events_for(reader, records, hold=True)
        if events:
            self._publish(events)

    def events_for(
        self, reader: KVEventsReader, records: list[Record], hold: bool = False
    ) -> list[object]:
        """vLLM's events for ring records, checked against what was announced: a store
        whose slot was re-stored since (its data gone) is left out with its removal.
        ``hold``: a run of stores that the records end in is held (`HOLD_S`), and the
        held run of the previous call goes on or comes first."""
        state = self._state
        assert state is not None
        events: list[object] = []
        run: list[Block] = self._held  # the BlockStored being built (one request's run)
        self._held = []

        def flush() -> None:
            if run:  # announced once published (a full state meanwhile leaves it out)
                for b in run:
                    state.announce(b)
                events.append(stored_event(reader, run))
                run.clear()

        for r in records:
            if r.kind == kvl.KIND_STORED:
                if state.version[r.slot] == r.version:  # announced by a resync already
                    flush()
                    continue
                b = reader.block(r.slot)
                if b is None or b.version != r.version:  # re-stored since: data gone
                    flush()
                    continue
                if not (run and not r.flags & kvl.REC_FIRST and _continues(run[-1], b)):
                    flush()
                run.append(b)
            elif r.kind == kvl.KIND_REMOVED:
                flush()
                if state.version[r.slot] == r.version and r.version:
                    events.append(state.removal(r.slot))
            elif r.kind == kvl.KIND_CLEARED:
                flush()
                events.append(AllBlocksCleared())
                state.clear()
        if hold and run and records[-1].kind == kvl.KIND_STORED:
            self._held, self._held_since = list(run), time.monotonic()
            run.clear()
        flush()
        return events

    # -- the wire -----------------------------------------------------------------------

    def _publish(self, events: list, heartbeat: bool = False, encoded: bool = False) -> None:
        """Events as batches of at most MAX_EVENTS_PER_BATCH events and BATCH_BYTES bytes
        (`kv_events_state.cut`; none: nothing, unless this is the idle heartbeat, one
        empty batch); ``encoded``: each event is msgpack already."""
        pub = self._pub
        if pub is None:
            return
        if not encoded:
            if self._signed:
                signed_hashes(events)
            events = [self._enc.encode(e) for e in events]
        chunks = kv_events_state.cut(events, end=True) if events else [[]] if heartbeat else []
        for chunk in chunks:
            self.seq += 1
            payload = self._batch(chunk)
            seq = self.seq.to_bytes(8, "big")
            try:
                pub.send_multipart((self._topic, seq, payload), flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:  # PUB drops for slow subscribers itself; never wait
                pass
            self._remember(self.seq, payload)
            self._last_sent = time.monotonic()
            self.stats["batches"] += 1
            self.stats["events"] += len(chunk)

    def _remember(self, seq: int, payload: bytes) -> None:
        """Into the replay buffer: the last buffer_steps batches, within REPLAY_BUFFER_BYTES
        (the newest is kept whatever its size)."""
        buf = self._buffer
        if len(buf) == buf.maxlen:
            self.buffer_bytes -= len(buf[0][1])
        buf.append((seq, payload))
        self.buffer_bytes += len(payload)
        while self.buffer_bytes > REPLAY_BUFFER_BYTES and len(buf) > 1:
            self.buffer_bytes -= len(buf.popleft()[1])

    def _serve_replay(self, timeout: float) -> None:
        """Wait up to timeout for replay requests (or just sleep without a ROUTER), and
        send what the pending answers' clients can take."""
        replay = self._replay
        if replay is None:
            self._stop.wait(timeout)
            return
        if self._pending:
            self._send_pending()
            timeout = min(timeout, self.options.poll_interval)
        if not replay.poll(int(timeout * 1000)):
            return
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3:
                log.warning(
                    "kv events %s: invalid replay request (%d frames)", self.name, len(frames)
                )
                continue
            client, _, start_bytes = frames
            self.stats["replays"] += 1
            self._answer_replay(client, int.from_bytes(start_bytes, "big"))

    def _answer_replay(self, client: bytes, start: int) -> None:
        """Queue the answer (references to the buffer's payloads, or the full state's
        batches, encoded as they are sent), then send what the client's queue takes now."""
        oldest = self._buffer[0][0] if self._buffer else self.seq + 1
        first = -1
        if start < oldest and self.reader is not None and self.seq >= 0:
            # Older than the buffer: the full state as of the last published sequence,
            # that of the state being sent if it is that one and none of it is gone yet.
            stream = self._stream
            if stream is None:
                self._stream = _StateStream(self.seq, self._state_batches())
                first = 0
            elif stream.seq == self.seq and stream.first == 0:
                first = 0
            else:  # sent after that one (one state at a time), as of then
                first = WAITING
            answer = []
        else:
            answer = [
                (self._topic, seq.to_bytes(8, "big"), payload)
                for seq, payload in self._buffer
                if seq >= start
            ]
        answer.append((b"", END_SEQ, b""))
        answer.reverse()  # popped from the end
        self._pending.pop(client, None)  # a new request replaces the client's old one
        while len(self._pending) >= MAX_PENDING_REPLAYS:
            del self._pending[next(iter(self._pending))]  # the oldest request
        self._pending[client] = [answer, time.monotonic(), first]
        self._send_pending()

    def _drop_stream(self) -> None:
        """Forget the full state being sent, and the answers sending it."""
        self._stream = None
        self._pending = {c: p for c, p in self._pending.items() if p[2] == -1}

    def _next_message(self, pending: list) -> tuple[bytes, bytes, bytes] | None:
        """The pending answer's next message; None: it waits for a slower answer."""
        stream = self._stream
        if pending[2] == WAITING:
            return None
        if pending[2] >= 0 and stream is not None:
            payload = stream.batch(pending[2])
            if payload is None:
                return None
            if payload:
                return (self._topic, stream.seq.to_bytes(8, "big"), payload)
            pending[2] = -1  # the state is all sent: the end marker follows
        return pending[0][-1]

    def _send_pending(self) -> None:
        """Send each pending answer's next messages while its client's queue takes them;
        drop the answer of a client gone, or that took nothing for REPLAY_STALL_S.

        Progress is stamped with the clock read after each send, never one read before:
        encoding a state's first batch orders the whole table (seconds on a loaded host),
        time the client's queue had no part in."""
        replay = self._replay
        assert replay is not None
        waiting = [p for p in self._pending.values() if p[2] == WAITING]
        if waiting and self._stream is None and self.reader is not None:
            self._stream = _StateStream(self.seq, self._state_batches())
            for p in waiting:
                p[2] = 0
        for client, pending in list(self._pending.items()):
            try:
                while pending[0]:
                    message = self._next_message(pending)
                    if message is None:  # waits for the slowest answer: not stalled
                        pending[1] = time.monotonic()
                        break
                    replay.send_multipart((client, b"", *message), flags=zmq.NOBLOCK, copy=False)
                    if pending[2] >= 0:
                        pending[2] += 1
                    else:
                        pending[0].pop()
                    pending[1] = time.monotonic()
                else:
                    del self._pending[client]
                continue
            except zmq.Again:  # its queue is full: the rest waits, unless it stalled
                if time.monotonic() - pending[1] < REPLAY_STALL_S:
                    continue
            except zmq.ZMQError:  # EHOSTUNREACH: the client is gone
                pass
            del self._pending[client]
        if self._stream is not None:
            positions = [p[2] for p in self._pending.values() if p[2] >= 0]
            if positions:
                self._stream.trim(min(positions))
            else:
                self._stream = None

    def _batch(self, events: list[bytes]) -> bytes:
        """One EventBatch's payload of encoded events (their hashes in this segment's
        form: SGLang's signed), stamped now."""
        return kv_events_state.encode_batch(self._enc, self._clock(), events, self.dp_rank)

    def _state_batches(self) -> Iterator[bytes]:
        """The announced state as batches, each encoded when it is asked for:
        AllBlocksCleared + BlockStored per block whose slot still holds the announced
        version (one not there any more is being removed: its removal follows live)."""
        reader, state = self.reader, self._state
        assert reader is not None and state is not None
        pick = self._guarded(kv_events_state.announced_rows(reader, state.version))
        try:
            _head, columns = kv_events_state.scan(reader, pick)
        except ShareExceeded as e:  # the live side refuses the segment at its next poll
            self._over = str(e)
            return
        for events in kv_events_state.batches(reader, columns, signed=self._signed):
            yield self._batch(events)


class _StateStream:
    """One full state's batches (stamped with sequence ``seq``), encoded when the first
    answer asks for each; kept from the slowest answer's on (`trim`) while they fit
    STATE_WINDOW_BYTES (at least one)."""

    def __init__(self, seq: int, batches: Iterator[bytes]) -> None:
        self.seq = seq
        self._batches: Iterator[bytes] | None = batches
        self.first = 0  # the index of window[0]
        self.window: deque[bytes] = deque()
        self.bytes = 0

    def batch(self, i: int) -> bytes | None:
        """Batch i (b"": past the last); None: not before the window moves on."""
        while i >= self.first + len(self.window) and self._batches is not None:
            if self.window and self.bytes >= STATE_WINDOW_BYTES:
                return None
            payload = next(self._batches, None)
            if payload is None:
                self._batches = None
                break
            self.window.append(payload)
            self.bytes += len(payload)
        if i >= self.first + len(self.window):
            return b""
        return self.window[i - self.first]

    def trim(self, first: int) -> None:
        """Forget the batches before index ``first`` (no answer needs them)."""
        while self.first < first and self.window:
            self.bytes -= len(self.window.popleft())
            self.first += 1


class KVEventsService:
    """Finds KV-event segments (``kvevents.*``) and runs a `RankPublisher` for each."""

    def __init__(
        self,
        options: KVEventsOptions,
        shm_dir: str,
        *,
        allowed_uids: frozenset[int] | None = None,
        rediscover_interval: float = 1.0,
    ) -> None:
        self.options = options
        self.shm_dir = shm_dir
        self.allowed_uids = allowed_uids
        self.rediscover_interval = rediscover_interval
        self._ctx = zmq.Context()
        self.budget = MemoryBudget(options.memory_bytes)
        self.admission = ConnectionBudget(
            self._ctx, options.max_connections, "--kv-events.max-connections", "kv events"
        )
        self.publishers: dict[str, RankPublisher] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def scan(self) -> None:
        try:
            names = discovery.scan_segments(self.shm_dir, kvl.EVENTS_PREFIX)
        except OSError:
            return
        for name in sorted(names):
            if name not in self.publishers:
                pub = RankPublisher(
                    name,
                    self.shm_dir,
                    self.options,
                    self._ctx,
                    allowed_uids=self.allowed_uids,
                    budget=self.budget,
                    admission=self.admission,
                )
                self.publishers[name] = pub
                pub.start()

    def start(self) -> None:
        self.admission.start()
        self.scan()
        self._thread = threading.Thread(target=self._run, name="kv-events-scan", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.rediscover_interval):
            self.scan()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for pub in self.publishers.values():
            pub.stop()
        self.admission.stop()
        self._ctx.term()
