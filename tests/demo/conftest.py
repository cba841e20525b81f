"""Engines killed here leave shared memory behind: each module removes it
(tests/support/shm_leftovers.py)."""

from tests.support.shm_leftovers import engine_shm_leftovers

__all__ = ["engine_shm_leftovers"]
