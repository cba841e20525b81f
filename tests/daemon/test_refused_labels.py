"""No label value a neighbour chooses (issue 31 item 3). On bca725e every refused file had
a ``kvsidecar_refused_file{file="<its name>"}`` series: a foreign uid minted 3,072-3,840
distinct values in 12-15 s, the engine's own uid (junk beyond --max-targets) 3,809. Now
refused files are counted by reason; their names are in the log, ``kvsidecar ls`` and the
JSON API (bounded). A real daemon, real files, two floods of fresh names.
"""

from __future__ import annotations

import json
import os

import pytest

from kvsidecar.daemon.app import REFUSED_LIST_MAX
from tests.attacks import hostile_writers as hw
from tests.support.procs import wait_for
from tests.support.scrape import fetch, samples, value

FOREIGN_UID = 54321
PER_ROUND = 150
# Our own requests and the process self-metrics vary with the scrapes, not the files.
_OURS = ("kvsidecar_http_", "process_", "python_")


def _values(text: str) -> set[tuple[str, str]]:
    """Every distinct (label, value) of the exposition, but for our own self-metrics."""
    return {
        item
        for name, labels, _ in samples(text)
        if not name.startswith(_OURS)
        for item in labels.items()
    }


def _flood(shm_dir: str, tag: str, foreign: bool) -> list[str]:
    names = []
    for i in range(PER_ROUND):
        name = f"kvsidecar.{tag}{i:04d}.dp0.tp0.pp0"
        # Written and chowned under a name outside the prefix, then renamed into place: a
        # file created in place is our own until the chown, and a scan in between followed
        # it (admitted after --rediscover-interval, its name a label: the foreign_uid flake).
        staging = os.path.join(shm_dir, f".staging-{name}")
        with open(staging, "wb") as f:
            f.write(b"junk" * (i % 7))  # empty or short: never a valid segment
        if foreign:
            os.chown(staging, FOREIGN_UID, FOREIGN_UID)
        os.rename(staging, os.path.join(shm_dir, name))
        names.append(name)
    return names


@pytest.mark.parametrize("foreign", [True, False], ids=["foreign_uid", "own_uid"])
def test_a_junk_flood_mints_no_label_value(shm_dir: str, foreign: bool) -> None:
    """A foreign uid's files are refused at an lstat; the own uid's junk fills
    --max-targets (those few are followed, as corrupt: admission bounds them) and the rest
    is refused. The second round's names sort first (bca725e named the first
    --max-targets refused files by name): it must add no label value at all."""
    if foreign and os.geteuid() != 0:
        pytest.skip("needs root to create files of another uid")
    max_targets = 8
    # Every junk target admitted in the first round (not paced into the second).
    args = ("--poll-interval", "0.05", "--rediscover-interval", "0.1", "--max-new-targets", "64")
    with hw._daemon(shm_dir, *args, "--max-targets", str(max_targets)) as (_, url):
        values = [_values(fetch(url + "/metrics")[2])]
        made: list[str] = []
        for tag in ("b", "a"):
            made += _flood(shm_dir, tag, foreign)
            refused = len(made) - (0 if foreign else max_targets)

            def counted(n: int = refused) -> bool:
                text = fetch(url + "/metrics")[2]
                settled = foreign or value(text, "kvsidecar_sources") == max_targets
                return settled and (value(text, "kvsidecar_refused_segments") or 0) >= n

            assert wait_for(counted, timeout=60), fetch(url + "/metrics")[2][-2000:]
            text = fetch(url + "/metrics")[2]
            labelled = [n for n in made if n in text]
            assert len(labelled) <= (0 if foreign else max_targets), labelled[:10]
            values.append(_values(text))
        first, second = values[1] - values[0], values[2] - values[1]
        assert not any(k == "file" for k, _ in values[2]), "no label names a refused file"
        followed = {v for k, v in first if k == "segment"}
        assert len(followed) <= (0 if foreign else max_targets), followed
        assert second == set(), f"fresh names minted {len(second)} label values: {second}"
        refused_api = json.loads(fetch(url + "/api/v1/snapshots")[2])["refused"]
        assert refused_api["total"] >= refused
        assert len(refused_api["files"]) == REFUSED_LIST_MAX  # named there, bounded
        assert {r["file"] for r in refused_api["files"]} <= set(made)
