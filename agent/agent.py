"""`KVSidecarAgent`: the in-engine publisher. One per engine rank.

The engine calls ``agent.step(...)`` once per engine step. That call:

* updates a handful of runtime fields in a live `RuntimeSnapshot` (no new objects),
* takes each registered pool's record (`PoolSource.snapshot()`, O(1) for
  `KVBlockPool`, whose counters are kept at mutation time),
* samples device memory at most every 100 ms,
* publishes through the segment writer (msgspec ``encode_into`` a preallocated
  buffer + one C call: no lock, no system call).

Nothing here ever raises into the engine, whatever it is given: bad constructor
values fall back to defaults with a warning (or, if nothing works, disable the agent
with one log line naming the cause); `register_pool` refuses what is not a pool
(returns False, logs once); ``step()`` accepts the usual numeric scalars (int,
bool, numpy and torch integers and floats, clamped to 0..2^63-1). A failure to
create the segment disables the agent with one log line naming the cause and the
fix; a failed publish is counted (``publish_errors_total`` in the payload, and
in the segment *header* with its reason, so a daemon sees a failing publisher
even when no snapshot ever got through) and logged once per cause.

Pools are published under distinct ``(pool_name, group_id)``: a second pool
registered under a name already taken is published as ``<name>_2`` (then
``_3``, ...) in registration order, with one warning, so no two pools of a
rank ever give the same series.

Configuration: constructor arguments win; otherwise ``KVSIDECAR_*`` environment
variables (``KVSIDECAR_ENGINE``, ``_MODEL_NAME``, ``_ROLE``, ``_DP_RANK``,
``_DP_SIZE``, ``_TP_RANK``, ``_TP_SIZE``, ``_PP_RANK``, ``_PP_SIZE``,
``_SHM_DIR``, ``_SEGMENT``, ``_GROUP``, ``_INSTANCE``, ``_DISABLE=1``); otherwise
defaults. ``instance`` (the id a daemon sums DP ranks within) defaults to the
host name (the Pod's under Kubernetes), the same across engine restarts; set it
when two engines with the same engine, model and role publish to one directory
(e.g. ``KVSIDECAR_INSTANCE=engine-a``).
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import operator
import os
import socket
import stat
import time
import weakref
from collections.abc import Mapping

from kvsidecar import settings
from kvsidecar.agent import faults
from kvsidecar.agent.adapters import PoolSource
from kvsidecar.agent.heartbeat import IdleHeartbeat
from kvsidecar.agent.kv_events import KVEventsRecorder
from kvsidecar.agent.pool import DeferredRequests, DeviceMemorySampler, default_device
from kvsidecar.protocol import layout
from kvsidecar.protocol.names import DEFAULT_SHM_DIR, default_segment_name
from kvsidecar.protocol.schema import (
    MAX_LABEL_LENGTH,
    ROLES,
    KVCachePoolSnapshot,
    RuntimeSnapshot,
    Snapshot,
)
from kvsidecar.protocol.writer import SegmentWriter

log = logging.getLogger(__name__)


# An argument with no environment twin (read from an empty mapping).
_HEARTBEAT_ARG = settings.Setting("HEARTBEAT_INTERVAL", "float", None, "argument only", ())
# On by default (0 turns it off): an idle rank is up, and its deferral age stays served
# while a P/D transfer is stuck. Liveness is the writer lock, not the age; a hung engine
# shows as a step counter that stops (segment-format.md section 6).
DEFAULT_HEARTBEAT_INTERVAL = 1.0

_MAX_COUNT = 2**63 - 1  # the largest count a reader accepts (a signed 64-bit integer)


def _count(value: object) -> int:
    """A count from any usual numeric scalar, clamped to 0..2^63-1.

    int, bool, numpy/torch integers (``operator.index``) and floats (``float()``, NaN
    refused). Raises TypeError/ValueError for anything else (a string is not a count).
    """
    if isinstance(value, (str, bytes)):
        raise TypeError(f"not a number: {value!r}")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        f = float(value)  # type: ignore[arg-type]
        if f != f:
            raise ValueError("NaN is not a count") from None
        n = _MAX_COUNT if f >= _MAX_COUNT else int(f) if f > 0 else 0
    return 0 if n < 0 else _MAX_COUNT if n > _MAX_COUNT else n


# The daemon's default --max-label-length: a longer string would get the whole target
# refused there (tests/agent/test_agent_partial.py checks the two agree).
LABEL_MAX = MAX_LABEL_LENGTH  # a default daemon's --max-label-length
_MARK = "\u2026"  # the marker of a shortened string: "…"


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def shorten(text: str, limit: int = LABEL_MAX) -> str:
    """``text`` if it fits in ``limit`` UTF-8 bytes (what the daemon counts), else its head
    and tail around a marker and a hash of the whole (an honest 300-character model path
    stays recognisable and distinct)."""
    raw = _utf8(text)
    if len(raw) <= limit:
        return text
    digest = hashlib.sha256(raw).hexdigest()[:8]
    middle = f"{_MARK}{digest}{_MARK}"
    room = limit - len(_utf8(middle))
    head = room * 2 // 5  # paths tell most at their end
    tail = room - head
    # Cut on bytes; "ignore" drops a character split by the cut (never over the limit).
    head_text = raw[:head].decode("utf-8", "ignore")
    tail_text = raw[len(raw) - tail :].decode("utf-8", "ignore")
    return f"{head_text}{middle}{tail_text}"


def _text(value: object) -> str:
    raw = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    return shorten(raw)  # type: ignore[arg-type]


def _label(value: object) -> str:
    """A label value within a default daemon's budget (segment-format.md section 8):
    shortened with a marker, never refused."""
    return _text(value)


def _default_instance() -> str:
    """The host name: the Pod's name under Kubernetes, the machine's elsewhere. Stable
    across restarts of the engine, so its `kvsidecar_dp_*{engine_instance}` series continue
    rather than new ones being minted at each restart (issue 33 item 6: the former default,
    PID namespace + process group, changed every time). Every rank one daemon sees on a
    host is then one instance per engine/model/role, whoever launched it; two look-alike
    engines there are told apart by KVSIDECAR_INSTANCE (until then a dp_rank claimed twice
    gives no DP sum, never a wrong one)."""
    return socket.gethostname()


def _setting(value, env: Mapping[str, str], setting: settings.Setting, default=None, cast=_text):
    """The argument if given, else the variable of ``setting`` in ``env``, else ``default``
    (the table's own default when None)."""
    default = setting.default if default is None else default
    if value is not None:
        try:
            return cast(value)
        except (TypeError, ValueError, OverflowError):
            arg = setting.name.removeprefix(settings.ENV_PREFIX).lower()
            log.warning("kvsidecar: ignoring %s=%r (not a %s)", arg, value, cast.__name__)
            return default
    raw = setting.get(env)
    if raw is None:
        return default
    try:
        return cast(raw)
    except (TypeError, ValueError, OverflowError):
        log.warning("kvsidecar: ignoring %s=%r (not a %s)", setting.name, raw, cast.__name__)
        return default


def _int_env(raw: object) -> int:
    # Environment values are strings: int("3"); arguments go through _count.
    return _count(int(raw)) if isinstance(raw, str) else _count(raw)


def _warn_if_open(directory: str) -> None:
    """One warning, at segment creation, when ``directory`` is writable by every user
    without the sticky bit: `kvsidecar serve` refuses to read such a directory (anyone
    could delete or replace the live segment), so the engine would go unmonitored with
    nothing said on its side. Never raises."""
    try:
        mode = stat.S_IMODE(os.stat(directory).st_mode)
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            fix = f"chmod 0750 {directory}"
            if os.path.abspath(directory) == DEFAULT_SHM_DIR:
                fix += " (or remove it: the agent creates it 0750)"
            log.warning(
                "kvsidecar: segment directory %s is writable by every user (mode %04o, not "
                "sticky): kvsidecar serve refuses to read it, so this engine is not "
                "monitored; %s",
                directory, mode, fix,
            )  # fmt: skip
    except Exception as e:  # a warning must never cost the engine anything
        log.debug("kvsidecar: could not check %s: %r", directory, e)


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
        instance: str | None = None,
        env: Mapping[str, str] | None = None,
        kv_events: bool | None = None,
    ) -> None:
        # A safe, disabled agent first: whatever fails below, every method still works.
        self.enabled = False
        self.error: str | None = None
        self._writer: SegmentWriter | None = None
        self._faulted_writer: SegmentWriter | None = None  # held after fault(), for close()
        self._sources: list[PoolSource] = []
        self._renamed: list[tuple[int, str, str]] = []  # (pool index, alias, own name)
        self._untracked: list[int] = []  # pools that report counts but not request ids
        self._tracked: list[bool] = []  # source reports its deferred ids to _deferred
        self._deferred = DeferredRequests()
        self._deferred_ids = self._deferred.ids  # read by len() every step
        self._logged: set[str] = set()
        self._partial = -1  # this step left something out: its PUBLISH_ERR_* code
        self._heartbeat: IdleHeartbeat | None = None
        self._memory: DeviceMemorySampler | None = None
        self.runtime = RuntimeSnapshot(pid=os.getpid(), start_time=time.time())
        self._snapshot = Snapshot(runtime=self.runtime, pools=[])
        self.shm_dir = DEFAULT_SHM_DIR
        self.segment_name = ""
        # KV events (agent/kv_events.py): None = KVSIDECAR_KV_EVENTS decides.
        self.kv_events: KVEventsRecorder | None = None
        self._kv_events_wanted = kv_events
        self._group: str | int | None = None
        try:
            self._configure(
                engine, model_name, role, engine_version, dp_rank, dp_size, tp_rank, tp_size,
                pp_rank, pp_size, device, shm_dir, segment_name, group, enabled,
                heartbeat_interval, instance, env,
            )  # fmt: skip
        except Exception as e:  # never into the engine
            self.close()
            self._disable(f"bad configuration ({type(e).__name__}: {e})")
        ref = weakref.ref(self)
        atexit.register(lambda: (a := ref()) is not None and a.close())

    def _configure(
        self, engine, model_name, role, engine_version, dp_rank, dp_size, tp_rank, tp_size,
        pp_rank, pp_size, device, shm_dir, segment_name, group, enabled, heartbeat_interval,
        instance, env,
    ) -> None:  # fmt: skip
        env = os.environ if env is None else env
        engine = _setting(engine, env, settings.ENGINE)
        role = _setting(role, env, settings.ROLE)
        if role not in ROLES:
            log.warning("kvsidecar: role %r is not one of %s; using 'both'", role, ROLES)
            role = "both"
        r = self.runtime
        r.engine = _label(engine)
        r.engine_version = _label(_setting(engine_version, env, settings.ENGINE_VERSION))
        r.model_name = _label(_setting(model_name, env, settings.MODEL_NAME))
        r.role = role
        r.dp_rank = _setting(dp_rank, env, settings.DP_RANK, cast=_int_env)
        r.dp_size = _setting(dp_size, env, settings.DP_SIZE, cast=_int_env)
        r.tp_rank = _setting(tp_rank, env, settings.TP_RANK, cast=_int_env)
        r.tp_size = _setting(tp_size, env, settings.TP_SIZE, cast=_int_env)
        r.pp_rank = _setting(pp_rank, env, settings.PP_RANK, cast=_int_env)
        r.pp_size = _setting(pp_size, env, settings.PP_SIZE, cast=_int_env)
        r.instance = _setting(instance, env, settings.INSTANCE) or _default_instance()
        try:
            r.device = _label(device or default_device())
            self._memory = DeviceMemorySampler(r.device)
        except Exception as e:  # an unknown device: publish without device memory
            log.warning("kvsidecar: device %r not usable (%s); no device memory", device, e)
            r.device = _label(device)
        self.shm_dir = _setting(shm_dir, env, settings.SHM_DIR)
        self.segment_name = _setting(
            segment_name,
            env,
            settings.SEGMENT,
            default_segment_name(
                engine, r.dp_rank, r.tp_rank, r.pp_rank, tag=role if role != "both" else ""
            ),
        )
        disabled = settings.DISABLE.enabled(env)
        self.enabled = (not disabled) if enabled is None else bool(enabled)
        if self._kv_events_wanted is None:
            self._kv_events_wanted = settings.KV_EVENTS.enabled(env)
        self._group = _setting(group, env, settings.GROUP, cast=lambda g: g)
        if self.enabled:
            self._open(self._group)
        interval = _setting(
            heartbeat_interval, {}, _HEARTBEAT_ARG, DEFAULT_HEARTBEAT_INTERVAL, cast=float
        )
        if interval and interval > 0 and self._writer is not None:
            self._heartbeat = IdleHeartbeat(self._writer, interval)

    # -- setup ------------------------------------------------------------------

    def _disable(self, why: str) -> None:
        self.enabled, self.error = False, why
        log.warning("kvsidecar agent disabled, the engine continues without it: %s", why)

    def _open(self, group: str | int | None) -> None:
        try:
            self._writer = SegmentWriter(self.segment_name, shm_dir=self.shm_dir, group=group)
        except Exception as e:  # never into the engine: disable and say why, once
            self._disable(str(e))
            return
        faults.track(self)
        _warn_if_open(self.shm_dir)

    def register_pool(self, source: PoolSource) -> bool:
        """Publish this pool every step (our KVBlockPool, or an adapter over an engine's).

        Returns False, with one warning, for what is not a pool (no ``snapshot()``
        returning a `KVCachePoolSnapshot`) or a source already registered. A pool whose
        ``(pool_name, group_id)`` is taken is published as ``<pool_name>_<k>`` (k = 2, 3,
        ... in registration order). Never raises.
        """
        try:
            if any(s is source for s in self._sources):
                log.warning("kvsidecar: pool %r is already registered; ignoring it", source)
                return False
            record = source.snapshot()
            if not isinstance(record, KVCachePoolSnapshot):
                raise TypeError(f"snapshot() returned {type(record).__name__}")
            alias = self._free_name(record)
            published = alias or record.pool_name
            if not isinstance(published, str) or len(_utf8(published)) > MAX_LABEL_LENGTH:
                raise ValueError(
                    f"pool_name {str(published)[:40]!r}... is over {MAX_LABEL_LENGTH} "
                    "UTF-8 bytes (a default daemon's label budget): give it a shorter name"
                )
            track = getattr(source, "track_deferred", None)
            tracked = callable(track)
            if tracked:
                track(self._deferred)
        except Exception as e:
            log.warning(
                "kvsidecar: refusing to publish %r (%s: %s)",
                source,
                type(e).__name__,
                e,
            )
            return False
        index = len(self._sources)
        if alias is not None:
            # Applied to the record only while it is published (step), then given back:
            # the record belongs to the source, which must not keep the agent's alias.
            self._renamed.append((index, alias, record.pool_name))
        if not tracked:
            self._untracked.append(index)
        self._sources.append(source)
        self._tracked.append(tracked)
        self._snapshot.pools.append(record)
        self._maybe_kv_events(source)
        return True

    def _maybe_kv_events(self, source: PoolSource) -> None:
        """Record this pool's prefix cache as KV events (KVSIDECAR_KV_EVENTS=1 or
        ``kv_events=True``): one KV-event segment per agent, sized from the pool's blocks."""
        attach = getattr(source, "attach_kv_events", None)
        if not (self.enabled and self._kv_events_wanted and callable(attach)):
            return
        if self.kv_events is not None:
            self._log_once("kv_events_pools", "kvsidecar: KV events record the first pool only")
            return
        try:
            n_slots, block_size = int(source.kv_event_slots), int(source.block_size)  # type: ignore[attr-defined]
        except Exception as e:
            self._log_once("kv_events_size", f"kvsidecar: no KV events for {source!r}: {e}")
            return
        recorder = KVEventsRecorder.open(
            self.segment_name,
            n_slots=n_slots,
            block_size=block_size,
            dp_rank=self.runtime.dp_rank or 0,
            shm_dir=self.shm_dir,
            group=self._group,
        )
        if recorder is not None:
            attach(recorder)
            self.kv_events = recorder

    def _free_name(self, record: KVCachePoolSnapshot) -> str | None:
        """None if the record's (pool_name, group_id) is free, else the first free alias."""
        aliases = {i: alias for i, alias, _ in self._renamed}
        taken = {
            (aliases.get(i, p.pool_name), p.group_id) for i, p in enumerate(self._snapshot.pools)
        }
        name, group = shorten(record.pool_name), record.group_id
        if (name, group) not in taken:
            return None if name == record.pool_name else name
        k = 2
        while (f"{name}_{k}", group) in taken:
            k += 1
        alias = f"{name}_{k}"
        log.warning(
            "kvsidecar: a pool named %r (group %s) is already registered; publishing this "
            "one as %r (give each pool a distinct pool_name or group_id)",
            name,
            group,
            alias,
        )
        return alias

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
        """Publish one snapshot. Costs about a microsecond; never raises.

        ``requests_deferred_free``: the engine's own count of distinct deferred requests,
        if it has one; otherwise it is taken from the pools (exact when they report their
        request ids, like `KVBlockPool`, or when a single pool reports deferral).
        """
        writer = self._writer
        if writer is None:
            return
        t0 = time.perf_counter_ns()
        code = layout.PUBLISH_ERR_POOL_SOURCE  # which stage failed, for the header
        try:
            r = self.runtime
            pools = self._snapshot.pools
            most = -1  # the largest per-pool deferred count; -1: no pool reports one
            failed = None  # indices of pools whose snapshot() failed this step
            self._partial = -1  # what was left out of this step (a PUBLISH_ERR_* code)
            i = 0
            for source in self._sources:
                try:
                    rec = source.snapshot()
                    pools[i] = rec
                    n = rec.deferred_free_requests
                    if n is not None and n > most:
                        most = n
                except Exception as e:  # that pool is left out of this step, not all
                    failed = [*(failed or ()), i]
                    self._partial = layout.PUBLISH_ERR_POOL_SOURCE
                    why = f"{type(e).__name__}: {e}"
                    self._log_once(
                        f"pool{i}:{type(e).__name__}",
                        f"kvsidecar: pool {i} left out (engine unaffected): {why}",
                    )
                i += 1
            if self._renamed:
                for i, alias, _ in self._renamed:
                    pools[i].pool_name = alias
            code = layout.PUBLISH_ERR_ARGUMENT
            # The usual case (a plain int in range) costs two comparisons. A bad value
            # (NaN, a string) keeps that field's previous value: the rest is published.
            if type(requests_running) is not int or not 0 <= requests_running <= _MAX_COUNT:
                requests_running = self._count_or(requests_running, r.requests_running)
            if type(requests_waiting) is not int or not 0 <= requests_waiting <= _MAX_COUNT:
                requests_waiting = self._count_or(requests_waiting, r.requests_waiting)
            if requests_deferred_free is not None:
                distinct = requests_deferred_free
                if type(distinct) is not int or not 0 <= distinct <= _MAX_COUNT:
                    distinct = self._count_or(distinct, None)  # None: unknown this step
            elif most < 0:
                distinct = None  # no pool supports deferral: unsupported, not 0
            elif self._untracked:
                distinct = self._distinct_without_ids(pools)
            else:
                # Every pool reports its ids: one request deferred in several counts once.
                distinct = len(self._deferred_ids)
            code = layout.PUBLISH_ERR_OTHER
            r.step += 1
            r.requests_running = requests_running
            r.requests_waiting = requests_waiting
            r.requests_deferred_free_distinct = distinct
            # v1.0 meaning for older readers: 0 when unknown, the max over pools at least.
            r.requests_deferred_free = (most if most > 0 else 0) if distinct is None else distinct
            memory = self._memory
            if memory is not None:
                r.device_total_bytes, r.device_free_bytes = memory.sample()
            r.initialized = True
            code = -1  # from here on the writer records its own failures in the header
            if self._partial >= 0:  # published, but not whole: counted with its reason
                r.publish_errors_total += 1
                writer.record_error(self._partial)
            if failed is None:
                writer.publish(self._snapshot)
            else:  # rare: a list without the failed pools (the others still published)
                kept = [p for k, p in enumerate(pools) if k not in failed]
                writer.publish(Snapshot(runtime=r, pools=kept))
        except Exception as e:
            self.runtime.publish_errors_total += 1
            if code < 0 and isinstance(e, OSError):
                # The segment itself is broken (truncated under us): stop touching it.
                self._writer = None
                if self._heartbeat is not None:
                    self._heartbeat.stop(join=False)  # nor may the heartbeat touch it
                self._disable(str(e))
            else:
                if code >= 0:
                    writer.record_error(code)
                self._log_once(
                    f"{code}:{type(e).__name__}",
                    f"kvsidecar publish failed (engine unaffected): {type(e).__name__}: {e}",
                )
        if self._renamed:
            pools = self._snapshot.pools
            for i, _, name in self._renamed:  # the sources' own names back (register_pool)
                pools[i].pool_name = name
        if (beat := self._heartbeat) is not None:
            beat.last_step_ns = t0  # the idle heartbeat's clock: no extra clock read per step
        self.runtime.last_publish_duration_ns = time.perf_counter_ns() - t0

    def _count_or(self, value: object, fallback: int | None) -> int | None:
        try:
            return _count(value)
        except (TypeError, ValueError, OverflowError) as e:
            self._partial = layout.PUBLISH_ERR_ARGUMENT
            self._log_once(f"arg:{type(e).__name__}", f"kvsidecar: step() value {value!r} "
                           f"dropped (engine unaffected): {e}")  # fmt: skip
            return fallback

    def _distinct_without_ids(self, pools: list[KVCachePoolSnapshot]) -> int | None:
        """Distinct deferred requests when some pools give counts but no ids (adapters):
        exact only if that is a single pool and no pool with ids defers anything."""
        # Only sources that defer something now matter: a pool deferring nothing (0) adds
        # no request, whether or not it reports ids.
        counts = [
            n for i in self._untracked if (n := pools[i].deferred_free_requests) is not None and n
        ]
        if not counts:
            return len(self._deferred_ids)
        if len(counts) == 1 and not self._deferred_ids:
            return counts[0]
        return None

    def heartbeat(self) -> None:
        """Keep the segment fresh while the engine idles (call from its idle wait)."""
        if self._writer is not None:
            try:
                self._writer.heartbeat()
            except Exception as e:
                self._log_once("heartbeat", f"kvsidecar heartbeat failed: {e}")

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(message)

    # -- teardown ---------------------------------------------------------------

    def fault(self, reason: str) -> bool:
        """The engine hit a fatal error: mark the segment FAULTED, so readers read it dead at
        once and no later `close()` or supervisor calls it closed cleanly; publish no more.
        For the engine's own fatal-error path (`kvsidecar.agent.faults`). Whether it was
        marked now; never raises."""
        writer = self._writer
        if writer is None:
            return False
        try:
            if self._heartbeat is not None:
                self._heartbeat.stop(join=False)  # from an error path: wait for nothing
            writer.mark_faulted()
            self._writer, self._faulted_writer = None, writer  # close() still releases it
            log.warning(
                "kvsidecar: segment %s marked FAULTED (the engine reported a fatal error: %s)",
                self.segment_name,
                shorten(reason, 300),
            )
            return True
        except Exception as e:
            self._log_once("fault", f"kvsidecar could not mark its segment faulted: {e}")
            return False

    def close(self) -> None:
        """Mark the segment closed and unlink it (a faulted one is only released: it stays
        FAULTED). Idempotent; never raises."""
        if self._heartbeat is not None:
            self._heartbeat.stop()  # joined: no agent thread outlives close()
        for source, tracked in zip(self._sources, self._tracked):
            if tracked:
                try:
                    source.untrack_deferred(self._deferred)  # type: ignore[attr-defined]
                except Exception:
                    pass
        self._tracked = [False] * len(self._sources)
        events, self.kv_events = self.kv_events, None
        if events is not None:
            events.close()
        writer = self._writer or self._faulted_writer
        self._writer = self._faulted_writer = None
        if writer is not None:
            try:
                writer.close()
            except Exception as e:
                self._log_once("close", f"kvsidecar close failed: {e}")

    def __enter__(self) -> KVSidecarAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
