"""Wrong credentials per client address, remembered as a score that decays.

The auth queue (`basic_auth.AuthGate`) serves an address that sent wrong passwords lately
only when nobody else waits. Remembered as a flag, one wrong password (a Prometheus during
a credential rotation) put an address behind a whole flood for as long as it was
remembered: a login 2 s after it waited 4.2-8 s behind 64 flooding addresses (issue 43
item 4). As a score, each wrong password adds 1 and the sum halves every `HALF_LIFE_S`:
an address is suspect when its score is `SUSPECT_SCORE` or more (two wrong passwords
within about half a minute), or while its last one is under `RECENT_S` old (a client
retrying at once; a scraper retries at its next scrape, 10 s or more later). A flooding
address sends its second within a second or two, even on a loaded host, and its score
only grows; an address with a single wrong password some seconds ago is
served like one never checked. Holding the light class costs an attacker an address per
wrong password every ~95 s (its score must fall back below `SUSPECT_SCORE`), no more
than a fresh address buys already.

`Scores` counts the same way what else an address does often: the front counts each
address's bcrypt-bound requests, and at its cap closes a waiting login of the address
that sent the most of them lately (a flood retrying at once), not the oldest waiting.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["HALF_LIFE_S", "RECENT_S", "SUSPECT_SCORE", "Failures", "Scores"]

HALF_LIFE_S = 60.0
SUSPECT_SCORE = 1.5
RECENT_S = 3.0


class Scores:
    """Decaying per-address counts of at most ``memory`` addresses (the least recently
    counted forgotten first): each `add` counts 1, halved every `HALF_LIFE_S`."""

    def __init__(self, memory: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.memory = memory
        self._clock = clock
        self._scores: OrderedDict[str, tuple[float, float]] = OrderedDict()  # score, when

    def __contains__(self, host: str) -> bool:
        return host in self._scores

    def __len__(self) -> int:
        return len(self._scores)

    def score(self, host: str) -> float:
        """``host``'s count now, each halved per `HALF_LIFE_S` since it was added."""
        score, when = self._scores.get(host, (0.0, 0.0))
        return score * 0.5 ** ((self._clock() - when) / HALF_LIFE_S) if score else 0.0

    def add(self, host: str) -> None:
        score = self.score(host) + 1.0
        self._scores.pop(host, None)
        self._scores[host] = (score, self._clock())
        if len(self._scores) > self.memory:
            self._scores.popitem(last=False)


class Failures(Scores):
    """Wrong credentials per address (`add` one for each)."""

    def suspect(self, host: str) -> bool:
        """Its checks wait until nobody else's do: several wrong passwords lately, or one
        just now."""
        if host not in self._scores:
            return False
        recent = self._clock() - self._scores[host][1] < RECENT_S
        return recent or self.score(host) >= SUSPECT_SCORE
