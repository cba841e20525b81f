"""Every string of a snapshot counts against --max-label-length (issue 24 item 2): a
chosen list of fields forgot runtime.instance, and a 900,000-character one was served."""

from __future__ import annotations

import pytest

from kvsidecar.daemon import budget
from kvsidecar.protocol.schema import KVCachePoolSnapshot, RuntimeSnapshot, Snapshot


@pytest.mark.parametrize(
    "snapshot",
    [
        Snapshot(runtime=RuntimeSnapshot(instance="i" * 900_000), pools=[]),
        Snapshot(runtime=RuntimeSnapshot(), pools=[KVCachePoolSnapshot(pool_type="t" * 300)]),
    ],
    ids=["runtime.instance", "pool.pool_type"],
)
def test_every_string_counts(snapshot: Snapshot) -> None:
    with pytest.raises(budget.OverBudget) as e:
        budget.check(snapshot, budget.Budget())
    assert e.value.limit == "label_length"


def test_strings_within_the_limit_pass() -> None:
    snap = Snapshot(runtime=RuntimeSnapshot(instance="i" * 256), pools=[KVCachePoolSnapshot()])
    budget.check(snap, budget.Budget())
