"""Test-only (never shipped, never on the agent's path): reads vLLM's own set of cached
block hashes inside the engine, for tests/engines/test_vllm_kv_events.py.

The test puts this directory first on the real vLLM server's PYTHONPATH with
``KVSIDECAR_TEST_POOL_DUMP=<file>``; every Python process of the server then imports it at
start (the site module's ``sitecustomize``) and installs a SIGUSR2 handler. The test sends
SIGUSR2 to the engine core at a settled point (no request running); the handler runs in
the engine core's main thread (the only one that changes the pool, blocked on its input
queue while idle) and writes, atomically, the keys of vLLM's
``BlockPool.cached_block_hash_to_block`` (every BlockPool in the process, found by the
garbage collector, its frozen heap included: nothing in vLLM or kvsidecar is wrapped), each
as [hash in vLLM's int form (the low 64 bits, as its KV events carry it), KV-cache group].

``KVSIDECAR_TEST_KV_RING=<power of two>`` shrinks the agent's KV-event ring (the layout's
default, read when the recorder is built), so that a stopped daemon falls behind it
within a short workload.
"""

import os
import signal

_PATH = os.environ.get("KVSIDECAR_TEST_POOL_DUMP")
_MASK64 = (1 << 64) - 1


def _dump(_signum, _frame) -> None:
    import gc
    import json
    import sys

    module = sys.modules.get("vllm.v1.core.block_pool")
    # vLLM freezes its start-up heap (gc.freeze): frozen objects are not listed until
    # unfrozen; they are frozen again afterwards (with what was made since: harmless here).
    frozen = gc.get_freeze_count()
    if frozen:
        gc.unfreeze()
    objects = gc.get_objects() if module is not None else []
    if frozen:
        gc.freeze()
    pools = [o for o in objects if isinstance(o, module.BlockPool)]
    del objects
    entries = sorted(
        [int.from_bytes(key[:-4], "big") & _MASK64, int.from_bytes(key[-4:], "big")]
        for pool in pools
        for key in pool.cached_block_hash_to_block._cache
    )
    tmp = f"{_PATH}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "pools": len(pools), "entries": entries}, f)
    os.replace(tmp, _PATH)


if _PATH:
    signal.signal(signal.SIGUSR2, _dump)

if os.environ.get("KVSIDECAR_TEST_KV_RING"):
    from kvsidecar.protocol import kv_events_layout, kv_events_writer

    _ring = int(os.environ["KVSIDECAR_TEST_KV_RING"])
    kv_events_layout.DEFAULT_RING_CAP = _ring  # the slots (slots_needed)
    kv_events_writer.KVEventsWriter.__init__.__kwdefaults__["ring_cap"] = _ring  # the ring
