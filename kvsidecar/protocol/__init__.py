"""The contract between agent and daemon: schema, segment layout, seqlock."""
