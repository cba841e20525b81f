"""Run in the SGLang environment: decode KV-event payloads with SGLang's OWN msgspec classes
(``sglang.srt.disaggregation.kv_events.KVEventBatch``, what a consumer of SGLang's publisher
uses). stdin: a JSON list of hex payloads; stdout (last line): JSON {"batches": [[rank,
[[type, fields], ...]], ...]}."""

import json
import sys

import msgspec
from sglang.srt.disaggregation.kv_events import KVEventBatch

dec = msgspec.msgpack.Decoder(KVEventBatch)
out = []
for h in json.load(sys.stdin):
    batch = dec.decode(bytes.fromhex(h))
    out.append(
        [
            batch.attn_dp_rank,
            [[type(e).__name__, msgspec.to_builtins(e)] for e in batch.events],
        ]
    )
print(json.dumps({"batches": out}))
