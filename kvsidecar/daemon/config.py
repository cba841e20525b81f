"""The daemon's options as a few frozen records, built once from the command line and the
settings table (`kvsidecar serve`, `dump`, `ls`) and passed whole, as vLLM's `VllmConfig`
gathers `CacheConfig`, `ParallelConfig`, ... and exporter-toolkit's `FlagConfig` goes
whole to `ListenAndServe`. `Budget` (daemon/budget.py), what one target may cost, is the
model.

Light on purpose (dataclasses only): the CLI builds these while `--help` stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvsidecar.daemon.refusals import MAX_REFUSED, RECHECK_PER_SCAN, SUMMARY_INTERVAL
from kvsidecar.settings import (
    GATEWAY_STALE_AFTER,
    KV_EVENTS_MAX_CONNECTIONS,
    KV_EVENTS_MEMORY_BYTES,
    LOAD_PUSH_MAX_CONNECTIONS,
)

if TYPE_CHECKING:
    from kvsidecar.daemon.budget import Budget

DEFAULT_MAX_TARGETS = 256


@dataclass(frozen=True)
class Discovery:
    """Where segments are found and which files become targets (daemon/scan.py)."""

    shm_dir: str
    prefix: str = ""
    names: tuple[str, ...] = ()  # followed whatever the prefix, kept when their file is gone
    pattern: str | None = None  # a glob instead of the prefix (dump, ls)
    allowed_uids: frozenset[int] | None = None  # None: any owner
    max_targets: int = DEFAULT_MAX_TARGETS
    rediscover_interval: float = 1.0  # seconds between scans of the directory
    # A new target with no good reading stays hidden this long, so a file that vanishes
    # within a scan interval never mints a series.
    confirm_after: float = 0.0


@dataclass(frozen=True)
class Polling:
    """How often targets are read, and when a writer that shows no progress is stale."""

    poll_interval: float = 0.25
    stale_after: float = 5.0
    # A first sight of a writer believes its own heartbeat age in full (dump, ls: a
    # one-shot look, where an engine hung for an hour must read an hour), rather than
    # just past stale_after (serve: the writer's clock may be another time namespace's).
    true_first_age: bool = False


@dataclass(frozen=True)
class Tuning:
    """Knobs with no flag: tests set them, and dump/ls turn the summary line off (inf)."""

    summary_interval: float = SUMMARY_INTERVAL  # seconds between refusal-summary lines
    recheck_per_scan: int = RECHECK_PER_SCAN  # refused files re-lstat'ed per unchanged scan
    max_refused: int = MAX_REFUSED  # refused files remembered


@dataclass(frozen=True)
class WebOptions:
    """The metrics endpoint's listeners and what they serve (`--web.*`)."""

    listen_addresses: tuple[str, ...] = ()  # env twins already split on spaces
    systemd_socket: bool = False
    config_file: str | None = None
    telemetry_path: str = "/metrics"
    max_requests: int = 0
    connection_memory: int = 0
    exporter_metrics: bool = True  # not --web.disable-exporter-metrics
    ready_requires_source: bool = False


@dataclass(frozen=True)
class GatewayOptions:
    """The endpoint picker's listeners (`--gateway.*`; docs/gateway.md)."""

    address: tuple[str, int]
    ranks: int = 1
    # Roles served, each on listeners of its own (port + i * ranks + dp_rank for role i);
    # empty: one set of listeners serving any role.
    roles: tuple[str, ...] = ()
    max_connections: int = 256
    # Seconds without progress after which a rank is answered 503 (docs/gateway.md).
    stale_after: float = GATEWAY_STALE_AFTER.default
    # TLS on the gateway listeners: a web config file holding only tls_server_config
    # (kvsidecar/web/poll_tls.py); None: plain HTTP.
    web_config_file: str | None = None


@dataclass(frozen=True)
class KVEventsOptions:
    """The KV-event publishers (`--kv-events.*`; docs/kv-events.md, kvsidecar/streams/).
    Endpoints as vLLM's KVEventsConfig spells them; DP rank r uses the port + r."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    poll_interval: float = 0.01
    hwm: int = 100_000
    # What the publishers may take of the daemon's memory, all segments together
    # (kvsidecar/streams/kv_events_budget.py).
    memory_bytes: int = KV_EVENTS_MEMORY_BYTES.default
    # Connections each PUB and each ROUTER admits (streams/zmq_admission.py).
    max_connections: int = KV_EVENTS_MAX_CONNECTIONS.default


@dataclass(frozen=True)
class LoadPushOptions:
    """The load push (`--load-push.*`; docs/load-push.md, kvsidecar/streams/load_push.py):
    SGLang's LoadStat wire, DP rank r on the endpoint's port + r."""

    endpoint: str
    role: str | None = None
    poll_interval: float = 0.005
    heartbeat: float = 1.0  # an unchanged LoadStat is re-sent this often (SGLang: 1 s)
    hwm: int = 8  # SGLang's LOAD_PUB_HWM: a gauge, the next one supersedes a shed one
    stale_after: float = GATEWAY_STALE_AFTER.default  # no progress this long: nothing sent
    max_connections: int = LOAD_PUSH_MAX_CONNECTIONS.default  # each rank's PUB


@dataclass(frozen=True)
class ServeConfig:
    """Everything `kvsidecar serve` was told, in records (daemon/run.py wires them)."""

    discovery: Discovery
    polling: Polling
    budget: Budget
    web: WebOptions
    gateway: GatewayOptions | None  # None: off
    max_new_targets: int  # daemon/admission.py: burst
    new_target_interval: float  # and the seconds per further new name
    otlp: dict[str, Any] = field(default_factory=dict)  # --otlp.* (kvsidecar/otlp/options.py)
    kv_events: KVEventsOptions | None = None  # None: off
    load_push: LoadPushOptions | None = None  # None: off
    hold_on_error: bool = False
    allow_root: bool = False
