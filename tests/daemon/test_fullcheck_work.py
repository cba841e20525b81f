"""The gateway's full check of a new step (issue 44 item 1): budget.py's per-field checks
are not run for a snapshot whose records are plainly in range (fastcheck.py decides each
record whole), while every check still refuses what it refused. Counted, not timed: the
calls of budget.py's per-field functions during one full check (main: ~200 value checks
and 5 string scans a 4-pool step). And fastcheck's verdicts equal budget.py's on random
snapshots."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsidecar.bench.fleet import realistic_snapshot
from kvsidecar.daemon import budget, fastcheck
from kvsidecar.daemon import gateway_body as gb
from kvsidecar.daemon.config import Discovery, Polling
from kvsidecar.daemon.gateway import Gateway
from kvsidecar.daemon.gateway_template import Templates
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol.schema import INT_LIMIT, Snapshot
from kvsidecar.protocol.writer import SegmentWriter


class _Counted:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, _Counted]:
    out = {}
    for name in ("valid_value", "_strings", "series_estimate"):
        out[name] = _Counted(getattr(budget, name))
        monkeypatch.setattr(budget, name, out[name])
    return out


def test_a_full_check_of_a_new_step_runs_no_per_field_check(
    shm_dir: str, counted: dict[str, _Counted]
) -> None:
    snap = realistic_snapshot(4)
    snap.runtime.dp_rank, snap.runtime.dp_size = 0, 1
    writer = SegmentWriter("kvsidecar.bench.dp0.tp0.pp0", shm_dir=shm_dir)
    try:
        writer.publish(snap)
        targets = TargetSet(Discovery(shm_dir), polling=Polling(poll_interval=0.25))
        targets.poll_all()
        gateway = Gateway(targets)
        assert gateway.answer(0)[0] == 200
        (target,) = targets.targets.values()
        for name in counted:
            counted[name].calls = 0
        checks = gateway.full_checks
        snap.runtime.step += 1
        snap.pools[0].allocated_blocks = 80_123
        writer.publish(snap)
        status, body, _, step = gateway.answer(0)
        assert (status, step) == (200, b"Kvsidecar-Step: %d\r\n" % snap.runtime.step)
        assert gateway.full_checks == checks + 1  # the new step was read and checked
        # main: 200+ valid_value calls, 5 _strings scans, one series_estimate
        assert {n: c.calls for n, c in counted.items()} == dict.fromkeys(counted, 0)

        # ...and each check still refuses what it refused: a value out of range is dropped
        # and counted, a label over the budget refuses the snapshot (budget.py's words).
        snap.runtime.step += 1
        snap.pools[1].allocated_blocks = -5
        writer.publish(snap)
        assert gateway.answer(0)[0] == 200
        assert target.view.rejected_values_total == {"pool.allocated_blocks": 1}
        assert target.view.last.snapshot.pools[1].allocated_blocks is None
        assert counted["valid_value"].calls > 0
        snap.pools[1].allocated_blocks = 5
        snap.runtime.step += 1
        snap.runtime.model_name = "m" * (target.budget.max_label_length + 1)
        writer.publish(snap)
        status, body, _, _ = gateway.answer(0)
        assert status == 503 and b"--max-label-length" in body
    finally:
        writer.close()


# What msgpack can carry: ints in [-2^63, 2^64), floats, bools, nil.
_NUMBERS = st.one_of(
    st.none(),
    st.integers(min_value=-5, max_value=2**64 - 1),
    st.sampled_from([0, 1, INT_LIMIT - 1, INT_LIMIT, -1, 2**64 - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf, float(INT_LIMIT), 1e300]),
    st.booleans(),
)
_STRINGS = st.one_of(st.text(max_size=8), st.sampled_from(["é" * 70, "x" * 300, "🙂" * 40]))


_TYPED = (
    budget.RUNTIME_VALUE_FIELDS
    + budget.POOL_VALUE_FIELDS
    + budget._RUNTIME_IDENTITY
    + budget._POOL_IDENTITY
)


def _vary(record: msgspec.Struct, data: st.DataObject) -> msgspec.Struct:
    changes = {}
    for f in data.draw(st.sets(st.sampled_from(record.__struct_fields__), max_size=6)):
        if f not in _TYPED:
            changes[f] = data.draw(_STRINGS)  # a str field (the decoder gives no other type)
        elif f in budget._RUNTIME_IDENTITY or f in budget._POOL_IDENTITY:
            changes[f] = data.draw(st.integers(min_value=-2, max_value=2**64 - 1))
        else:
            changes[f] = data.draw(_NUMBERS)
    return msgspec.structs.replace(record, **changes)


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except budget.OverBudget as e:
        return ("over", e.limit, str(e))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), pools=st.integers(0, 5), label=st.sampled_from([64, 128, 256]),
       series=st.sampled_from([20, 120, 4096]))  # fmt: skip
def test_fastcheck_decides_as_budget_py(data: st.DataObject, pools: int, label: int, series: int):
    base = realistic_snapshot(max(pools, 1))
    snapshot = Snapshot(
        runtime=_vary(base.runtime, data), pools=[_vary(p, data) for p in base.pools[:pools]]
    )
    limits = budget.Budget(max_label_length=label, max_series_per_target=series)
    assert _outcome(fastcheck.check, snapshot, limits) == _outcome(budget.check, snapshot, limits)
    fast, slow = fastcheck.sanitize(snapshot), budget.sanitize(snapshot)
    assert fast[1] == slow[1]
    assert msgspec.msgpack.encode(fast[0]) == msgspec.msgpack.encode(slow[0])


_TEMPLATES = Templates()  # one for every example: its kept text meets many snapshots
_ENGINES = st.sampled_from(["vllm", "sglang", "atom", "kvcached", "unknown"])
_ROLES = st.sampled_from(["prefill", "decode", "both", "x"])
_LABEL_TEXT = st.sampled_from(["m", "Qwen/Qwen3-8B", 'a"b\\c\nd', "é🙂", ""])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), pools=st.integers(0, 4), engine=_ENGINES, model=_LABEL_TEXT,
       role=_ROLES, now=st.integers(0, 2**63 - 1))  # fmt: skip
def test_the_kept_text_body_equals_gateway_body_render(
    data: st.DataObject, pools: int, engine: str, model: str, role: str, now: int
) -> None:
    base = realistic_snapshot(max(pools, 1))
    runtime = msgspec.structs.replace(
        _vary(base.runtime, data), engine=engine, model_name=model, role=role
    )
    snapshot = Snapshot(runtime=runtime, pools=[_vary(p, data) for p in base.pools[:pools]])
    try:
        want = gb.render(snapshot, now)
    except (TypeError, ValueError, OverflowError, ZeroDivisionError) as e:
        with pytest.raises(type(e)):
            _TEMPLATES.render(snapshot, now)
        return
    assert _TEMPLATES.render(snapshot, now) == want


@pytest.mark.parametrize(
    ("first", "then"),
    [
        ({"total_blocks": 120000.0}, {"total_blocks": 120000}),  # the count label's text
        ({"block_size_tokens": 16.0}, {"block_size_tokens": 16}),
        ({"block_size_tokens": True}, {"block_size_tokens": 1}),
    ],
)
def test_kept_text_is_never_served_for_an_equal_value_that_prints_differently(
    first: dict, then: dict
) -> None:
    """CI of 2298cff: a float count kept 120000.0's label text, then served it for 120000
    (equal as dict keys). Each body must equal the reference whatever came before."""
    templates = Templates()
    base = realistic_snapshot(1)
    for changes in (first, then):
        snap = Snapshot(
            runtime=base.runtime, pools=[msgspec.structs.replace(base.pools[0], **changes)]
        )
        assert templates.render(snap, 0) == gb.render(snap, 0)


@pytest.mark.parametrize(
    ("first", "then"), [({"dp_rank": True}, {"dp_rank": 1}), ({"tp_rank": 0.0}, {"tp_rank": 0})]
)
def test_kept_identity_is_never_served_for_an_equal_value_that_prints_differently(
    first: dict, then: dict
) -> None:
    templates = Templates()
    base = realistic_snapshot(1)
    for changes in (first, then):
        snap = Snapshot(runtime=msgspec.structs.replace(base.runtime, **changes), pools=base.pools)
        assert templates.render(snap, 0) == gb.render(snap, 0)
