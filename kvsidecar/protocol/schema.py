"""The snapshot schema: the records the agent publishes and the daemon serves.

One source of truth for both sides. Records are msgspec Structs encoded as
MessagePack *arrays* (``array_like=True``): field order is the wire order.
The names travel separately, once per segment, in the `Capabilities` record
(the segment's directory), so the payload stays small (about 0.5 KB for a
runtime and four pools) and still self-describing.

Evolution rule (kvcached's, made mechanical by positional encoding):

* New optional fields are **appended** to the end of a record with a default
  of ``None``; that is a minor version bump. An older reader ignores trailing
  fields it does not know; a newer reader reads fields an older writer did not
  send as ``None`` (never a default: schema.md, "Values").
* A missing field (``None``) means *unsupported by this writer*, never zero.
* The major version changes only when an existing field's meaning, type or
  position changes. A reader refuses a different major version.

Overlaps (never sum these): ``allocated_blocks`` includes ``reserved_blocks``;
``available_blocks`` includes ``reserved_blocks`` too (kvcached drains the
reserve ledger first); ``cached_blocks`` are free-but-evictable prefix blocks
and are counted in ``available_blocks``, not in ``allocated_blocks``.
``deferred_free_blocks`` is a subset of ``allocated_blocks``.
"""

from __future__ import annotations

from typing import Any

import msgspec

SCHEMA_MAJOR = 1
# 1.1: token-unit prefix counters, oldest deferral, kvcached pages; 1.2: virtual_blocks,
# protected_blocks (virtual_* = the reservation, as in kvcached); 1.3: runtime instance and
# distinct deferred requests; 1.4: deferrals ended / ended by lease expiry, and their blocks;
# the contract made exact (schema.md, Changelog)
SCHEMA_MINOR = 4
SCHEMA_VERSION = f"kvsidecar.snapshot.v{SCHEMA_MAJOR}.{SCHEMA_MINOR}"

ROLES = ("prefill", "decode", "both")


class _Unsent:
    """Records built without their last field whose default is not null, counted.

    A typed decode fills the fields past a record's end with their defaults, so a record
    cut short (a runtime ``[]``) would read the writer's defaults, engine "unknown" and
    pid 0, where nothing was sent. A record short of any such field lacks the last one, so
    that field alone has a counting default factory: a reader compares `unsent_count()`
    around its decode, which costs nothing on a whole record, and reads a short one field
    by field (reader.decode_lenient: null, or Corrupt for an identity field). A writer
    that leaves the field unset counts too; a false alarm only takes the slower path."""

    count = 0


def _counted(value: object) -> Any:
    def factory() -> object:
        _Unsent.count += 1
        return value

    return factory


def unsent_count() -> int:
    return _Unsent.count


class RuntimeSnapshot(msgspec.Struct, array_like=True, kw_only=True, gc=False):
    """Engine-process state for one rank. Counts are instantaneous unless named ``*_total``."""

    schema_version: str = SCHEMA_VERSION
    engine: str = "unknown"  # vllm / sglang / atom / kvsidecar-demo
    engine_version: str = ""
    model_name: str = ""
    role: str = "both"  # prefill / decode / both
    pid: int = 0
    start_time: float = 0.0  # unix seconds the agent started
    device: str = ""  # e.g. "cuda:0", "cpu"
    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    initialized: bool = False
    step: int = 0  # engine step counter (monotonic for one incarnation)
    requests_running: int = 0
    requests_waiting: int = 0
    requests_deferred_free: int = 0  # finished/aborted, held until every connector releases
    device_total_bytes: int | None = None
    device_free_bytes: int | None = None
    # Agent self-metrics: errors while publishing, and how long the previous publish took.
    publish_errors_total: int = 0
    last_publish_duration_ns: int = msgspec.field(default_factory=_counted(0))  # see _Unsent
    # -- v1.3 ------------------------------------------------------------------
    # Id shared by every rank of one engine instance (its DP ranks): readers sum across
    # DP ranks only within one instance, never across two engines that look alike.
    instance: str | None = None
    # Distinct requests deferred on this rank (one request deferring in several pools
    # counts once); None when this writer cannot tell (no pool supports deferral, or
    # several pools report counts without request ids). requests_deferred_free above keeps
    # its v1.0 meaning (0 when unsupported) for older readers.
    requests_deferred_free_distinct: int | None = None
    # -- v1.4 ------------------------------------------------------------------
    # Preemptions since the engine started, each once, as the engine counts them (vLLM
    # Scheduler._preempt_request calls; ATOM Scheduler.total_preemptions); None when the
    # writer has no count.
    preemptions_total: int | None = None


