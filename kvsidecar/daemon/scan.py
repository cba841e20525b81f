"""The shm directory's scanning: which files become targets, which are refused, and why.

The directory is shared with other local users, so a scan is built to cost little
whatever they put there: an inotify watch (dirwatch.py) says which names changed, so a
scan looks at those only and lists the directory only when the kernel cannot say (or
once a minute), a refused file costs at most an ``lstat`` per rescan (refusals.py
remembers it), a look is paced by what it cost (at most 1/LISTING_PACE of a core however
often the directory changes), the number of followed targets is capped, a
file that vanished before it could be read mints nothing, and a failing ``listdir`` keeps
every known target (see docs/security.md). Prometheus keeps finding (`discovery/`) apart
from scraping (`scrape/`) the same way; targets.py polls what this finds.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time

from kvsidecar.daemon.budget import Budget
from kvsidecar.daemon.config import Discovery, Polling, Tuning
from kvsidecar.daemon.dirwatch import DirWatch
from kvsidecar.daemon.refusals import (
    GEN_MASK,
    Refusals,
    bump,
    entry_ino,
    entry_key,
    entry_reason,
    entry_uid,
    file_key,
    pack,
    with_gen,
)
from kvsidecar.daemon.target import DEAD, OVER_BUDGET, REFUSED, NameThrottle, Target
from kvsidecar.discovery import iter_segments, segment_name
from kvsidecar.protocol.names import DEFAULT_SHM_DIR

_MTIME_SETTLE_NS = 2_000_000_000  # tmpfs mtimes are coarse: trust one only once it is this old
# A listing (and what it leads to) that cost d CPU-seconds is not repeated before
# LISTING_PACE * d: however often another user changes the directory, discovery takes at
# most 1/LISTING_PACE of a core, and a new engine is found within about that long.
LISTING_PACE = 20
LISTING_FREE_S = 0.005  # a listing cheaper than this is not paced (a small directory)
# While refused files are not remembered, an unchanged directory is listed again this
# often, so one of them edited or chowned in place is still noticed; with an inotify
# watch (dirwatch.py), the directory is listed again this often whatever it holds (what
# inotify cannot say: a slot freed for a file refused at --max-targets, a dead target
# displaced for a live engine coming back).
RELIST_UNREMEMBERED_S = 60.0
# Reader refusals that are the daemon's own shortage, not the file's fault: retry, never cache.
_TRANSIENT = {
    os.strerror(e): errno.errorcode[e] for e in (errno.EMFILE, errno.ENFILE, errno.ENOMEM)
}


log = logging.getLogger(__name__)


class OpenDirectory(OSError):
    """The segment directory lets any user delete or replace what is in it."""


def _refuse_open_directory(path: str, st: os.stat_result) -> None:
    # World-writable without the sticky bit: any local user can unlink the live segment
    # (the engine is not told) or rename their own file in its place. /dev/shm is 1777.
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise OpenDirectory(
            errno.EPERM,
            f"refusing {path}: writable by every user (mode {stat.S_IMODE(st.st_mode):04o}, "
            "not sticky), so anyone could delete or replace a live segment; "
            f"chmod 0750 {path} (or remove it: the agent creates it private)",
        )


def _paced(now: float, cpu: float) -> float:
    """When a look that began at `now`, `cpu` (thread time) may be repeated: a look that
    cost d CPU-seconds not before 20 d (one under LISTING_FREE_S at once)."""
    cost = time.thread_time() - cpu
    return now + LISTING_PACE * cost if cost > LISTING_FREE_S else 0.0


def _transient_cause(error: str) -> str | None:
    for text, cause in _TRANSIENT.items():
        if error.endswith(text):
            return cause
    return None


class Scan:
    """Finds the segments of one directory: adds new targets to `targets`, forgets those
    whose file is gone, and refuses (into `refusals`) what must not be followed."""

    def __init__(
        self,
        discovery: Discovery,
        targets: dict[str, Target],
        refusals: Refusals,
        *,
        polling: Polling,
        budget: Budget,
        tuning: Tuning,
        note: NameThrottle,
    ) -> None:
        self.shm_dir = discovery.shm_dir
        self.prefix = discovery.prefix
        self.pattern = discovery.pattern
        self.explicit = list(discovery.names)
        self.allowed_uids = discovery.allowed_uids
        self.max_targets = discovery.max_targets
        self.stale_after = polling.stale_after
        self.true_first_age = polling.true_first_age
        self.budget = budget
        self.summary_interval = tuning.summary_interval
        self.recheck_per_scan = tuning.recheck_per_scan
        self.targets = targets  # the TargetSet's: added to and forgotten from here
        self.refusals = refusals
        self._note = note  # per-name log lines (found, gone, state changes)
        self.discovery_errors_total: dict[str, int] = {}  # by cause (errno name)
        self.discovery_error = ""  # "" while listing the directory works
        self.last_scan = 0.0  # monotonic time of the last discover()
        self._recheck_queue: list[str] = []
        self._next_listing = 0.0  # monotonic time before which the directory is not listed
        self._next_look = 0.0  # and before which the watch's changes are not looked at
        self._relist_at = float("inf")  # an unchanged directory is listed again then
        self._dir_key: tuple[int, int, int, int] | None = None
        self._watch: DirWatch | None = None  # what changed, from inotify (dirwatch.py)
        self._watch_listed = False  # a listing was made since the watch was set
        self._error_logged: dict[str, float] = {}
        self._waiting_logged = False  # "the default directory does not exist yet", once
        self._default_dir_said: tuple | None = None  # what _warn_default_dir last warned of

    def discover(self) -> None:
        """Add new segments, forget segments whose file is gone (explicit names are kept).

        A discovered file we refuse (symlink, FIFO, foreign owner, newer major
        version, over --max-targets) does not become a target: anyone who can
        write the shm directory could otherwise mint series. It is counted once
        per file identity, summarized in the log, and looked at again only when
        it changes (or its slot frees up, for --max-targets).
        """
        now = time.monotonic()
        self.last_scan = now
        cpu = time.thread_time()
        try:
            st = os.stat(self.shm_dir)
            _refuse_open_directory(self.shm_dir, st)
            if self.shm_dir == DEFAULT_SHM_DIR:
                self._warn_default_dir(st)
            # ctime too: a chmod (an unreadable directory) must be seen at once.
            dir_key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
            watch = self._watched(st)
            if watch is None:
                # Unchanged: nothing was added, removed or renamed since the last listing.
                # Changed too soon: the last listing's cost says wait (a flood of changes).
                if (dir_key == self._dir_key and now < self._relist_at) or (
                    now < self._next_listing
                ):
                    self._discovery_ok()
                    self._recheck_some()
                    self.refusals.flush_summary(now)
                    return
            elif self._look(watch, now, cpu):
                return
            seen, todo = self._list()
        except FileNotFoundError as e:
            if self.shm_dir != DEFAULT_SHM_DIR:
                self._discovery_failed(e, now)
                return
            # The agent creates the default directory with the first engine: until then
            # there is no segment (not an error), and nothing known can be kept either.
            if not self._waiting_logged:  # once: say where we look, or nothing shows it
                log.info(
                    "%s does not exist yet: no segments until the first engine's agent creates it",
                    self.shm_dir,
                )
                self._waiting_logged = True
            self._discovery_ok()
            self._dir_key = None
            self._watch_listed = False
            self.refusals.entries.clear()
            self._rescan(set(), [])
            self.refusals.unremembered = 0
            self.refusals.flush_summary(now)
            return
        except OSError as e:
            self._discovery_failed(e, now)
            return  # keep every known target: a listing error is not "no segments"
        self._discovery_ok()
        settled = time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > _MTIME_SETTLE_NS
        self._dir_key = dir_key if settled else None
        self._rescan(seen, todo)
        self.refusals.unremembered = self.refusals.overflow
        relist = self.refusals.unremembered or watch is not None
        self._relist_at = now + RELIST_UNREMEMBERED_S if relist else float("inf")
        self._watch_listed = watch is not None
        self._next_listing = _paced(now, cpu)
        self.refusals.flush_summary(now)

    def _look(self, watch: DirWatch, now: float, cpu: float) -> bool:
        """With a watch: judge the names it says changed; False if a listing is due (the
        kernel cannot say, or the minute's listing) and its pacing allows one now. Looks
        and listings are paced apart: a listing's cost never delays a new engine's look."""
        if now < self._next_look:  # a flood of changed names: they wait in the kernel
            self._discovery_ok()
            self.refusals.flush_summary(now)
            return True
        changes = watch.changes(self.recheck_per_scan, self._wanted)
        if changes is None:
            self._watch_listed = False  # only a listing can say what is there now
        if not self._watch_listed or (now >= self._relist_at and now >= self._next_listing):
            if now >= self._next_listing:
                return False
            self._discovery_ok()
            self.refusals.flush_summary(now)
            return True
        self._discovery_ok()
        if changes and self._judge(changes):
            self._relist_at = now  # a slot freed: --max-targets refusals may fit
        self._next_look = _paced(now, cpu)
        self.refusals.flush_summary(now)
        return True

    def _wanted(self, name: str) -> bool:
        return segment_name(name, self.prefix, self.pattern) or name in self.explicit

    def _watched(self, st: os.stat_result) -> DirWatch | None:
        """The directory's inotify watch (set now if it is new, or another directory),
        or None where there can be none."""
        dev_ino = (st.st_dev, st.st_ino)
        if self._watch is None or self._watch.dev_ino != dev_ino:
            if self._watch is not None:
                self._watch.close()
            self._watch = DirWatch(self.shm_dir, dev_ino)  # before the listing it needs
            self._watch_listed = False
        return self._watch if self._watch.active else None

    def _judge(self, names: set[str]) -> bool:
        """Judge the names the watch says changed, as a listing would: a gone file is
        forgotten (target or refusal), a new or changed one considered (an unchanged
        refusal costs its lstat). True if a target was forgotten."""
        explicit = set(self.explicit)
        forgot = False
        for name in sorted(names, key=lambda n: (n not in explicit, n)):
            try:
                ino = os.lstat(self.shm_dir + "/" + name).st_ino
            except FileNotFoundError:
                if name in self.targets and name not in explicit:
                    if self.targets[name].shown:
                        self._note(name, logging.INFO, "gone, forgetting it")
                    self.targets.pop(name).close()
                    forgot = True
                self.refusals.forget(name)
                if name in explicit and name not in self.targets:
                    self._consider(name, 0, True)
                continue
            except OSError:
                ino = 0  # _screen says what it can
            if name not in self.targets:  # a target sees its own file replaced
                self._consider(name, ino, name in explicit)
        return forgot

    def _list(self) -> tuple[set[str], list[tuple[str, int]]]:
        """One pass over the directory, keeping nothing per entry: the targets it lists,
        and the (name, inode) to consider (new or replaced files an lstat does not
        refuse, explicit names, --max-targets retries). A new file that an lstat refuses
        (foreign owner, symlink, FIFO) is refused here; each remembered refusal listed is
        marked with this listing's number."""
        targets, refused, explicit = self.targets, self.refusals.entries, set(self.explicit)
        gen = self.refusals.gen = (self.refusals.gen + 1) & GEN_MASK
        room = len(targets) < self.max_targets
        # At the cap, files refused for it are looked at again, a few per scan, while a
        # target that was never up holds a slot: a live engine may take that slot.
        retry = self.recheck_per_scan if room or self._junk() is not None else 0
        seen: set[str] = set()  # bounded: targets only
        todo = []
        self.refusals.overflow = 0
        for name, ino in iter_segments(self.shm_dir, self.prefix, self.pattern):
            if name in targets:
                seen.add(name)
                continue
            entry = refused.get(name)
            # The same refused file as before costs nothing (the inode comes from readdir).
            if entry is not None and entry_ino(entry) == ino:
                refused[name] = with_gen(entry, gen)
                if entry_reason(entry) == "max_targets" and retry:
                    retry -= 1
                    todo.append((name, ino))
                continue
            if name in explicit or self._screen(name, ino) is not None:
                todo.append((name, ino))
        return seen, todo

    def _recheck_some(self) -> None:
        """Re-lstat the next slice of refused files; look again at those that changed."""
        queue = self._recheck_queue
        if not queue:
            queue = self._recheck_queue = [
                n for n, e in self.refusals.entries.items() if entry_reason(e) != "max_targets"
            ]
        batch = queue[-self.recheck_per_scan :]
        del queue[-self.recheck_per_scan :]
        explicit = set(self.explicit)
        for name in batch:
            entry = self.refusals.entries.get(name)
            if entry is None:
                continue
            try:
                st = os.lstat(self.shm_dir + "/" + name)
            except OSError:
                continue  # gone: the directory changed, the next scan sees it
            if file_key(st) != entry_key(entry):
                self._consider(name, entry_ino(entry), name in explicit)

    def _rescan(self, seen: set[str], todo: list[tuple[str, int]]) -> None:
        """After a listing: forget what it no longer shows (targets not in `seen`,
        refusals it did not mark), then consider `todo`."""
        explicit = set(self.explicit)
        for name in sorted(self.targets.keys() - seen - explicit):
            if self.targets[name].shown:  # a hidden one was never logged as found
                self._note(name, logging.INFO, "gone, forgetting it")
            self.targets.pop(name).close()
        self.refusals.forget_unlisted()
        todo.extend((n, 0) for n in explicit - self.targets.keys() - {n for n, _ in todo})
        for name, ino in sorted(todo, key=lambda t: (t[0] not in explicit, t[0])):
            self._consider(name, ino, name in explicit)

    def _junk(self) -> Target | None:
        """What a live engine may displace at --max-targets: the target admitted longest ago
        that has never been up (dead, empty or corrupt from its first read), else the one
        dead longest (a crash loop's leftovers: 256 segments up once, then dead, kept a new
        engine out for as long as their files remained)."""
        never_up = [t for t in self.targets.values() if not t.ever_up and not t.explicit]
        if never_up:
            return min(never_up, key=lambda t: t.admitted_mono)
        dead = [t for t in self.targets.values() if t.view.state == DEAD and not t.explicit]
        return min(dead, key=lambda t: t.dead_since) if dead else None

    def _screen(self, name: str, ino: int) -> int | None:
        """What an lstat says of a discovered file: None if that settles it (refused now,
        refused before and unchanged, or vanished), else its _file_key (0: no lstat)."""
        try:
            st = os.lstat(self.shm_dir + "/" + name)
        except FileNotFoundError:
            self.refusals.refuse(name, "vanished")
            return None
        except OSError:
            return 0
        entry = self.refusals.entries.get(name)
        if entry is None and len(self.refusals.entries) >= self.refusals.max_refused:
            # No room to remember it: refused again at each listing, so keep this cheap.
            if self._classify(st) is None:
                return file_key(st)
            self.refusals.overflow += 1
            return None
        key = file_key(st)
        if entry is not None and entry_key(entry) == key and entry_reason(entry) != "max_targets":
            self.refusals.entries[name] = pack(
                ino, key, entry_reason(entry), entry_uid(entry), self.refusals.gen
            )
            return None  # unchanged since it was refused
        reason = self._classify(st)
        if reason is None:
            return key
        # A directory is not a FIFO or a device: say what it is (rare: kept).
        why = f"{self.shm_dir}/{name} is a directory: refused" if stat.S_ISDIR(st.st_mode) else None
        self.refusals.refuse(name, reason, ino, key, why, uid=st.st_uid)
        return None

    def _consider(self, name: str, ino: int, explicit: bool) -> None:
        key = 0
        if not explicit:
            screened = self._screen(name, ino)
            if screened is None:
                return
            key = screened
        full = not explicit and len(self.targets) >= self.max_targets
        if full and self._junk() is None:
            self.refusals.refuse(name, "max_targets", ino, key)
            return
        target = Target(
            name,
            self.shm_dir,
            stale_after=self.stale_after,
            true_first_age=self.true_first_age,
            allowed_uids=self.allowed_uids,
            budget=self.budget,
            explicit=explicit,
            note=self._note,
        )
        view = target.poll(log_transitions=False)
        if full:
            junk = self._junk()
            if not view.up or junk is None:  # junk never displaces junk
                target.close()
                self.refusals.refuse(name, "max_targets", ino, key)
                return
            log.warning(
                "%s: --max-targets %d reached: dropping %s (%s: %s) for it",
                name, self.max_targets, junk.name,
                "dead" if junk.ever_up else "never up", junk.view.state,
            )  # fmt: skip
            self.targets.pop(junk.name).close()
            self.refusals.refuse(junk.name, "max_targets")
        if not explicit:
            if view.error_kind == "not_found":
                target.close()
                self.refusals.refuse(name, "vanished")
                return
            if view.state == REFUSED and view.error_kind != OVER_BUDGET:
                target.close()
                cause = _transient_cause(view.error)
                if cause is not None:  # our shortage (fds, memory): retry next scan
                    self.discovery_errors_total = bump(self.discovery_errors_total, cause)
                    self._log_error(cause, f"cannot open segments: {view.error}")
                    return
                reason = "version" if view.error_kind == "version_mismatch" else "unreadable"
                self.refusals.refuse(name, reason, ino, key, view.error)
                return
        if explicit:  # the others are logged once admitted (_admit)
            target.log_found()
        self.refusals.forget(name)
        self.targets[name] = target

    def _classify(self, st: os.stat_result) -> str | None:
        """What an lstat alone tells (no open): the reader checks again on its descriptor."""
        if stat.S_ISLNK(st.st_mode):
            return "symlink"
        if not stat.S_ISREG(st.st_mode):
            return "not_regular"
        if self.allowed_uids is not None and st.st_uid not in self.allowed_uids:
            return "foreign_owner"
        return None

    def _warn_default_dir(self, st: os.stat_result) -> None:
        """Warn, once per change, of a default directory that is a symlink or owned by a
        user we do not trust: /dev/shm is writable by everyone, so whoever created it first
        chose where segments are read from, and may replace any of them (issue 31)."""
        path = self.shm_dir
        try:
            link = os.readlink(path) if os.path.islink(path) else None
        except OSError:
            link = None
        trusted = {os.geteuid(), 0} | set(self.allowed_uids or ())
        foreign = self.allowed_uids is not None and st.st_uid not in trusted
        said = (st.st_dev, st.st_ino, st.st_uid, link) if link or foreign else None
        if said == self._default_dir_said:
            return
        self._default_dir_said = said
        if link is not None:
            log.warning(
                "%s is a symlink to %s: whoever created it chose the directory segments are "
                "read from; remove it (the agent creates the directory, private) or pass "
                "--shm-dir with the real path", path, link,
            )  # fmt: skip
        if foreign:
            log.warning(
                "%s is owned by uid %d, not by this daemon's user, root or an --allow-uid: "
                "that user can delete or replace any segment in it; if the engine runs as "
                "uid %d pass --allow-uid %d, else remove the directory (the agent creates "
                "it 0750)", path, st.st_uid, st.st_uid, st.st_uid,
            )  # fmt: skip

    def _discovery_failed(self, e: OSError, now: float) -> None:
        cause = errno.errorcode.get(e.errno or 0, "other")
        self.discovery_errors_total = bump(self.discovery_errors_total, cause)
        self.discovery_error = f"cannot list {self.shm_dir}: {e.strerror or e} ({cause})"
        self._dir_key = None
        self._watch_listed = False
        self._log_error(
            cause, f"{self.discovery_error}; keeping the {len(self.targets)} known target(s)"
        )

    def _log_error(self, cause: str, message: str) -> None:
        now = time.monotonic()
        if now - self._error_logged.get(cause, float("-inf")) >= self.summary_interval:
            self._error_logged[cause] = now
            log.warning("%s (logged once per %.0f s)", message, self.summary_interval)

    def _discovery_ok(self) -> None:
        if self.discovery_error:
            log.info("listing %s works again", self.shm_dir)
            self.discovery_error = ""
