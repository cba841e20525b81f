"""Accepting connections without stalling at the open-file limit.

asyncio's own accept loop, on EMFILE or ENFILE, stops accepting for a second and
tries again: with the limit reached by idle clients, every probe waits in the
kernel's backlog behind them, and waits again a second later. Here one descriptor is
held spare, as nginx, libuv and Go do: at the limit it is released, the waiting
connection accepted, and room made by closing a victim the server picks (or, if it
has none, the newcomer). The spare is taken back on the next loop iteration, once the
victim's socket is really closed (asyncio closes it in a callback queued before ours).
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
from collections.abc import Callable

__all__ = ["Acceptor"]

ACCEPT_BATCH = 64  # connections accepted per wake-up: the loop's other work takes turns
# At the connection cap each newcomer closes a victim, whose descriptor is released on
# the next iteration: a few at a time keeps the overshoot of the cap (in descriptors)
# that small, so connections never eat into what is kept for segments.
AT_CAP_BATCH = 4
RETRY_S = 0.05  # at the limit with nothing to close: wait this long, not asyncio's 1 s
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def _take_spare() -> int:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1  # at the limit right now: taken back later


class Acceptor:
    """Accepts on ``sock`` from ``loop``; ``serve`` gets each accepted socket (non-blocking)
    and its address; ``room()`` says how many more connections fit under the cap now
    (at or below 0, `AT_CAP_BATCH` are accepted per wake-up, each to replace a victim);
    at the open-file limit ``make_room(host)`` closes a connection to make room for a
    newcomer from ``host`` ("" when unknown) and says whether it did; ``at_limit`` is
    told each time the limit was met."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        serve: Callable[[socket.socket], None],
        make_room: Callable[[str], bool],
        room: Callable[[], int] = lambda: ACCEPT_BATCH,
        at_limit: Callable[[], None] = lambda: None,
    ) -> None:
        self.loop, self.sock = loop, sock
        self.serve, self.make_room, self.room, self.at_limit = serve, make_room, room, at_limit
        self.spare = _take_spare()
        self.closed = False
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        for _ in range(min(ACCEPT_BATCH, max(AT_CAP_BATCH, self.room()))):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in _EXHAUSTED:
                    self._limit()
                    return
                continue  # ECONNABORTED and the like: that client is gone, not us
            conn.setblocking(False)
            self.serve(conn)

    def _limit(self) -> None:
        self.at_limit()
        made_room = False
        if self.spare >= 0:
            os.close(self.spare)
            self.spare = -1
            try:
                conn, address = self.sock.accept()
            except OSError:
                conn = None
            if conn is not None:
                made_room = self.make_room(str(address[0]))
                if made_room:
                    conn.setblocking(False)
                    self.serve(conn)
                else:
                    conn.close()  # every connection is busy: the newcomer is refused
        else:
            made_room = self.make_room("")  # no spare yet: free one for the next accept
        # Pause until the closes land (queued before this), then take the spare back.
        self.loop.remove_reader(self.sock.fileno())
        if made_room:
            self.loop.call_soon(self._resume)
        else:
            self.loop.call_later(RETRY_S, self._resume)

    def _resume(self) -> None:
        if self.closed:
            return
        if self.spare < 0:
            self.spare = _take_spare()
        self.loop.add_reader(self.sock.fileno(), self._readable)

    def close(self) -> None:
        """Stop accepting (the caller closes the socket)."""
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.sock.fileno())
        if self.spare >= 0:
            os.close(self.spare)
            self.spare = -1