class KVCachePoolSnapshot(msgspec.Struct, array_like=True, kw_only=True, gc=False):
    """One KV-cache pool (kvcached #385 names where they exist).

    Block counts are in blocks; ``*_bytes`` are whole-pool bytes
    (blocks x block_size_bytes x num_layers x num_kv_buffers).
    ``*_total`` fields are cumulative counters since the agent started.
    Fields typed ``int | None`` are ones some allocators cannot report (kvcached
    has no prefix cache, deferral or token counters): ``None`` = unsupported.
    """

    pool_name: str = "block_pool"  # block_pool (vLLM-like), mha / mla (SGLang-like)
    pool_type: str = "kv_cache"
    group_id: int = 0
    num_layers: int = 0
    num_kv_buffers: int = 2  # 2 = K and V (MHA/GQA), 1 = MLA
    block_size_tokens: int = 0
    block_size_bytes: int = 0  # one block, one layer, one buffer
    total_blocks: int = 0  # current capacity, excluding the null block
    allocated_blocks: int = 0  # referenced by a request or reserved; includes reserved
    reserved_blocks: int = 0  # reserve ledger (try_to_reserve), part of allocated and available
    available_blocks: int = 0  # allocatable now: free + evictable cached + reserved
    cached_blocks: int | None = None  # unreferenced prefix blocks, evictable (in available)
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    available_bytes: int = 0
    # Reserved storage of one layer, all buffers (kvcached: the fixed virtual reservation;
    # since v1.2 also for our pool, whose reservation is its storage, null block included):
    # virtual_blocks x block_size_bytes x num_kv_buffers. mapped_bytes never exceeds it.
    virtual_per_layer_bytes: int = 0
    virtual_total_bytes: int = 0  # virtual_per_layer_bytes x num_layers
    mapped_bytes: int = 0  # physically backed bytes of the pool
    in_shrink: bool = msgspec.field(default_factory=_counted(False))  # see _Unsent
    shrink_target_blocks: int | None = None
    deferred_free_requests: int | None = None
    deferred_free_blocks: int | None = None  # held by deferred requests, shared counted once
    tokens_used: int | None = None  # tokens actually stored (token occupancy <= block occupancy)
    allocs_total: int | None = None  # blocks handed out
    frees_total: int | None = None  # blocks returned
    evictions_total: int | None = None  # cached prefix blocks evicted to make room
    alloc_failures_total: int | None = None  # allocation requests refused for lack of blocks
    prefix_queries_total: int | None = None  # blocks looked up in the prefix cache
    prefix_hits_total: int | None = None  # of which found
    # Optional, from adapters of engines that have them (kvcached page allocator).
    integration: str | None = None
    null_block_reserved: bool | None = None
    total_pages: int | None = None
    free_pages: int | None = None
    inuse_pages: int | None = None
    reserved_pages: int | None = None
    resize_target_bytes: int | None = None
    # -- v1.1 ------------------------------------------------------------------
    # Prefix-cache counters in tokens, vLLM's unit (vllm:prefix_cache_queries_total /
    # hits_total count request tokens looked up / found), beside the block counters above.
    prefix_query_tokens_total: int | None = None
    prefix_hit_tokens_total: int | None = None
    # CLOCK_MONOTONIC (ns) at which the oldest still-deferred request of this pool began
    # deferring; 0 while none is deferred. The daemon exports now - this as an age, so the
    # age keeps growing while a stuck transfer also stops the engine from stepping.
    oldest_deferred_free_mono_ns: int | None = None
    # kvcached page allocator (kvcached.observability.v1 names).
    page_size_bytes: int | None = None
    available_physical_pages: int | None = None
    effective_free_pages: int | None = None
    # -- v1.2 ------------------------------------------------------------------
    # Blocks the reservation behind virtual_per_layer_bytes holds, a null block included
    # (kvcached's own total_blocks, its initial num_blocks; resize() does not change it).
    # total_blocks stays the *current* usable capacity for every source.
    virtual_blocks: int | None = None
    # Allocated blocks that are also prefix-cache entries pinned by running requests
    # (SGLang protected_size(): locked radix nodes); a subset of allocated_blocks.
    protected_blocks: int | None = None
    # -- v1.4 ------------------------------------------------------------------
    # Deferrals of this pool that ended (the connector released the blocks), the blocks each
    # held then and how long it held them (CLOCK_MONOTONIC ns), summed; the *_expired_* ones
    # count those the connector reported as released by lease expiry rather than by a
    # completed transfer (vLLM NixlConnector: vllm:nixl_num_kv_expired_reqs). None where the
    # writer cannot tell.
    deferred_free_ended_total: int | None = None
    deferred_free_ended_blocks_total: int | None = None
    deferred_free_ended_ns_total: int | None = None
    deferred_free_expired_total: int | None = None
    deferred_free_expired_blocks_total: int | None = None
    deferred_free_expired_ns_total: int | None = None


