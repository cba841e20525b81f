"""The kvcached pool fields our adapter publishes unchanged: one list for the check against
kvcached's real builder (`check_real.py`, run in the kvcached env) and the dict test in
ours (`tests/engines/test_kvcached_dict.py`). Plain data: importable from both sides."""

# kvcached fields whose value we publish unchanged under the same name (negative counts
# clamped at 0, as kvcached clamps its block gauges).
EQUAL = (
    "pool_type",
    "integration",
    "pool_name",
    "group_id",
    "num_layers",
    "num_kv_buffers",
    "page_size_bytes",
    "block_size_bytes",
    "available_blocks",
    "reserved_blocks",
    "available_bytes",
    "reserved_bytes",
    "null_block_reserved",
    "virtual_per_layer_bytes",
    "virtual_total_bytes",
    "mapped_bytes",
    "total_pages",
    "free_pages",
    "inuse_pages",
    "reserved_pages",
    "available_physical_pages",
    "effective_free_pages",
    "in_shrink",
)
