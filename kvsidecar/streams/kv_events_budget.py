"""The KV-event publishers' share of the daemon's memory (`--kv-events.memory-bytes`).

Every other reader of the daemon is bounded by what it accepts (docs/security.md, the
byte budgets); the KV-event publishers were bounded per segment only, so the memory they
took grew with the segments an engine made: each rank's publisher holds its bounded
buffers (the replay buffer, the PUB's queue, a replay's window: `kv_events_zmq`'s
constants), for every slot of its segment what was announced (19 bytes), and for every
cached block the columns of a full state while one is built. Measured with every reader
kind at once (`tests/attacks/all_readers.py`, docs/kv-events.md "Memory"): ~4.1-4.3 MiB a
publisher and 52-76 bytes a slot with every slot cached, over the other readers' 47-50
MiB; the charges below cover both with a margin, so the sum of what the admitted segments
are charged stays inside the share, and the share's default inside the sidecar's 64Mi.

A segment is charged at attach for the blocks its engine can cache: an agent sizes its
table at what the engine can cache plus a ring's worth of slots (freed slots are reused
last), so all but `min(ring_cap, DEFAULT_RING_CAP)` slots. A build of a full state that
finds more cached rows than charged (a writer of its own) charges them before it keeps
them, and stops when they do not fit. A segment whose charge does not fit what the
others left is not published: its publisher says so in one line (the flag to raise, by
how much) and tries again when the segment is replaced or another publisher gives its
share back. The metrics side serves the engine as before.
"""

from __future__ import annotations

import threading

from kvsidecar.protocol import kv_events_layout as kvl
from kvsidecar.settings import KV_EVENTS_MEMORY_BYTES

MIB = 1024 * 1024
SEGMENT_BYTES = 6 * MIB  # one rank's bounded buffers, sockets and thread
SLOT_BYTES = 20  # what was announced, per slot of the table (19 bytes: _State)
CACHED_BYTES = 60  # a full state's columns and their order, per cached block
DEFAULT_BYTES = KV_EVENTS_MEMORY_BYTES.default  # 13 MiB: one engine of up to 75,366 blocks


def cost(n_slots: int, cached: int | None = None) -> int:
    """What publishing a segment of `n_slots` slots, `cached` of them cached at once
    (None: all), is charged, in bytes."""
    return (
        SEGMENT_BYTES
        + n_slots * SLOT_BYTES
        + (n_slots if cached is None else cached) * CACHED_BYTES
    )


def cacheable(n_slots: int, ring_cap: int) -> int:
    """The blocks an agent's segment of `n_slots` slots can hold cached at once."""
    return max(0, n_slots - min(ring_cap, kvl.DEFAULT_RING_CAP))


def slots_within(budget: int) -> int:
    """The most slots one segment with every slot cached may have under `budget` alone."""
    return max(0, (budget - SEGMENT_BYTES) // (SLOT_BYTES + CACHED_BYTES))


class ShareExceeded(Exception):
    """A full state found more cached blocks than the share can be charged for."""


class MemoryBudget:
    """The bytes shared by a daemon's publishers: each reserves its segment's cost before
    it publishes, and gives it back when it stops holding the segment's state."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def used(self) -> int:
        with self._lock:
            return sum(self._held.values())

    def reserve(self, name: str, n_slots: int, cached: int | None = None) -> str | None:
        """Reserve (or resize) `name`'s share for `n_slots` slots, `cached` of them cached
        (None: all): None when it fits, else the one-line refusal (and `name` then holds
        nothing)."""
        need = cost(n_slots, cached)
        with self._lock:
            self._held.pop(name, None)
            others = sum(self._held.values())
            if others + need <= self.limit:
                self._held[name] = need
                return None
        short = others + need - self.limit
        n_cached = n_slots if cached is None else cached
        return (
            f"KV-event segment {name}: {n_slots:,} slots, {n_cached:,} cached, need "
            f"{need / MIB:.1f} MiB ({SEGMENT_BYTES / MIB:g} MiB + {SLOT_BYTES} bytes a slot + "
            f"{CACHED_BYTES} a cached block), over the "
            f"{self.limit / MIB:.1f} MiB of --kv-events.memory-bytes ({others / MIB:.1f} MiB "
            f"held by other segments): not published; raise --kv-events.memory-bytes by "
            f"{short:,} and the container's memory limit with it (docs/kv-events.md#memory)"
        )

    def release(self, name: str) -> None:
        with self._lock:
            self._held.pop(name, None)
