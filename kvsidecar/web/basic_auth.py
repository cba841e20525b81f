"""Basic auth against bcrypt hashes, bounded in cost under a flood of wrong passwords.

bcrypt is deliberately slow (cost 10: ~85 ms of a core here), so an unauthenticated
client can buy a core's worth of work per request. The controls:

* Outcomes are cached, keyed by (user, stored hash, sha256(password)): a repeated
  password, right or wrong, costs a hash lookup. A changed hash misses the cache.
* Identical checks in progress are shared (one bcrypt for 150 identical attempts).
* At most `BCRYPT_WORKERS` bcrypt checks run at once (CPU stays bounded: the engine
  shares the host), handed out by `AuthGate`: connections that already failed wait
  until nobody else does, and round-robin per client address within each class.
* A check waits at most `AUTH_WAIT_S` for its turn, then is refused (429): a flood of
  first attempts from the scraper's own address, which nothing can tell from the
  scraper's, makes the queue "the last few seconds of arrivals", not "all of them":
  the scraper is served within that time or told so, never queued behind the whole
  flood. Each of N such waiters is served with a chance of about
  min(1, checks per second x `AUTH_WAIT_S` / N) (docs/security.md).
* One address holds at most `PER_ADDRESS` checks of each class (waiting or running);
  beyond that a check is refused too (within `CROWDED_WAIT_S`): one address cannot
  fill the queue every other address shares. (A connection has one check at most:
  it is answered before its next request is read.)
* Unknown users are checked against a dummy hash whose cost is that of a configured
  user, chosen by a keyed hash of the name: a user is indistinguishable from a
  non-user by timing even when users have different costs.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import concurrent.futures
import hashlib
import hmac
import os
import threading
from collections.abc import Callable, Mapping

import bcrypt

from kvsidecar.web.fair import CLEAN, FairGate, Refused

__all__ = ["AUTH_WAIT_S", "BCRYPT_WORKERS", "PER_ADDRESS", "AuthGate", "BasicAuth", "hash_cost"]

BCRYPT_WORKERS = 1  # bcrypt checks at once, for the whole process
MAX_PENDING = 512  # queued checks beyond this are refused at once (429)
# Expire the oldest, not refuse the newest: a newcomer refused at a full queue loses a
# race against an attacker retrying at once, while a deadline gives every waiter the
# same chance. Below Prometheus' default 10 s scrape timeout, so the scraper reads the
# answer, either way, and a login queued behind the whole flood (FIFO: N checks) is
# served in time only while N < rate x 10 s; here a share gets in up to PER_ADDRESS.
AUTH_WAIT_S = 8.0
PER_ADDRESS = MAX_PENDING // 2  # checks of one address, per class, waiting or running
CROWDED_WAIT_S = 0.2  # beyond PER_ADDRESS: look again after this, then 429


def hash_cost(hashed: str | bytes) -> int:
    """The cost field of a ``$2b$CC$...`` hash."""
    text = hashed.decode() if isinstance(hashed, bytes) else hashed
    return int(text.split("$")[2])


class BasicAuth:
    """Verifies basic-auth credentials; `lookup` is cheap, `verify` runs bcrypt."""

    def __init__(self, users: Mapping[str, str], cache_size: int = 256) -> None:
        self.users = dict(users)
        self._cache: collections.OrderedDict[tuple[str, str, bytes], bool] = (
            collections.OrderedDict()
        )
        self._cache_size = cache_size
        self._failures_size = max(cache_size, 4096)  # failures: bounded, evicted oldest first
        self._failures: collections.OrderedDict[tuple[str, str, bytes], bool] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()
        self._inflight: dict[tuple[str, str, bytes], concurrent.futures.Future[bool]] = {}
        self._sem = threading.BoundedSemaphore(BCRYPT_WORKERS)
        self._key = os.urandom(16)  # per process: the name -> dummy cost map can't be precomputed
        # One dummy hash per configured user (same cost), salt random, digest never matching.
        self._dummies = [
            bcrypt.gensalt(hash_cost(h), prefix=b"2b") + b"." * 31
            for h in sorted(self.users.values())
        ] or [bcrypt.gensalt(10, prefix=b"2b") + b"." * 31]

    @property
    def enabled(self) -> bool:
        return bool(self.users)

    def _hash_for(self, user: str) -> bytes:
        hashed = self.users.get(user)
        if hashed is not None:
            return hashed.encode()
        digest = hmac.new(self._key, user.encode("utf-8", "surrogatepass"), "sha256").digest()
        return self._dummies[int.from_bytes(digest[:8], "big") % len(self._dummies)]

    def _cache_key(self, user: str, password: str) -> tuple[str, str, bytes]:
        # bcrypt only looks at 72 bytes; Go's bcrypt and htpasswd truncate silently too.
        pw = password.encode("utf-8", "surrogatepass")[:72]
        return (user, self.users.get(user, ""), hashlib.sha256(pw).digest())

    def lookup(self, user: str, password: str) -> bool | None:
        """The cached outcome, or None when only bcrypt can tell."""
        key = self._cache_key(user, password)
        with self._lock:
            if key in self._cache:
                return True
            if key in self._failures:
                self._failures.move_to_end(key)
                return False
        return None

    def verify(self, user: str, password: str) -> bool:
        """Run bcrypt (or join an identical check in progress) and cache the outcome."""
        key = self._cache_key(user, password)
        with self._lock:
            if key in self._cache or key in self._failures:
                return key in self._cache
            shared = self._inflight.get(key)
            if shared is None:
                mine: concurrent.futures.Future[bool] = concurrent.futures.Future()
                self._inflight[key] = mine
        if shared is not None:
            return shared.result()
        ok = False
        try:
            with self._sem:
                ok = bcrypt.checkpw(
                    password.encode("utf-8", "surrogatepass")[:72], self._hash_for(user)
                )
            ok = ok and user in self.users
        except ValueError:
            ok = False
        finally:
            with self._lock:
                table, size = (self._cache, self._cache_size) if ok else (
                    self._failures, self._failures_size)  # fmt: skip
                table[key] = True
                while len(table) > size:
                    table.popitem(last=False)
                del self._inflight[key]
            mine.set_result(ok)
        return ok

    def check(self, user: str, password: str) -> bool:
        cached = self.lookup(user, password)
        return cached if cached is not None else self.verify(user, password)

    @staticmethod
    def parse_header(authorization: str | None) -> tuple[str, str] | None:
        """(user, password) from an ``Authorization: Basic ...`` value, or None."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return None
        user, sep, password = decoded.partition(":")
        return (user, password) if sep else None

    def check_header(self, authorization: str | None) -> bool:
        """Check an ``Authorization: Basic ...`` header value."""
        creds = self.parse_header(authorization)
        return creds is not None and self.check(*creds)