class Snapshot(msgspec.Struct, array_like=True, kw_only=True, gc=False):
    """What one slot of a segment carries: the runtime and every registered pool."""

    runtime: RuntimeSnapshot
    pools: list[KVCachePoolSnapshot] = []


# The value rule (schema.md, "Values"). Every number is in [0, INT_LIMIT) and finite.
# Identity fields name a rank or a pool (label values): one of the wrong type or out of
# range makes the snapshot Corrupt. Any other field of the wrong type or out of range
# is *rejected*: read as null (as if unsupported) and counted; the rest is served.
INT_LIMIT = 2**63
# Label values (every str field a reader turns into a label) longer than this are over a
# default daemon's budget (--max-label-length): the agent never publishes one.
MAX_LABEL_LENGTH = 256
IDENTITY_FIELDS = frozenset(
    {"pid", "dp_rank", "dp_size", "tp_rank", "tp_size", "pp_rank", "pp_size", "group_id"}
)


FEATURES = {
    "runtime_snapshot": True,
    "kv_cache_pool_snapshot": True,
    "deferred_free": True,
    "prefix_cache_counters": True,
    "policy_control": False,  # read-only by design
}


class Capabilities(msgspec.Struct, kw_only=True):
    """The segment's directory: keyed (not positional) so any reader can parse it.

    ``runtime_fields``/``pool_fields`` name the positions of the array-encoded
    records; ``snapshot_fields`` names the top-level Snapshot array.
    """

    schema_version: str = SCHEMA_VERSION
    schema_major: int = SCHEMA_MAJOR
    schema_minor: int = SCHEMA_MINOR
    features: dict[str, bool] = {}
    snapshot_fields: list[str] = []
    runtime_fields: list[str] = []
    pool_fields: list[str] = []


def field_names(record: type[msgspec.Struct]) -> list[str]:
    return list(record.__struct_fields__)


def current_capabilities() -> Capabilities:
    return Capabilities(
        features=dict(FEATURES),
        snapshot_fields=field_names(Snapshot),
        runtime_fields=field_names(RuntimeSnapshot),
        pool_fields=field_names(KVCachePoolSnapshot),
    )


def to_dict(record: msgspec.Struct) -> dict[str, Any]:
    """Keyed plain-data view of a record (for JSON output): names, not positions."""
    out: dict[str, Any] = {}
    for name in record.__struct_fields__:
        value = getattr(record, name)
        if isinstance(value, msgspec.Struct):
            value = to_dict(value)
        elif isinstance(value, list):
            value = [to_dict(v) if isinstance(v, msgspec.Struct) else v for v in value]
        out[name] = value
    return out


