"""Admission of new segment names: a bound on how fast new `segment` labels appear.

Every followed segment's name is the `segment` label of all its series, and Prometheus
keeps each new label value's series for hours. Valid segments of a trusted uid that
live a few scans each (a crash-looping script, a buggy engine) minted one label each:
1,828 in 20 s. A token bucket bounds that whatever the files' lifetimes: `burst` new
names at once (a whole node's ranks starting together), then one per `interval`
seconds. A name exported before costs nothing: an engine restarted under the same name
(the agent's names are deterministic) brings back the same series, not new ones.

The caller hands over every candidate at once, in priority order (live ones first, then
the one followed longest): a real engine outlives any churn of short-lived files, so it
is next in line within about one interval, and a file that dies while waiting never
mints a label.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable

from kvsidecar import settings

# 64 ranks of one node starting at once are all served at once (8 GPUs x dp8, say).
DEFAULT_BURST: int = settings.MAX_NEW_TARGETS.default
# An 8-rank engine crash-looping every 30 s under fresh names needs one name per 3.75 s;
# under its own names (the agent's default) it needs none. An hour of hostile churn then
# adds at most 64 + 1,200 label values (it was ~330,000: 1,828 per 20 s).
DEFAULT_INTERVAL: float = settings.NEW_TARGET_INTERVAL.default
KNOWN_NAMES = 4096  # names remembered as exported; the least recently seen dropped first


class Admission:
    """A token bucket over new names, and the bounded set of names already exported."""

    def __init__(
        self,
        burst: int = DEFAULT_BURST,
        interval: float = DEFAULT_INTERVAL,
        *,
        names: int = KNOWN_NAMES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst, self.interval, self.names = burst, interval, names
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()
        self._known: collections.OrderedDict[str, None] = collections.OrderedDict()

    def known(self, name: str) -> bool:
        return name in self._known

    def admit(self, candidates: Iterable[str]) -> list[str]:
        """The candidates admitted now (names in priority order): every known one, then
        as many new ones, in order, as there are tokens. The rest wait."""
        now = self._clock()
        if self.interval > 0:
            self._tokens = min(self.burst, self._tokens + (now - self._last) / self.interval)
        else:
            self._tokens = float(self.burst)
        self._last = now
        admitted = []
        for name in candidates:
            if name not in self._known:
                if self._tokens < 1:
                    continue  # later known names still pass: they mint nothing
                self._tokens -= 1
            self.remember(name)
            admitted.append(name)
        return admitted

    def why_waiting(self) -> str:
        return (
            f"waiting: more than --max-new-targets {self.burst} new segment names, "
            f"one more admitted per {self.interval:g} s (--new-target-interval)"
        )

    def remember(self, name: str) -> None:
        """Mark a name as exported (a re-found one moves to the back of the line)."""
        self._known.pop(name, None)
        self._known[name] = None
        if len(self._known) > self.names:
            self._known.popitem(last=False)
