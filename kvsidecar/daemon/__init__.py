"""The daemon: discovers segments, polls them, serves /metrics, JSON and health."""
