"""The refusal table: discovered files the daemon does not follow, remembered cheaply.

The shm directory is shared with other local users, so a refused file must cost little
whatever they put there: it is remembered by its identity in one int (up to MAX_REFUSED
files) and looked at again only when it changes, each refusal is counted once per file
identity, and the refusals of an interval are summarized in one log line (see
docs/security.md). Which files are refused, and when, is the scan's business (scan.py).
"""

from __future__ import annotations

import heapq
import logging
import os

log = logging.getLogger(__name__)

# Why a discovered file is not followed (label reason of kvsidecar_segment_refusals_total).
REFUSAL_REASONS = (
    "symlink",
    "not_regular",
    "foreign_owner",
    "version",  # a newer (or older) major layout or schema version: upgrade the daemon
    "unreadable",  # the reader refused it: permissions, bad name, ...
    "vanished",  # gone before it could be read
    "max_targets",
    "admission",  # a new name waited for a token (admission.py): counted once per target
)
SUMMARY_INTERVAL = 60.0  # seconds between two refusal-summary / discovery-error log lines
# While the directory is unchanged, this many refused files are re-lstat'ed per scan (a
# file edited or chowned in place is noticed within a few scans, at a bounded cost).
RECHECK_PER_SCAN = 4096
# Refused files remembered at most: beyond it a refused file is not remembered (nor
# counted: kvsidecar_segment_refusals_total is then a lower bound), it is lstat'ed again
# at each listing and still never followed. An entry is one int and its name: ~160 bytes.
MAX_REFUSED = 16_384

# A remembered refusal is one int, not an object with five fields (44 bytes, not ~170, and
# not tracked by the garbage collector): bits 0-63 the inode from readdir (a replaced file
# is noticed without a stat), 64-127 the file_key (an edited file is looked at again),
# 128-131 the reason, 132-139 the listing that last saw it (so a listing marks what it
# sees in place, building no set of 16,384 names), 140- the owner's uid + 1 (for a
# foreign_owner message that names it).
_M64 = (1 << 64) - 1
_GEN_SHIFT, GEN_MASK = 132, 255
_REASON_CODE = {r: i for i, r in enumerate(REFUSAL_REASONS)}
# Which refusals the JSON API names first: an engine the daemon will not follow before
# files an lstat refuses (another user's, symlinks, FIFOs), which a neighbour can flood.
_REFUSED_ORDER = {
    r: i
    for i, r in enumerate(
        ("version", "unreadable", "max_targets", "admission", "vanished", "not_regular",
         "symlink", "foreign_owner")
    )
}  # fmt: skip


def pack(ino: int, key: int, reason: str, uid: int, gen: int) -> int:
    return (ino & _M64) | key << 64 | _REASON_CODE[reason] << 128 | gen << 132 | (uid + 1) << 140


def entry_ino(entry: int) -> int:
    return entry & _M64


def entry_key(entry: int) -> int:
    return entry >> 64 & _M64


def entry_reason(entry: int) -> str:
    return REFUSAL_REASONS[entry >> 128 & 15]


def entry_gen(entry: int) -> int:
    return entry >> _GEN_SHIFT & GEN_MASK


def with_gen(entry: int, gen: int) -> int:
    return entry & ~(GEN_MASK << _GEN_SHIFT) | gen << _GEN_SHIFT


def entry_uid(entry: int) -> int:
    return (entry >> 140) - 1


def file_key(st: os.stat_result) -> int:
    """What changes when a file is replaced, edited or chowned in place."""
    return hash((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)) & _M64