_ENCODER = msgspec.msgpack.Encoder()
_SNAPSHOT_DECODER = msgspec.msgpack.Decoder(Snapshot)


def encode_snapshot(snapshot: Snapshot) -> bytes:
    return _ENCODER.encode(snapshot)


def decode_snapshot(payload: bytes | memoryview) -> Snapshot:
    """Decode a payload by type alone; raises msgspec.DecodeError / ValidationError on bad
    input. A record cut short gets defaults here: `SegmentReader.read` applies schema.md's
    value rules (a missing or wrong value reads as null, an identity one is Corrupt)."""
    return _SNAPSHOT_DECODER.decode(payload)


def encode_capabilities(caps: Capabilities) -> bytes:
    return _ENCODER.encode(caps)


# A directory is ~1.2 KB; a reader refuses one far bigger before decoding it, so a hostile
# 16 MiB directory of empty strings cannot make it build millions of objects.
MAX_DIRECTORY_BYTES = 64 * 1024


class _WireCapabilities(msgspec.Struct):
    # Decode-only twin of Capabilities: every key but `features` is required, so a
    # directory without schema_major or a field list is refused, never read as major 1.
    schema_version: str
    schema_major: int
    schema_minor: int
    snapshot_fields: list[str]
    runtime_fields: list[str]
    pool_fields: list[str]
    features: dict[str, bool] = {}


_WIRE_CAPS_DECODER = msgspec.msgpack.Decoder(_WireCapabilities)


class _Major(msgspec.Struct):
    schema_major: int
    schema_minor: int = 0


_MAJOR_DECODER = msgspec.msgpack.Decoder(_Major)


def directory_version(data: bytes | memoryview) -> tuple[int, int]:
    """(schema_major, schema_minor) of a directory, checked before anything else in it:
    another major may have other keys. Raises like `decode_capabilities`."""
    if len(data) > MAX_DIRECTORY_BYTES:
        raise msgspec.ValidationError(
            f"directory of {len(data)} bytes > {MAX_DIRECTORY_BYTES}: not a kvsidecar directory"
        )
    v = _MAJOR_DECODER.decode(data)
    return v.schema_major, v.schema_minor


def decode_capabilities(data: bytes | memoryview) -> Capabilities:
    """Decode a directory; raises msgspec.DecodeError / ValidationError on bad input
    (too big, not a map, a required key missing or of the wrong type)."""
    directory_version(data)  # the size bound first
    wire = _WIRE_CAPS_DECODER.decode(data)
    return Capabilities(**msgspec.structs.asdict(wire))


def field_order_error(caps: Capabilities) -> str | None:
    """Where the directory's names disagree with this major's positions, else None.

    Readers decode by position, outside readers zip positions with the directory's
    names: both give the same values only if every name a reader knows sits at the
    position this major gives it. A newer minor may append names, an older one may
    have fewer; any other difference is a reorder, which needs a new major. A name listed
    twice (`step` again after the last known name) is refused too: zipping names gives the
    later position's value, decoding by position the earlier one."""
    for key, record in (
        ("snapshot_fields", Snapshot),
        ("runtime_fields", RuntimeSnapshot),
        ("pool_fields", KVCachePoolSnapshot),
    ):
        names, ours = getattr(caps, key), record.__struct_fields__
        for i, (got, want) in enumerate(zip(names, ours)):
            if got != want:
                return f"{key}[{i}] is {got!r}, schema major {SCHEMA_MAJOR} has {want!r} there"
        if len(set(names)) != len(names):
            twice = next(n for i, n in enumerate(names) if n in names[:i])
            return f"{key} lists {twice!r} twice"
    if list(caps.snapshot_fields[:2]) != ["runtime", "pools"]:
        return "snapshot_fields must start with 'runtime', 'pools'"
    return None
