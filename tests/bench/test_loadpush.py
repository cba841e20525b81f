"""`bench loadpush`'s delay: from a step's publish to the first reading of it or a later
step (a later one supersedes it), never to a reading older than the step."""

from __future__ import annotations

from kvsidecar.bench.loadpush import _delays


def test_delay_is_to_the_first_reading_at_or_after_the_step() -> None:
    ms = 1_000_000
    stamps = [(1, 0), (2, 10 * ms), (3, 20 * ms), (4, 30 * ms)]
    # A poller that saw step 1 at 5 ms, then step 3 at 52 ms (step 2 never on its own).
    seen = [(1, 5 * ms), (1, 8 * ms), (3, 52 * ms)]
    assert _delays(stamps, seen) == [5.0, 42.0, 32.0]  # step 4: never seen, no delay
    assert _delays(stamps, []) == []
