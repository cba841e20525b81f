"""Fair turns at a scarce resource (bcrypt, TLS handshakes, render slots), for one
event loop.

`FairGate` grants at most ``slots`` turns at once. Waiters queue per key (the client's
address) and a freed slot goes to the next key in the round, so one address holding
thousands of waiting connections delays another address by at most one turn per
active key, not one per connection. Waiters can be marked ``suspect`` (they already
misbehaved): they are served only when no one else waits. ``max_pending`` bounds the
waiters in all, ``per_key`` those of one key: beyond either, ``turn`` refuses at once,
so refusing is cheap exactly when a flood makes it necessary.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

__all__ = ["CLEAN", "NEWEST_FIRST", "RANKS", "FairGate", "Refused"]

_Round = collections.OrderedDict[str, collections.deque]
RANKS = 4
NEWEST_FIRST = 1
CLEAN = 2  # the default rank


class Refused(Exception):
    """Too many waiters (in all, or for this key): answer at once instead of queueing."""


class FairGate:
    def __init__(self, slots: int, max_pending: int, per_key: int = 0) -> None:
        self.slots = slots
        self.max_pending = max_pending
        self.per_key = per_key  # 0: no per-key bound
        self.busy = 0
        self.pending = 0
        self._per_key: collections.Counter[str] = collections.Counter()  # waiting + busy
        # Per rank: key -> FIFO of turns; the dict order is the round.
        self._rounds: tuple[_Round, ...] = tuple(collections.OrderedDict() for _ in range(RANKS))

    def held(self, key: str) -> int:
        """Turns waiting or held by ``key``."""
        return self._per_key[key]

    @contextlib.asynccontextmanager
    async def turn(
        self, key: str, suspect: bool = False, wait_s: float | None = None, rank: int = CLEAN
    ) -> AsyncIterator[None]:
        """Hold one slot for the body; raises `Refused` when full (without waiting) or
        when no slot came within ``wait_s``."""
        crowded = self.per_key and self._per_key[key] >= self.per_key
        if self.pending >= self.max_pending or crowded:
            raise Refused(key)
        self._per_key[key] += 1
        try:
            try:
                async with asyncio.timeout(wait_s):
                    await self._acquire(key, RANKS - 1 if suspect else rank)
            except TimeoutError:
                raise Refused(key) from None
            try:
                yield
            finally:
                self._release()
        finally:
            self._per_key[key] -= 1
            if not self._per_key[key]:
                del self._per_key[key]

    async def _acquire(self, key: str, rank: int) -> None:
        if self.busy < self.slots and not self.pending:
            self.busy += 1  # free and nobody waits: no future, no round
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        table = self._rounds[rank]
        table.setdefault(key, collections.deque()).append(turn)
        if rank == NEWEST_FIRST:
            table.move_to_end(key, last=False)
        self.pending += 1
        self._dispatch()
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled():
                self._release()  # granted just as we were cancelled
            else:
                self.pending -= 1
                queue = table.get(key)
                if queue is not None and turn in queue:
                    queue.remove(turn)
                    if not queue:
                        del table[key]
            raise

    def _release(self) -> None:
        self.busy -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        while self.busy < self.slots and (table := next(filter(None, self._rounds), None)):
            key, queue = next(iter(table.items()))
            turn = queue.popleft()
            del table[key]
            if queue:
                table[key] = queue  # to the back of the round
            if turn.done():
                # Cancelled, its task not yet resumed: that task does its own accounting.
                continue
            self.pending -= 1
            self.busy += 1
            turn.set_result(None)
