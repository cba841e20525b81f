"""`KVSidecarAgent`: the in-engine publisher. One per engine rank.

The engine calls ``agent.step(...)`` once per engine step. That call:

* updates a handful of runtime fields in a live `RuntimeSnapshot` (no new objects),
* takes each registered pool's record (`PoolSource.snapshot()`, O(1) for
  `KVBlockPool`, whose counters are kept at mutation time),
* samples device memory at most every 100 ms,
* publishes through the segment writer (msgspec ``encode_into`` a preallocated
  buffer + one C call: no lock, no system call).

Nothing here ever raises into the engine: a failure to create the segment
disables the agent with one log line naming the cause and the fix; a failed
publish is counted (``publish_errors_total``) and logged once per cause.

Configuration: constructor arguments win; otherwise ``KVSIDECAR_*`` environment
variables (``KVSIDECAR_ENGINE``, ``_MODEL_NAME``, ``_ROLE``, ``_DP_RANK``,
``_DP_SIZE``, ``_TP_RANK``, ``_TP_SIZE``, ``_PP_RANK``, ``_PP_SIZE``,
``_SHM_DIR``, ``_SEGMENT``, ``_GROUP``, ``_DISABLE=1``); otherwise defaults.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping

from kvsidecar.agent.adapters import PoolSource
from kvsidecar.agent.pool import DeviceMemorySampler, default_device
from kvsidecar.protocol.names import DEFAULT_SHM_DIR, default_segment_name
from kvsidecar.protocol.schema import ROLES, RuntimeSnapshot, Snapshot
from kvsidecar.protocol.writer import SegmentWriter

log = logging.getLogger("kvsidecar.agent")


def _setting(value, env: Mapping[str, str], key: str, default, cast=str):
    if value is not None:
        return value
    raw = env.get(f"KVSIDECAR_{key}")
    if raw is None or raw == "":
        return default
    try:
        return cast(raw)
    except ValueError:
        log.warning("kvsidecar: ignoring KVSIDECAR_%s=%r (not a %s)", key, raw, cast.__name__)
        return default


class KVSidecarAgent:
    """Publishes a runtime record and every registered pool each engine step."""

    def __init__(
        self,
        engine: str | None = None,
        model_name: str | None = None,
        *,
        role: str | None = None,
        engine_version: str | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        pp_rank: int | None = None,
        pp_size: int | None = None,
        device: str | None = None,
        shm_dir: str | None = None,
        segment_name: str | None = None,
        group: str | int | None = None,
        enabled: bool | None = None,
        heartbeat_interval: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if env is None else env
        engine = _setting(engine, env, "ENGINE", "unknown")
        role = _setting(role, env, "ROLE", "both")
        if role not in ROLES:
            log.warning("kvsidecar: role %r is not one of %s; using 'both'", role, ROLES)
            role = "both"
        self.runtime = RuntimeSnapshot(
            engine=engine,
            engine_version=_setting(engine_version, env, "ENGINE_VERSION", ""),
            model_name=_setting(model_name, env, "MODEL_NAME", ""),
            role=role,
            pid=os.getpid(),
            start_time=time.time(),
            device=str(device or default_device()),
            dp_rank=_setting(dp_rank, env, "DP_RANK", 0, int),
            dp_size=_setting(dp_size, env, "DP_SIZE", 1, int),
            tp_rank=_setting(tp_rank, env, "TP_RANK", 0, int),
            tp_size=_setting(tp_size, env, "TP_SIZE", 1, int),
            pp_rank=_setting(pp_rank, env, "PP_RANK", 0, int),
            pp_size=_setting(pp_size, env, "PP_SIZE", 1, int),
        )
        r = self.runtime
        self.shm_dir = _setting(shm_dir, env, "SHM_DIR", DEFAULT_SHM_DIR)
        self.segment_name = _setting(
            segment_name,
            env,
            "SEGMENT",
            default_segment_name(
                engine, r.dp_rank, r.tp_rank, r.pp_rank, tag=role if role != "both" else ""
            ),
        )
        disabled = env.get("KVSIDECAR_DISABLE", "") not in ("", "0", "false")
        self.enabled = (not disabled) if enabled is None else enabled
        self.error: str | None = None
        self._sources: list[PoolSource] = []
        self._snapshot = Snapshot(runtime=r, pools=[])
        self._memory = DeviceMemorySampler(r.device)
        self._logged: set[str] = set()
        self._writer: SegmentWriter | None = None
        self._last_step_ns = time.perf_counter_ns()
        if self.enabled:
            self._open(_setting(group, env, "GROUP", None))
        self._heartbeat_stop = threading.Event()
        if heartbeat_interval and self._writer is not None:
            self._start_heartbeat(heartbeat_interval)
        ref = weakref.ref(self)
        atexit.register(lambda: (a := ref()) is not None and a.close())

    # -- setup ------------------------------------------------------------------

    def _open(self, group: str | int | None) -> None:
        try:
            self._writer = SegmentWriter(self.segment_name, shm_dir=self.shm_dir, group=group)
        except Exception as e:  # never into the engine: disable and say why, once
            self.enabled = False
            self.error = str(e)
            log.warning("kvsidecar agent disabled, the engine continues without it: %s", e)

    def register_pool(self, source: PoolSource) -> None:
        """Publish this pool every step (our KVBlockPool, or an adapter over an engine's)."""
        self._sources.append(source)
        self._snapshot.pools.append(source.snapshot())

    @property
    def segment_path(self) -> str | None:
        return self._writer.path if self._writer is not None else None

    # -- hot path ---------------------------------------------------------------

    def step(
        self,
        requests_running: int = 0,
        requests_waiting: int = 0,
        requests_deferred_free: int | None = None,
    ) -> None:
        """Publish one snapshot. Costs about a microsecond; never raises."""
        writer = self._writer
        if writer is None:
            return
        t0 = time.perf_counter_ns()
        try:
            r = self.runtime
            pools = self._snapshot.pools
            deferred = 0
            for i, source in enumerate(self._sources):
                rec = source.snapshot()
                pools[i] = rec
                n = rec.deferred_free_requests
                if n is not None and n > deferred:
                    deferred = n
            r.step += 1
            r.requests_running = requests_running
            r.requests_waiting = requests_waiting
            # One request defers in every pool it uses: the max over pools, not the sum.
            r.requests_deferred_free = (
                deferred if requests_deferred_free is None else requests_deferred_free
            )
            r.device_total_bytes, r.device_free_bytes = self._memory.sample()
            r.initialized = True
            writer.publish(self._snapshot)
        except OSError as e:
            # The segment itself is broken (truncated under us): stop touching it.
            self.runtime.publish_errors_total += 1
            self.enabled, self.error = False, str(e)
            self._writer = None
            log.warning("kvsidecar agent disabled, the engine continues without it: %s", e)
        except Exception as e:
            self.runtime.publish_errors_total += 1
            self._log_once(type(e).__name__, f"kvsidecar publish failed (engine unaffected): {e}")
        self._last_step_ns = t0  # for the idle heartbeat: no extra clock read per step
        self.runtime.last_publish_duration_ns = time.perf_counter_ns() - t0

    def heartbeat(self) -> None:
        """Keep the segment fresh while the engine idles (call from its idle wait)."""
        if self._writer is not None:
            try:
                self._writer.heartbeat()
            except Exception as e:
                self._log_once("heartbeat", f"kvsidecar heartbeat failed: {e}")

    def _start_heartbeat(self, interval: float) -> None:
        # Only refreshes when no step happened for `interval`: an idle engine stays fresh.
        # Note it also keeps a *hung* engine fresh; leave it off to detect hangs by age.
        def run() -> None:
            while not self._heartbeat_stop.wait(interval):
                if time.perf_counter_ns() - self._last_step_ns >= interval * 1e9:
                    self.heartbeat()

        threading.Thread(target=run, name="kvsidecar-heartbeat", daemon=True).start()

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(message)

    # -- teardown ---------------------------------------------------------------

    def close(self) -> None:
        """Mark the segment closed and unlink it. Idempotent."""
        self._heartbeat_stop.set()
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception as e:
                self._log_once("close", f"kvsidecar close failed: {e}")

    def __enter__(self) -> KVSidecarAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
