"""Schema round trips and additive evolution (property tests)."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.protocol import schema
from kvsidecar.protocol.schema import (
    Capabilities,
    KVCachePoolSnapshot,
    RuntimeSnapshot,
    Snapshot,
    current_capabilities,
    decode_snapshot,
    encode_snapshot,
)

ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
opt_ints = st.none() | ints
text = st.text(max_size=40)


def _strategy_for(record: type[msgspec.Struct]) -> st.SearchStrategy:
    fields = {}
    for f in msgspec.structs.fields(record):
        t = f.type
        if t is int:
            fields[f.name] = ints
        elif t is str:
            fields[f.name] = text
        elif t is float:
            fields[f.name] = st.floats(allow_nan=False)
        elif t is bool:
            fields[f.name] = st.booleans()
        elif t == (int | None):
            fields[f.name] = opt_ints
        elif t == (str | None):
            fields[f.name] = st.none() | text
        elif t == (bool | None):
            fields[f.name] = st.none() | st.booleans()
        else:  # pragma: no cover - a new field type needs a strategy here
            raise AssertionError(f"no strategy for {record.__name__}.{f.name}: {t}")
    return st.builds(record, **fields)


runtimes = _strategy_for(RuntimeSnapshot)
pools = _strategy_for(KVCachePoolSnapshot)
snapshots = st.builds(Snapshot, runtime=runtimes, pools=st.lists(pools, max_size=6))


@settings(max_examples=300, deadline=None)
@given(snapshots)
def test_snapshot_round_trip(snap: Snapshot) -> None:
    assert decode_snapshot(encode_snapshot(snap)) == snap


# A "future" schema: every record grew new optional fields at the end (minor bump).
class FuturePool(KVCachePoolSnapshot, array_like=True, kw_only=True):
    future_gauge: int | None = None
    future_label: str | None = None


class FutureRuntime(RuntimeSnapshot, array_like=True, kw_only=True):
    future_flag: bool | None = None


class FutureSnapshot(msgspec.Struct, array_like=True, kw_only=True):
    runtime: FutureRuntime
    pools: list[FuturePool] = []
    future_section: dict[str, int] | None = None


future_pools = st.builds(
    FuturePool, future_gauge=opt_ints, future_label=st.none() | text, total_blocks=ints
)
future_snapshots = st.builds(
    FutureSnapshot,
    runtime=st.builds(FutureRuntime, step=ints, future_flag=st.booleans()),
    pools=st.lists(future_pools, max_size=4),
    future_section=st.none() | st.dictionaries(text, ints, max_size=3),
)


@settings(max_examples=200, deadline=None)
@given(future_snapshots)
def test_old_reader_reads_newer_writer(snap: FutureSnapshot) -> None:
    """An older daemon decodes a newer agent's payload: extra trailing fields are ignored."""
    old = decode_snapshot(msgspec.msgpack.encode(snap))
    assert old.runtime.step == snap.runtime.step
    assert [p.total_blocks for p in old.pools] == [p.total_blocks for p in snap.pools]
    for name in RuntimeSnapshot.__struct_fields__:
        assert getattr(old.runtime, name) == getattr(snap.runtime, name)


@settings(max_examples=200, deadline=None)
@given(snapshots)
def test_newer_reader_reads_older_writer(snap: Snapshot) -> None:
    """A newer daemon decodes an older agent's payload: missing fields are None (unsupported)."""
    new = msgspec.msgpack.decode(encode_snapshot(snap), type=FutureSnapshot)
    assert new.future_section is None
    assert new.runtime.future_flag is None
    assert all(p.future_gauge is None for p in new.pools)
    assert new.runtime.step == snap.runtime.step


def test_capabilities_name_every_position() -> None:
    caps = current_capabilities()
    assert caps.runtime_fields == list(RuntimeSnapshot.__struct_fields__)
    assert caps.pool_fields == list(KVCachePoolSnapshot.__struct_fields__)
    assert caps.snapshot_fields == ["runtime", "pools"]
    assert caps.schema_major == schema.SCHEMA_MAJOR
    # The directory is keyed, so any msgpack reader can use it without our classes.
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(caps))
    assert plain["pool_fields"][0] == "pool_name"
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(caps), type=Capabilities) == caps


def test_required_fields_present() -> None:
    """The issue's field list; removing or renaming one is a major change."""
    runtime = set(RuntimeSnapshot.__struct_fields__)
    pool = set(KVCachePoolSnapshot.__struct_fields__)
    assert {
        "schema_version",
        "engine",
        "engine_version",
        "model_name",
        "role",
        "pid",
        "start_time",
        "device",
        "dp_rank",
        "dp_size",
        "tp_rank",
        "tp_size",
        "pp_rank",
        "pp_size",
        "initialized",
        "step",
        "requests_running",
        "requests_waiting",
        "requests_deferred_free",
        "device_total_bytes",
        "device_free_bytes",
    } <= runtime
    assert {
        "pool_name",
        "pool_type",
        "group_id",
        "num_layers",
        "num_kv_buffers",
        "block_size_tokens",
        "block_size_bytes",
        "total_blocks",
        "allocated_blocks",
        "reserved_blocks",
        "available_blocks",
        "cached_blocks",
        "allocated_bytes",
        "reserved_bytes",
        "available_bytes",
        "virtual_per_layer_bytes",
        "virtual_total_bytes",
        "mapped_bytes",
        "in_shrink",
        "shrink_target_blocks",
        "deferred_free_requests",
        "deferred_free_blocks",
        "tokens_used",
        "allocs_total",
        "frees_total",
        "evictions_total",
        "alloc_failures_total",
        "prefix_queries_total",
        "prefix_hits_total",
    } <= pool


def test_wire_order_is_frozen() -> None:
    """Positions are the contract: the first fields may never move (append only)."""
    assert RuntimeSnapshot.__struct_fields__[:4] == (
        "schema_version",
        "engine",
        "engine_version",
        "model_name",
    )
    assert KVCachePoolSnapshot.__struct_fields__[:3] == ("pool_name", "pool_type", "group_id")


def test_to_dict_is_keyed() -> None:
    snap = Snapshot(runtime=RuntimeSnapshot(step=3), pools=[KVCachePoolSnapshot(total_blocks=9)])
    d = schema.to_dict(snap)
    assert d["runtime"]["step"] == 3 and d["pools"][0]["total_blocks"] == 9


def test_a_short_record_is_seen_by_its_last_non_null_default() -> None:
    """The reader tells a record cut short from a whole one by `schema.unsent_count()`
    (issue 30 item 4): that holds only if the last field with a non-null default counts
    its use and every later field (each appended by a minor) defaults to null."""
    import typing

    for record in (RuntimeSnapshot, KVCachePoolSnapshot):
        fields = msgspec.structs.fields(record)
        last = max(i for i, f in enumerate(fields) if f.default is not None)
        assert fields[last].default is msgspec.NODEFAULT, fields[last]  # a default_factory
        for f in fields[last + 1 :]:
            assert f.default is None and type(None) in typing.get_args(f.type), f.name
        values = msgspec.to_builtins(record(**{f.name: f.type() for f in fields[:3]}))
        before = schema.unsent_count()
        msgspec.msgpack.decode(msgspec.msgpack.encode(values), type=record)
        assert schema.unsent_count() == before  # whole: nothing filled in
        msgspec.msgpack.decode(msgspec.msgpack.encode(values[:last]), type=record)
        assert schema.unsent_count() == before + 1  # cut short: counted
