"""Streams the daemon publishes to subscribers (routers), one module per wire.

`kv_events_wire`: vLLM's KV-event wire (msgspec structs, frames, the DP port rule);
`kv_events_zmq`: the ZMQ PUB + ROUTER replay publisher fed from the KV-event segments
(docs/kv-events.md). Imported only when `serve --kv-events.endpoint` is given: pyzmq is
the optional extra ``kvsidecar[kvevents]``.
"""
