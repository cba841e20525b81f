"""The KV-event publishers' share of the daemon's memory (`--kv-events.memory-bytes`).

Every other reader of the daemon is bounded by what it accepts (docs/security.md, the
byte budgets); the KV-event publishers were bounded per segment only, so the memory they
took grew with the segments an engine made: each rank's publisher holds its bounded
buffers (the replay buffer, the PUB's queue, a replay's window: `kv_events_zmq`'s
constants) and, for every slot of its segment, what was announced and the columns of a
full state while one is built. Measured with every reader kind at once
(`tests/attacks/all_readers.py`, docs/kv-events.md "Memory"): ~4.1 MiB a publisher and
52-76 bytes a slot, over the other readers' 47-50 MiB; the figures below cover both with
a margin, so the sum of what the admitted segments cost stays inside the budget, and the
budget's default inside the Kubernetes sidecar's 64Mi.

A segment whose cost does not fit what the others left is not published: its publisher
says so in one line (the flag to raise, by how much) and tries again when the segment is
replaced or another publisher gives its share back. The metrics side serves it as before.
"""

from __future__ import annotations

import threading

from kvsidecar.settings import KV_EVENTS_MEMORY_BYTES

MIB = 1024 * 1024
SEGMENT_BYTES = 6 * MIB  # one rank's bounded buffers, sockets and thread
SLOT_BYTES = 80  # what was announced and a full state's columns, per slot of the table
DEFAULT_BYTES = KV_EVENTS_MEMORY_BYTES.default  # 13 MiB: one segment of up to 91,750 slots


def cost(n_slots: int) -> int:
    """What publishing a segment of `n_slots` slots is charged, in bytes."""
    return SEGMENT_BYTES + n_slots * SLOT_BYTES


def slots_within(budget: int) -> int:
    """The most slots one segment may have under `budget` alone."""
    return max(0, (budget - SEGMENT_BYTES) // SLOT_BYTES)


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

    def reserve(self, name: str, n_slots: int) -> str | None:
        """Reserve (or resize) `name`'s share for `n_slots` slots: None when it fits,
        else the one-line refusal (and `name` then holds nothing)."""
        need = cost(n_slots)
        with self._lock:
            self._held.pop(name, None)
            others = sum(self._held.values())
            if others + need <= self.limit:
                self._held[name] = need
                return None
        short = others + need - self.limit
        return (
            f"KV-event segment {name}: {n_slots:,} slots need {need / MIB:.1f} MiB "
            f"({SEGMENT_BYTES / MIB:g} MiB + {SLOT_BYTES} bytes a slot), over the "
            f"{self.limit / MIB:.1f} MiB of --kv-events.memory-bytes ({others / MIB:.1f} MiB "
            f"held by other segments): not published; raise --kv-events.memory-bytes by "
            f"{short:,} and the container's memory limit with it (docs/kv-events.md#memory)"
        )

    def release(self, name: str) -> None:
        with self._lock:
            self._held.pop(name, None)
