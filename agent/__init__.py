"""The in-engine agent: torch KV block allocator and per-step publisher (imports torch)."""
