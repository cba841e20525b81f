"""Run in a vLLM environment: decode kvsidecar's KV-event payloads with vLLM's OWN msgspec
classes, re-encode each with vLLM's encoder settings, and report.

stdin: a JSON list of hex payloads. stdout (last line): JSON {"batches": [[dp_rank,
[[type, fields...], ...]], ...], "same_bytes": bool per payload, "same_value": the same
after a generic msgpack decode}. (vLLM 0.33's BlockStored has 15 fields, so msgspec
writes its map header as map16 even when most are omitted: other bytes, the same value.)
"""

import json
import sys

import msgspec
from vllm.distributed.kv_events import KVEventBatch

payloads = [bytes.fromhex(h) for h in json.load(sys.stdin)]
dec = msgspec.msgpack.Decoder(KVEventBatch)  # what a vLLM consumer uses
enc = msgspec.msgpack.Encoder()  # what ZmqEventPublisher uses
out, same, same_value = [], [], []
for p in payloads:
    batch = dec.decode(p)
    again = enc.encode(batch)
    same.append(again == p)
    same_value.append(msgspec.msgpack.decode(again) == msgspec.msgpack.decode(p))
    out.append(
        [
            batch.data_parallel_rank,
            [[type(e).__name__, msgspec.to_builtins(e)] for e in batch.events],
        ]
    )
print(json.dumps({"batches": out, "same_bytes": same, "same_value": same_value}))