class Refusals:
    """The files refused now, remembered (name -> one packed int), their counts by reason,
    and the summary line that reports them once per `summary_interval`."""

    def __init__(
        self,
        shm_dir: str,
        max_targets: int,
        *,
        max_refused: int = MAX_REFUSED,
        summary_interval: float = SUMMARY_INTERVAL,
    ) -> None:
        self.shm_dir = shm_dir
        self.max_targets = max_targets  # named in a max_targets refusal's message
        self.max_refused = max_refused
        self.summary_interval = summary_interval
        self.entries: dict[str, int] = {}  # name -> pack(...)
        self.messages: dict[str, str] = {}  # the few refusals whose message is not rebuilt
        self.total: dict[str, int] = {}  # by reason: each refused file counted once
        self.unremembered = 0  # refused files of the last listing with no room in entries
        self.overflow = 0  # counting them during a listing
        self.gen = 0  # the current listing's number (mod 256), marked on what it sees
        self._unremembered_logged = 0
        self._pending: dict[str, int] = {}  # refusals since the last summary line
        self._pending_example = ""
        self._last_summary = float("-inf")

    @property
    def refused(self) -> dict[str, str]:
        """Discovered files not followed now and remembered: name -> why."""
        return {
            n: self.messages.get(n) or self.message(n, entry_reason(e), entry_uid(e))
            for n, e in self.entries.items()
        }

    @property
    def count(self) -> int:
        """Files not followed now: those remembered, and those beyond MAX_REFUSED."""
        return len(self.entries) + self.unremembered

    def files(self, limit: int) -> list[tuple[str, str, str]]:
        """(name, reason, why) of at most `limit` refused files, for the JSON API: the
        reasons an operator acts on first (version, unreadable, max_targets...), then by
        name, so a flood of foreign files cannot hide an engine refused for its version."""
        # list() copies the items atomically; the poller may change the dict meanwhile.
        entries = list(self.entries.items())
        first = heapq.nsmallest(
            limit, entries, key=lambda e: (_REFUSED_ORDER.get(entry_reason(e[1]), 99), e[0])
        )
        return [
            (
                n,
                entry_reason(e),
                self.messages.get(n) or self.message(n, entry_reason(e), entry_uid(e)),
            )
            for n, e in first
        ]

    def by_reason(self) -> dict[str, int]:
        """Files refused now and remembered, by reason (a bounded label set)."""
        counts: dict[str, int] = {}
        for entry in list(self.entries.values()):
            reason = entry_reason(entry)
            counts[reason] = counts.get(reason, 0) + 1
        return counts

    def message(self, name: str, reason: str, uid: int = -1) -> str:
        path = os.path.join(self.shm_dir, name)
        owner = f"owned by uid {uid}, " if uid >= 0 else ""
        return {
            "symlink": f"{path} is a symlink: refused (segments are never followed)",
            "not_regular": f"{path} is not a regular file (FIFO/device?): refused",
            "foreign_owner": f"{path} is {owner}not an allowed writer: pass --allow-uid "
            f"{uid if uid >= 0 else 'UID'} to trust it",
            "max_targets": f"{path}: already following --max-targets {self.max_targets} segments",
        }.get(reason, f"{path}: refused ({reason})")

    def refuse(
        self,
        name: str,
        reason: str,
        ino: int | None = None,
        key: int = 0,
        message: str | None = None,
        uid: int = -1,
    ) -> None:
        """Count a refusal; with ino, remember the file so it is not looked at again.
        A file refused again for the same reason (same inode) is not counted again. With
        MAX_REFUSED files remembered, a new one is neither remembered nor counted (it is
        refused again at each listing: counting it each time would overstate)."""
        old = self.entries.get(name)
        if ino is not None:
            if old is None and len(self.entries) >= self.max_refused:
                self.overflow += 1  # the scan's shortcut (scan.Scan._screen) does the same
                return
            self.entries[name] = pack(ino, key, reason, uid, self.gen)
            if message is None:
                self.messages.pop(name, None)
            else:
                self.messages[name] = message
            if old is not None and entry_ino(old) == ino and entry_reason(old) == reason:
                return
        self.total = bump(self.total, reason)
        self._pending[reason] = self._pending.get(reason, 0) + 1
        if not self._pending_example:
            self._pending_example = f"{name}: {message or self.message(name, reason, uid)}"

    def forget(self, name: str) -> None:
        """A refused file became a target, or its file is gone."""
        self.entries.pop(name, None)
        self.messages.pop(name, None)

    def forget_unlisted(self) -> None:
        """After a listing: forget the refusals it did not mark (their files are gone)."""
        gen = self.gen
        for name in [n for n, e in self.entries.items() if entry_gen(e) != gen]:
            del self.entries[name]
        for name in [n for n in self.messages if n not in self.entries]:
            del self.messages[name]

    def flush_summary(self, now: float) -> None:
        """One log line per interval for every refusal since the last one."""
        if not self.unremembered:
            self._unremembered_logged = 0
        more = self.unremembered and self.unremembered != self._unremembered_logged
        if not (self._pending or more) or now - self._last_summary < self.summary_interval:
            return
        if self.summary_interval == float("inf"):
            return  # dump/ls list the refusals themselves: no second copy in a log line
        if self._pending:
            total = sum(self._pending.values())
            kinds = ", ".join(f"{n} {r}" for r, n in sorted(self._pending.items()))
            example = self._pending_example
            log.warning("refused %d file(s) in %s (%s); e.g. %s", total, self.shm_dir, kinds,
                        example)  # fmt: skip
        if more:
            log.warning(
                "%d more refused file(s) in %s beyond the %d remembered: refused again at each "
                "listing, not counted in kvsidecar_segment_refusals_total",
                self.unremembered, self.shm_dir, self.max_refused,
            )  # fmt: skip
        self._unremembered_logged = self.unremembered
        self._pending, self._pending_example = {}, ""
        self._last_summary = now


def bump(counts: dict[str, int], key: str, n: int = 1) -> dict[str, int]:
    """A copy with one more: readers (the collector) see the old dict or the new, whole."""
    out = dict(counts)
    out[key] = out.get(key, 0) + n
    return out