class AuthGate:
    """Runs blocking checks on `BCRYPT_WORKERS` threads, fairly (`fair.FairGate`).

    Checks from connections that already sent wrong credentials ("suspect") wait until
    no other check is waiting, so a flood over keep-alive connections cannot delay a
    scraper's first login by more than the check in progress. ``rank`` orders the others
    (`fair.FairGate`): the front gives 0 to addresses that logged in lately, then
    `NEWEST_FIRST` to addresses never checked (the newest first, so a flood from many
    addresses that all began earlier delays a new login by one check, not one per
    address), then the rest; within each class every client key (address) takes its turn
    in a round. A check whose client has hung up by
    the time its turn comes is skipped: nobody would read its answer. A check that got
    no turn within ``wait_s`` is refused, and so is one beyond ``per_key`` checks of
    its key and class; before refusing the latter (after `CROWDED_WAIT_S`),
    the key's waiters whose clients have left are cancelled (their connection is over),
    so connect-send-close requests cannot hold the key's places either.
    """

    def __init__(
        self,
        workers: int = BCRYPT_WORKERS,
        max_pending: int = MAX_PENDING,
        per_key: int = PER_ADDRESS,
        crowded_wait_s: float = CROWDED_WAIT_S,
        wait_s: float | None = None,
    ) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, "kvsidecar-auth")
        self._gate = FairGate(workers, max_pending)
        self.per_key = per_key
        self.crowded_wait_s = crowded_wait_s
        self.wait_s = AUTH_WAIT_S if wait_s is None else wait_s  # read now: tests lower it
        # (key, suspect) -> its checks: the task and its gone(); None once running.
        self._held: dict[tuple[str, bool], dict[asyncio.Task, Callable[[], bool] | None]] = {}

    async def run(
        self,
        key: str,
        fn: Callable[[], bool],
        suspect: bool = False,
        gone: Callable[[], bool] = lambda: False,
        rank: int = CLEAN,
    ) -> bool | None:
        """fn's result; None when too many checks are already waiting (in all, or of
        this key and class) or no turn came within ``wait_s``; False without running fn
        when ``gone()`` says the client left while it waited."""
        slot = (key, suspect)
        held = self._held.setdefault(slot, {})
        if len(held) >= self.per_key:
            # A hang-up is seen a loop turn or more after the request: give the ones
            # just sent time to show (the client waits this long for a 401 anyway).
            await asyncio.sleep(self.crowded_wait_s)
            if gone():
                return False
            held = self._held.setdefault(slot, {})
            for task, left in list(held.items()):
                if left is not None and left():
                    del held[task]
                    task.cancel()
            if len(held) >= self.per_key:
                return None
        me = asyncio.current_task()
        assert me is not None
        held[me] = gone
        try:
            async with self._gate.turn(key, suspect, self.wait_s, rank=rank):
                if gone():
                    return False
                held[me] = None  # running: the thread cannot be stopped, it stays counted
                return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        except Refused:
            return None
        finally:
            held.pop(me, None)
            if not held and self._held.get(slot) is held:
                del self._held[slot]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
