"""The ATOM adapter's counting, replayed from traces of ATOM's real scheduler (no ATOM here).

`atom_replay` says what a trace holds. Each recorded run compared our published values with
ATOM's own ``collect_metrics()`` at every push (0 mismatches, figures in
``atom_traces/index.json``); here the same operations go through the adapter again, so a
change to a counting rule shows as mismatches. The mutation tests break one rule each and
require the replay to catch it.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvsidecar.agent.engines import atom
from kvsidecar.agent.engines.atom import AtomPoolSource, DeferredFrees
from tests.engines import atom_replay

NAMES = atom_replay.trace_names()
PD = [n for n in NAMES if n.startswith("producer")]


def test_traces_are_present_and_small() -> None:
    assert len(NAMES) >= 4 and PD, NAMES
    size = sum(p.stat().st_size for p in atom_replay.TRACES.iterdir())
    assert size < 2_000_000, size
    index = json.loads((atom_replay.TRACES / "index.json").read_text())
    assert index["atom_commit"] == atom.CHECKED_COMMIT
    assert sorted(index["runs"]) == NAMES
    assert all(run["mismatches"] == 0 for run in index["runs"].values())


@pytest.mark.parametrize("name", NAMES)
def test_replay_matches_atom(name: str, tmp_path) -> None:
    trace = atom_replay.load(name)
    mismatches, counts = atom_replay.replay(trace, str(tmp_path))
    assert mismatches == [], mismatches[:5]
    recorded = json.loads((atom_replay.TRACES / "index.json").read_text())["runs"][name]
    assert counts["sets"] == recorded["deferrals"]
    assert counts["pushes"] == recorded["pushes"]
    assert counts["compared"] >= recorded["steps"]
    if name == "plain-4":  # the run without a connector and a small pool: ATOM preempted
        assert recorded["preemptions"] > 0
    if name in PD:  # every deferred request was released by the end of the run
        assert counts["pops"] == counts["sets"] > 0
        assert recorded["shared_deferred_max"] > 0  # the traces do share deferred blocks


def _sum_per_request(self: DeferredFrees) -> int:
    return sum(len(ids) for ids in self._held.values())


def _newest(self: DeferredFrees) -> int:
    return next(reversed(self._since.values())) if self._since else 0


def _vacant_only(snapshot):
    def wrapped(self: AtomPoolSource):
        s = snapshot(self)
        s.available_blocks -= s.cached_blocks
        return s

    return wrapped


MUTATIONS = {
    "shared blocks counted per request": ("blocks", property(_sum_per_request)),
    "release keeps the blocks": ("_drop", lambda self, ids: None),
    "newest deferral as the oldest": ("oldest_ns", property(_newest)),
    "cached blocks not available": ("snapshot", None),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_replay_catches_a_broken_counting_rule(mutation: str, tmp_path, monkeypatch) -> None:
    attr, value = MUTATIONS[mutation]
    if attr == "snapshot":
        monkeypatch.setattr(AtomPoolSource, "snapshot", _vacant_only(AtomPoolSource.snapshot))
    else:
        monkeypatch.setattr(DeferredFrees, attr, value)
    caught = []
    for name in PD:
        mismatches, _ = atom_replay.replay(atom_replay.load(name), str(tmp_path))
        caught.append(len(mismatches))
    assert all(n > 0 for n in caught), (mutation, caught)


# -- DeferredFrees as a dict ATOM uses -------------------------------------------------------


def _seq(*blocks: int) -> SimpleNamespace:
    return SimpleNamespace(block_table=list(blocks))


def test_deferred_frees_is_the_dict_atom_sees() -> None:
    clock = iter(range(100, 200)).__next__
    d = DeferredFrees({7: _seq(1, 2)}, clock=clock)
    d[8] = _seq(2, 3, 4)
    d[9] = SimpleNamespace()  # ATOM's own tests defer non-Sequences: no table, no blocks
    assert (len(d), d.requests, d.blocks, d.oldest_ns) == (3, 2, 4, 100)  # 9 holds none
    assert list(d) == [7, 8, 9] and isinstance(d, dict) and d == {7: d[7], 8: d[8], 9: d[9]}
    d[7] = _seq(5)  # re-set: new blocks, same start (deferred since 100)
    assert (d.blocks, d.oldest_ns) == (4, 100)  # {2,3,4} + {5}
    assert d.pop(7) is not None and (d.blocks, d.oldest_ns) == (3, 101)
    assert d.pop(7, "gone") == "gone"
    with pytest.raises(KeyError):
        d.pop(7)
    del d[8]
    # Issue 30 item 3: only 9 is left, holding no block: no deferral, no age (was 102).
    assert (len(d), d.requests, d.blocks, d.oldest_ns) == (1, 0, 0, 0)
    d[9] = _seq(8)  # the same key now holding a block: deferred from now on
    assert (d.requests, d.blocks, d.oldest_ns) == (1, 1, 102)
    d[9] = SimpleNamespace()
    assert (d.requests, d.blocks, d.oldest_ns) == (0, 0, 0)
    d.setdefault(10, _seq(6))
    d |= {11: _seq(6, 7)}
    assert (len(d), d.requests, d.blocks) == (3, 2, 2)
    key, _ = d.popitem()
    assert key == 11 and d.blocks == 1
    d.clear()
    assert (len(d), d.blocks, d.oldest_ns) == (0, 0, 0)


def test_deferred_frees_never_raises_on_a_bad_table() -> None:
    class Broken:
        @property
        def block_table(self):
            raise RuntimeError("boom")

    d = DeferredFrees()
    d[1] = Broken()  # ATOM's insert still happens; our count just lacks its blocks
    assert 1 in d and d.blocks == 0
    assert d.pop(1) is not None and len(d) == 0


def test_array_block_tables_count_like_lists() -> None:
    from array import array

    d = DeferredFrees()
    d[1] = SimpleNamespace(block_table=array("i", [3, 4, 5]))
    d[2] = _seq(4, 5, 6)
    assert d.blocks == 4
