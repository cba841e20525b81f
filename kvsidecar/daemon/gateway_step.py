"""A gateway rank's answer for a new step without the Python full check (issue 44 item 1).

`Gateway._answer` (the target's poll with every check, then the body) costs 155-235 us
of the listener thread's CPU run cold, and at 50 steps/s nearly every poll finds a new
step. `compiled_step` hands the listener's compiled path a `_gatewaystep.Step` holding what
a full check decided (its header and payload bytes, the body's kept text): a new step
whose bytes differ from those only in counts and counters is answered in C (the module's
comment says exactly what it checks); anything else takes the full check, as before.

What may move between two steps without a full check (`RUNTIME_VOLATILE`,
`POOL_VOLATILE`): the value fields of budget.py whose new value, an unsigned integer, can
change neither a check's verdict (range, series count, identity, strings) nor the body's
text outside its three numbers. Never the block size or capacity (the info gauge's
labels), the held KV (its blocks are printed as text, and a deferral's stamp makes the body
age: not timeless, never re-served), a stamp (budget.reject_future_stamps), a bool, or
a field that says what the writer supports.
"""

from __future__ import annotations

from kvsidecar.daemon import budget
from kvsidecar.daemon import gateway_body as gb
from kvsidecar.daemon.gateway_template import Templates
from kvsidecar.daemon.target import Target
from kvsidecar.protocol import _seqlock, layout
from kvsidecar.protocol.reader import Reading
from kvsidecar.protocol.schema import KVCachePoolSnapshot, RuntimeSnapshot

try:
    from kvsidecar.daemon import _gatewaystep
except ImportError:  # not built (no compiler): every new step takes the full check
    _gatewaystep = None  # type: ignore[assignment]

__all__ = ["COMPILED", "POOL_VOLATILE", "RUNTIME_VOLATILE", "STEP_HEADER", "compiled_step"]

COMPILED = _gatewaystep is not None
STEP_HEADER = b"Kvsidecar-Step: "  # which step an answer is of (the bench's freshness)

_FIXED = {
    # The info gauge's labels and the bytes a block holds.
    "num_layers",
    "num_kv_buffers",
    "block_size_tokens",
    "block_size_bytes",
    "total_blocks",
    "total_pages",
    "page_size_bytes",
    "virtual_per_layer_bytes",
    "virtual_total_bytes",
    "virtual_blocks",
    # A shrink under way, the held KV (printed), a stamp.
    "shrink_target_blocks",
    "resize_target_bytes",
    "deferred_free_requests",
    "deferred_free_blocks",
    "oldest_deferred_free_mono_ns",
    # Flags (never unsigned integers on the wire: a change would be declined anyway).
    "initialized",
    "in_shrink",
    "null_block_reserved",
    # The writer's identity of a kind, and its own failures (also in the header).
    "start_time",
    "device_total_bytes",
    "publish_errors_total",
}
RUNTIME_VOLATILE = tuple(f for f in budget.RUNTIME_VALUE_FIELDS if f not in _FIXED)
POOL_VOLATILE = tuple(f for f in budget.POOL_VALUE_FIELDS if f not in _FIXED)


def _mask(record: type, fields: tuple[str, ...]) -> int:
    index = [record.__struct_fields__.index(f) for f in fields]
    assert max(index) < 64, "a volatile field past the 64-bit mask"
    return sum(1 << i for i in index)


_RT_MASK = _mask(RuntimeSnapshot, RUNTIME_VOLATILE)
_POOL_MASK = _mask(KVCachePoolSnapshot, POOL_VOLATILE)
_FIELDS = (
    RuntimeSnapshot.__struct_fields__.index("step"),
    RuntimeSnapshot.__struct_fields__.index("requests_running"),
    RuntimeSnapshot.__struct_fields__.index("requests_waiting"),
    KVCachePoolSnapshot.__struct_fields__.index("total_blocks"),
    KVCachePoolSnapshot.__struct_fields__.index("allocated_blocks"),
    KVCachePoolSnapshot.__struct_fields__.index("available_blocks"),
)
# Header bytes a publish moves: the published sequence and the heartbeat.
_FREE = bytearray(layout.HEADER_LEN)
for _off in (layout.OFF_PUBLISHED_SEQ, layout.OFF_HEARTBEAT_MONO, layout.OFF_HEARTBEAT_WALL):
    _FREE[_off : _off + 8] = b"\x01" * 8
_HEADER_FREE = bytes(_FREE)
# gateway_body's usage formulas as the compiled check names them.
_USAGE = (
    {
        None: _gatewaystep.USAGE_NONE,
        gb.USAGE_FREE: _gatewaystep.USAGE_FREE,
        gb.USAGE_USED: _gatewaystep.USAGE_USED,
        gb.USAGE_FULLEST: _gatewaystep.USAGE_FULLEST,
    }
    if _gatewaystep is not None
    else {}
)


def compiled_step(
    target: Target,
    last: Reading,
    templates: Templates,
    start: bytes,
    *,
    every: float,
    stale_after: float,
    probed_until: float,
    progress: float,
) -> object | None:
    """A `Step` for the rank's last full check, which answered 200 from `last` with a
    timeless body; None where the compiled check cannot stand for the full one (not
    built, a value rejected or read field by field, a v1.0 writer's flock liveness).
    `start`: the response's bytes before its Content-Length value; `every`: seconds
    between the probes (the first due at `probed_until`), and the most an answer stays
    current; `stale_after`: the gateway's progress bound; `progress`: when the check saw
    the writer's last progress (monotonic seconds)."""
    base = target.fast_base
    reader = target.reader
    header = reader.header
    if (
        _gatewaystep is None
        or base is None
        or base[:2] != (last.incarnation, last.seq)
        or header is None
        or header.minor < layout.MINOR_OFD_LIVENESS
        or reader.mm is None
    ):
        return None
    snapshot = last.snapshot
    names = gb.engine_names(snapshot.runtime.engine)
    counted = gb._sized(snapshot.pools)
    sized = bytes(1 if any(p is c for c in counted) else 0 for p in snapshot.pools)
    return _gatewaystep.Step(
        read=_seqlock.read_latest,
        reader=reader,
        mm=reader.mm,
        header=base[2],
        free=_HEADER_FREE,
        payload=base[3],
        sized=sized,
        parts=templates.parts(snapshot),
        start=start,
        step_head=STEP_HEADER,
        rt_volatile=_RT_MASK,
        pool_volatile=_POOL_MASK,
        fields=_FIELDS,
        usage=_USAGE[gb.usage_kind(counted, names)],
        usage_digits=-1 if names.usage_digits is None else names.usage_digits,
        retries=reader.retries,
        fd=reader.fd,
        inode=reader.inode,
        size=len(reader.mm),
        every=every,
        stale_after=stale_after,
        probed=probed_until,
        progress=progress,
        seq=last.seq,
        beat=last.heartbeat_mono_ns,
        beat_off=layout.OFF_HEARTBEAT_MONO,
    )
