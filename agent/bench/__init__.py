"""Agent-side benchmarks (they need torch): run through ``kvsidecar bench ...``.

Kept apart from the agent proper so that ``agent/`` holds only what runs inside an engine.
"""
