"""kvsidecar: KV-cache observability out of the engine process.

``kvsidecar.protocol`` is the contract (segment layout, seqlock, schema);
``kvsidecar.daemon`` serves it; ``kvsidecar.agent`` (the repository's
``agent/`` folder, the only place torch is imported) writes it.
"""

__version__ = "0.1.0"
