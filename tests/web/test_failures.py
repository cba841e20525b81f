"""`failures.Failures`: one wrong password a while ago is not suspect, two lately or one
just now are, and scores halve every `HALF_LIFE_S` (a clock of our own: no waiting)."""

from __future__ import annotations

from kvsidecar.web.failures import HALF_LIFE_S, RECENT_S, Failures


def test_one_wrong_password_a_while_ago_is_not_suspect_two_lately_are() -> None:
    now = [100.0]
    f = Failures(memory=8, clock=lambda: now[0])
    assert not f.suspect("a")
    f.add("a")
    assert f.suspect("a")  # just now: a client retrying at once
    now[0] += RECENT_S
    assert not f.suspect("a")  # a rotation's one wrong password, retried later
    f.add("a")
    now[0] += 2 * RECENT_S
    assert f.suspect("a")  # two within a short while: a flood (for ~20 s after)
    now[0] += 2 * HALF_LIFE_S
    assert not f.suspect("a")  # decayed below the threshold
    assert f.score("a") < 1.0


def test_memory_is_bounded_oldest_forgotten() -> None:
    f = Failures(memory=2, clock=lambda: 0.0)
    for host in ("a", "b", "c"):
        f.add(host)
    assert "a" not in f and "b" in f and "c" in f and len(f) == 2
