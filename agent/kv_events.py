"""KV events out of the engine: the agent's recorder of prefix-cache changes.

A pool (our `KVBlockPool`, an engine hook) calls `stored` / `removed` / `cleared` where
its prefix cache changes; each call writes the KV-event segment
(`kvsidecar.protocol.kv_events_writer`: one C call, no system call, no lock, no
allocation that grows, never waiting on a reader). The daemon publishes vLLM's ZMQ wire
from that segment (`kvsidecar serve --kv-events.endpoint`, docs/kv-events.md).

Never raises into the engine: a failed record (a block id past the size given at start,
a bad argument) logs once and closes the segment, so the daemon tells every consumer to
drop this rank's blocks (AllBlocksCleared) instead of leaving a wrong index behind.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvsidecar.protocol.kv_events_layout import events_name
from kvsidecar.protocol.kv_events_writer import KVEventsWriter

log = logging.getLogger("kvsidecar.agent")


class KVEventsRecorder:
    """The engine-facing side of one KV-event segment."""

    def __init__(self, writer: KVEventsWriter) -> None:
        self._w: KVEventsWriter | None = writer
        self.path = writer.path
        self.error: str | None = None

    @classmethod
    def open(
        cls,
        segment_name: str,
        *,
        n_slots: int,
        block_size: int,
        dp_rank: int = 0,
        shm_dir: str,
        group: str | int | None = None,
    ) -> KVEventsRecorder | None:
        """The recorder for a rank's snapshot segment name, or None (logged) if the file
        cannot be made."""
        try:
            writer = KVEventsWriter(
                events_name(segment_name),
                n_slots=n_slots,
                block_size=block_size,
                dp_rank=dp_rank,
                shm_dir=shm_dir,
                group=group,
            )
        except Exception as e:
            log.warning("kvsidecar: no KV events, the engine continues without them: %s", e)
            return None
        return cls(writer)

    @property
    def active(self) -> bool:
        return self._w is not None

    def stored(
        self,
        slot: int,
        block_hash: int,
        parent_hash: int | None,
        token_ids: Sequence[int],
        **fields: Any,
    ) -> None:
        """Block ``slot`` now caches ``block_hash``; ``fields``: `KVEventsWriter.stored`'s
        (first, group_idx, medium, lora_id, lora_name, spec)."""
        w = self._w  # the hot path: the writer's method called directly
        if w is not None:
            try:
                w.stored(slot, block_hash, parent_hash, token_ids, **fields)
            except Exception as e:
                self._fail("stored", e)

    def removed(self, slot: int, block_hash: int, *, group_idx: int = 0) -> None:
        w = self._w
        if w is not None:
            try:
                w.removed(slot, block_hash, group_idx=group_idx)
            except Exception as e:
                self._fail("removed", e)

    def cleared(self) -> None:
        self._call("cleared")

    def _call(self, what: str, *args: Any, **kwargs: Any) -> None:
        w = self._w
        if w is not None:
            try:
                getattr(w, what)(*args, **kwargs)
            except Exception as e:
                self._fail(what, e)

    def _fail(self, what: str, e: Exception) -> None:
        self.error = f"{what}: {type(e).__name__}: {e}"
        log.warning(
            "kvsidecar: KV events stopped (%s); the segment is closed, so consumers drop "
            "this rank's blocks",
            self.error,
        )
        self.close()

    def close(self) -> None:
        """Mark the segment closed and unlink it. Idempotent; never raises."""
        w, self._w = self._w, None
        if w is not None:
            try:
                w.close()
            except Exception as e:
                log.warning("kvsidecar: closing the KV-event segment failed: %s", e)
