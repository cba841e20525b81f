"""Engines killed here leave shared memory behind: each module removes it
(tests/shm_leftovers.py)."""

from tests.shm_leftovers import engine_shm_leftovers

__all__ = ["engine_shm_leftovers"]
