"""What a killed engine leaves in /dev/shm, and removing it (issue 33 item 12).

vLLM's servers share memory through Python's `multiprocessing.shared_memory` (`psm_*`, up
to 250 MB each), SGLang through `sglang_loads_*.shm`; both are unlinked only by a clean
shutdown, so an engine the tests SIGKILL (or that a SIGTERM does not stop in time) leaves
them on the developer's tmpfs for good: 420 MB per `.ci/run`. No engine names its files
after its pid, so what was left is found by difference: the entries of /dev/shm that are
new since a snapshot taken before the engine started, are regular files owned by us, and
that no live process maps or holds open. A file still held stays: with a warning when the
holder is a process of this test run (a survivor of the kill), silently when it is another
run's engine on the host. Another run's engine may also be starting meanwhile: its file is
unheld for the moment between creating and mapping it, and removing it then fails that
engine's start (a worker opens it by name). So only the engines' own kinds of file are
swept (`LEFTOVER_PREFIXES`), and only when a second look, `RECHECK_S` later, still finds
no holder.
"""

from __future__ import annotations

import os
import stat
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvsidecar.bench.proccount import fd_targets

SHM = Path("/dev/shm")
# vLLM's (Python SharedMemory) and SGLang's names; nothing else there is an engine's leftover.
LEFTOVER_PREFIXES = ("psm_", "sglang_loads_")
RECHECK_S = 1.0


class ShmLeftoverWarning(UserWarning):
    """A file an engine left in /dev/shm that the tests could not remove."""


def snapshot(root: Path = SHM) -> set[str]:
    """The names in `root` now (empty where there is no such directory)."""
    try:
        return set(os.listdir(root))
    except OSError:
        return set()


def held_paths(root: Path = SHM) -> dict[str, int]:
    """Every path under `root` some live process maps or has open: path -> one such pid.

    Both are needed: SGLang opens its file before it maps it, Python's SharedMemory maps and
    then closes the descriptor. Processes we may not read (another user's) are skipped:
    their files are not ours to remove anyway unless they are root's, and then we are root
    and can read them."""
    prefix = f"{root}/"
    held: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    path = line.rstrip("\n").split(maxsplit=5)[-1]
                    if path.startswith(prefix):
                        held.setdefault(path.removesuffix(" (deleted)"), pid)
        except OSError:
            continue  # gone, or not ours to read
        for target in fd_targets(pid):
            if target.startswith(prefix):
                held.setdefault(target, pid)
    return held


def remove_leftovers(before: set[str], what: str, root: Path = SHM) -> list[str]:
    """Remove the files `what` left in `root`: new since `before`, named as an engine names
    them, regular, owned by our uid, held by no live process in either of two
    looks. Returns the names removed; warns (ShmLeftoverWarning)
    for a new file of ours that is still held or cannot be removed."""
    new = {n for n in snapshot(root) - before if n.startswith(LEFTOVER_PREFIXES)}
    if not new:
        return []
    held = held_paths(root)
    if {str(root / n) for n in new} - set(held):
        time.sleep(RECHECK_S)  # an unheld file may be one being set up: look again
        held = {**held_paths(root), **held}
    removed: list[str] = []
    for name in sorted(new):
        path = root / name
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue  # its owner (or a concurrent run) removed it meanwhile
        # Directories are the tests' own scratch dirs, removed by their fixtures; another
        # user's file is not ours even when we are allowed to remove it.
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            continue
        if str(path) in held:
            pid = held[str(path)]
            if not _of_this_run(pid):
                continue  # another test run's (or anyone's) live engine on this host
            warnings.warn(
                f"{what} left {path} ({st.st_size} bytes), still held by pid {pid} "
                f"({_command(pid)}): not removed",
                ShmLeftoverWarning,
                stacklevel=2,
            )
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as e:
            warnings.warn(
                f"{what} left {path}: cannot remove it: {e}", ShmLeftoverWarning, stacklevel=2
            )
            continue
        removed.append(name)
    return removed


# Inherited by every process this run starts (engines included; spawners that drop the
# KVSIDECAR_* variables keep it): a live holder that carries it is ours, one that does not
# belongs to another run on the host and is no reason to warn. A child pytest keeps its
# parent's token, so its engines count as the parent run's too.
RUN_TOKEN = "KVS_TEST_SHM_SWEEP"
os.environ.setdefault(RUN_TOKEN, str(os.getpid()))


def _of_this_run(pid: int) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False  # gone, or another user's
    return f"{RUN_TOKEN}={os.environ[RUN_TOKEN]}".encode() in environ


def _command(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "gone"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:120]


@contextmanager
def cleaned(what: str, root: Path = SHM) -> Iterator[set[str]]:
    """Around code that starts and kills engines: afterwards, remove what they left in
    `root`. Yields the snapshot taken before."""
    before = snapshot(root)
    try:
        yield before
    finally:
        remove_leftovers(before, what, root)


@pytest.fixture(scope="module", autouse=True)
def engine_shm_leftovers(request: pytest.FixtureRequest) -> Iterator[None]:
    """Module-wide, so it spans module-scoped servers too: autouse fixtures of a scope are
    set up before that scope's others and torn down after them, so the snapshot precedes
    the first engine and the sweep follows the last kill."""
    with cleaned(request.module.__name__):
        yield
