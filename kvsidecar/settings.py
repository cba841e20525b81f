"""Every ``KVSIDECAR_*`` environment variable, defined once (like vLLM's ``envs.py``).

The agent, the engine plugins, the daemon's and CLI's click options (``envvar=``) and the
benchmarks take names and defaults from here; docs/operations.md's table is generated from
it (``python -m kvsidecar.settings``). Import-light: the standard library and the
protocol's name defaults only, so any process (an engine's plugin loader, ``--help``) can
import it cheaply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvsidecar.protocol.names import DEFAULT_PREFIX, DEFAULT_SHM_DIR

ENV_PREFIX = "KVSIDECAR_"

AGENT, DAEMON, CLI, BENCH = "agent", "serve", "dump/ls", "bench"

# Our own default port. 9400 (what we had) is dcgm-exporter's, which every GPU node runs;
# the Prometheus wiki's exporter block 9100-9999 is exhausted and newer exporters have
# moved above it (e.g. 39100). See docs/operations.md "Port".
DEFAULT_PORT = 19440
DEFAULT_LISTEN = f":{DEFAULT_PORT}"


@dataclass(frozen=True)
class Setting:
    """One variable: its name, value type, default (None: none) and meaning."""

    name: str
    type: str
    default: Any
    meaning: str
    used_by: tuple[str, ...]
    flag: str = ""  # the command-line twin, if any

    def get(self, env: Mapping[str, str]) -> str | None:
        """The raw value in ``env``; None when unset or empty."""
        raw = env.get(self.name)
        return None if raw is None or raw == "" else raw

    def enabled(self, env: Mapping[str, str]) -> bool:
        """A flag variable's value: set and not ``0``/``false``."""
        return env.get(self.name, "") not in ("", "0", "false")


ALL: list[Setting] = []


def _s(key: str, type: str, default: Any, meaning: str, *used_by: str, flag: str = "") -> Setting:
    s = Setting(ENV_PREFIX + key, type, default, meaning, used_by, flag)
    ALL.append(s)
    return s


# -- shared by the agent (writer) and every reader ------------------------------------------
SHM_DIR = _s(
    "SHM_DIR",
    "path",
    DEFAULT_SHM_DIR,
    "directory holding the segments (a tmpfs); must match on both sides",
    AGENT,
    DAEMON,
    CLI,
    flag="--shm-dir",
)
SEGMENT = _s(
    "SEGMENT",
    "str",
    None,
    "agent: this rank's segment name (default `kvsidecar.<engine>[.<role>].dp<d>.tp<t>.pp<p>`); "
    "serve: follow only these names (space-separated; default all)",
    AGENT,
    DAEMON,
    flag="--segment",
)

# -- the agent (inside the engine) -----------------------------------------------------------
DISABLE = _s(
    "DISABLE",
    "bool",
    False,
    "`1`: no agent, no segment; engine plugins leave the engine untouched",
    AGENT,
)
ATOM = _s(
    "ATOM",
    "bool",
    False,
    "`1`: the start-up hook puts the agent into ATOM's engine core (docs/atom.md)",
    AGENT,
)
ENGINE = _s("ENGINE", "str", "unknown", "engine label (`vllm`, `sglang`, ...)", AGENT)
ENGINE_VERSION = _s("ENGINE_VERSION", "str", "", "engine version label", AGENT)
MODEL_NAME = _s("MODEL_NAME", "str", "", "model label", AGENT)
ROLE = _s("ROLE", "str", "both", "`prefill`, `decode` or `both`", AGENT)
DP_RANK = _s("DP_RANK", "int", 0, "data-parallel rank", AGENT)
DP_SIZE = _s("DP_SIZE", "int", 1, "data-parallel size", AGENT)
TP_RANK = _s("TP_RANK", "int", 0, "tensor-parallel rank", AGENT)
TP_SIZE = _s("TP_SIZE", "int", 1, "tensor-parallel size", AGENT)
PP_RANK = _s("PP_RANK", "int", 0, "pipeline-parallel rank", AGENT)
PP_SIZE = _s("PP_SIZE", "int", 1, "pipeline-parallel size", AGENT)
INSTANCE = _s(
    "INSTANCE",
    "str",
    None,
    "the id a daemon sums DP ranks within, label `engine_instance` (default: the host name, "
    "the Pod's under Kubernetes: stable across engine restarts); set it per engine when two "
    "with the same engine, model and role share a directory",
    AGENT,
)
GROUP = _s(
    "GROUP",
    "str",
    None,
    "group (name or gid) given to the segments and the default directory",
    AGENT,
)
KV_EVENTS = _s(
    "KV_EVENTS",
    "bool",
    False,
    "`1`: the agent also records the prefix cache's changes in a KV-event segment "
    "(`kvevents.<...>`, beside the snapshot) that `serve --kv-events.endpoint` publishes as "
    "vLLM's KV events (docs/kv-events.md)",
    AGENT,
)

# -- the daemon (`kvsidecar serve`) and the readers (`dump`, `ls`, `selfcheck`) -----------
PREFIX = _s("PREFIX", "str", DEFAULT_PREFIX, "discovery prefix", DAEMON, CLI, flag="--prefix")
POLL_INTERVAL = _s(
    "POLL_INTERVAL", "float", 0.25, "seconds between polls", DAEMON, flag="--poll-interval"
)
STALE_AFTER = _s(
    "STALE_AFTER",
    "float",
    5.0,
    "heartbeat age (s) that marks a source down",
    DAEMON,
    CLI,
    flag="--stale-after",
)
REDISCOVER_INTERVAL = _s(
    "REDISCOVER_INTERVAL",
    "float",
    1.0,
    "seconds between directory scans for new segments",
    DAEMON,
    flag="--rediscover-interval",
)
WEB_LISTEN_ADDRESS = _s(
    "WEB_LISTEN_ADDRESS",
    "list",
    DEFAULT_LISTEN,
    "addresses to listen on (space-separated)",
    DAEMON,
    flag="--web.listen-address",
)
WEB_CONFIG_FILE = _s(
    "WEB_CONFIG_FILE",
    "path",
    None,
    "TLS / basic auth (exporter-toolkit format)",
    DAEMON,
    flag="--web.config.file",
)
WEB_TELEMETRY_PATH = _s(
    "WEB_TELEMETRY_PATH",
    "str",
    "/metrics",
    "path of the metrics endpoint",
    DAEMON,
    flag="--web.telemetry-path",
)
WEB_MAX_REQUESTS = _s(
    "WEB_MAX_REQUESTS",
    "int",
    40,
    "concurrent HTTP requests; more wait their turn (fair per client address) up to 5 s, "
    "then 503 (0 = no limit)",
    DAEMON,
    flag="--web.max-requests",
)
WEB_CONNECTION_MEMORY_BYTES = _s(
    "WEB_CONNECTION_MEMORY_BYTES",
    "int",
    12 * 1024 * 1024,
    "what open connections may cost together (each counted at 64 KiB with TLS, 48 KiB "
    "without): caps them at 192 TLS / 256 plain by default; raise it with the memory limit",
    DAEMON,
    flag="--web.connection-memory-bytes",
)
GATEWAY_LISTEN_ADDRESS = _s(
    "GATEWAY_LISTEN_ADDRESS",
    "str",
    None,
    "the gateway endpoint (docs/gateway.md): an endpoint picker's model-server protocol, "
    "one listener per DP rank from this port up, not for Prometheus (off when unset)",
    DAEMON,
    flag="--gateway.listen-address",
)
GATEWAY_RANKS = _s(
    "GATEWAY_RANKS",
    "int",
    1,
    "gateway listeners: DP rank r is served on the gateway port + r",
    DAEMON,
    flag="--gateway.ranks",
)
GATEWAY_ROLE = _s(
    "GATEWAY_ROLE",
    "str",
    None,
    "serve only segments of this role (prefill, decode, both) on the gateway; several, "
    "comma-separated (prefill,decode): role i's dp_rank r on the gateway port + i * ranks + r",
    DAEMON,
    flag="--gateway.role",
)
GATEWAY_MAX_CONNECTIONS = _s(
    "GATEWAY_MAX_CONNECTIONS",
    "int",
    256,
    "open gateway connections, all listeners together; at the cap the one idle longest makes room",
    DAEMON,
    flag="--gateway.max-connections",
)
GATEWAY_WEB_CONFIG_FILE = _s(
    "GATEWAY_WEB_CONFIG_FILE",
    "path",
    None,
    "TLS and client certificates on the gateway listeners: a web config file (exporter-toolkit "
    "format) with only tls_server_config, reloaded as --web.config.file is",
    DAEMON,
    flag="--gateway.web-config-file",
)
GATEWAY_STALE_AFTER = _s(
    "GATEWAY_STALE_AFTER",
    "float",
    1.5,
    "seconds a rank may show no progress (on the daemon's clock) and still be served; "
    "longer: 503 though --stale-after has not passed. Below a picker's 2 s staleness "
    "threshold, above the agent's 1 s idle heartbeat",
    DAEMON,
    flag="--gateway.stale-after",
)
# -- KV events (kvsidecar/streams/, docs/kv-events.md; needs the kvsidecar[kvevents] extra) ----
KV_EVENTS_ENDPOINT = _s(
    "KV_EVENTS_ENDPOINT",
    "str",
    None,
    "publish the engines' KV events on vLLM's ZMQ wire: a PUB per DP rank r on this endpoint's "
    "port + r, as vLLM's `endpoint` (e.g. `tcp://*:5557`; off when unset)",
    DAEMON,
    flag="--kv-events.endpoint",
)
KV_EVENTS_REPLAY_ENDPOINT = _s(
    "KV_EVENTS_REPLAY_ENDPOINT",
    "str",
    None,
    "vLLM's replay ROUTER per DP rank on this endpoint's port + r (e.g. `tcp://*:5558`); a "
    "request older than the buffer gets the full state",
    DAEMON,
    flag="--kv-events.replay-endpoint",
)
KV_EVENTS_TOPIC = _s(
    "KV_EVENTS_TOPIC",
    "str",
    "",
    "the topic frame of every KV-event message (llm-d: `kv@<pod>@<model>`)",
    DAEMON,
    flag="--kv-events.topic",
)
KV_EVENTS_BUFFER_STEPS = _s(
    "KV_EVENTS_BUFFER_STEPS",
    "int",
    10_000,
    "batches kept per DP rank for replay",
    DAEMON,
    flag="--kv-events.buffer-steps",
)
KV_EVENTS_MEMORY_BYTES = _s(
    "KV_EVENTS_MEMORY_BYTES",
    "int",
    13 * 1024 * 1024,
    "what the KV-event publishers may take of the daemon's memory, all segments together "
    "(each 6 MiB + 20 bytes a slot + 60 a cached block; a segment over what is left is not "
    "published): one engine's of up to 75,366 blocks by default; raise it with the memory "
    "limit",
    DAEMON,
    flag="--kv-events.memory-bytes",
)
KV_EVENTS_MAX_CONNECTIONS = _s(
    "KV_EVENTS_MAX_CONNECTIONS",
    "int",
    16,
    "connections each KV-event socket admits (each rank's PUB, each rank's replay ROUTER); "
    "past it, as many are held 3 s then retried, the rest closed (a libzmq client does not "
    "retry those)",
    DAEMON,
    flag="--kv-events.max-connections",
)
KV_EVENTS_POLL_INTERVAL = _s(
    "KV_EVENTS_POLL_INTERVAL",
    "float",
    0.01,
    "seconds between reads of a KV-event segment (one batch per read)",
    DAEMON,
    flag="--kv-events.poll-interval",
)
# -- the load push (kvsidecar/streams/load_push.py, docs/load-push.md; kvsidecar[kvevents]) ----
LOAD_PUSH_ENDPOINT = _s(
    "LOAD_PUSH_ENDPOINT",
    "str",
    None,
    "publish every engine's load as SGLang's `LoadStat` ZMQ stream (`--load-publish-endpoint`'s "
    "wire): a PUB per DP rank r on this endpoint's port + r (e.g. `tcp://*:5560`; off when unset)",
    DAEMON,
    flag="--load-push.endpoint",
)
LOAD_PUSH_ROLE = _s(
    "LOAD_PUSH_ROLE",
    "str",
    None,
    "push only segments of this role (prefill, decode, both)",
    DAEMON,
    flag="--load-push.role",
)
LOAD_PUSH_POLL_INTERVAL = _s(
    "LOAD_PUSH_POLL_INTERVAL",
    "float",
    0.005,
    "seconds between reads of each rank's segment; a LoadStat whose values changed goes out "
    "at the read that sees it, an unchanged one once a second",
    DAEMON,
    flag="--load-push.poll-interval",
)
LOAD_PUSH_MAX_CONNECTIONS = _s(
    "LOAD_PUSH_MAX_CONNECTIONS",
    "int",
    16,
    "connections each load-push PUB (one a rank) admits; past it, as many are held 3 s then "
    "retried, the rest closed (a libzmq client does not retry those)",
    DAEMON,
    flag="--load-push.max-connections",
)
# -- OTLP push (kvsidecar/otlp/, docs/otlp.md; needs the kvsidecar[otlp] extra) ----------------
OTLP_ENDPOINT = _s(
    "OTLP_ENDPOINT",
    "str",
    None,
    "push the metrics to this OTLP/HTTP endpoint, used as is, e.g. "
    "https://collector:4318/v1/metrics (off when unset, unless an OTEL_EXPORTER_OTLP_*ENDPOINT "
    "variable is set: docs/otlp.md; needs kvsidecar[otlp])",
    DAEMON,
    flag="--otlp.endpoint",
)
OTLP_INTERVAL = _s(
    "OTLP_INTERVAL", "float", 15.0, "seconds between pushes", DAEMON, flag="--otlp.interval"
)
OTLP_TEMPORALITY = _s(
    "OTLP_TEMPORALITY",
    "str",
    "cumulative",
    "counters as cumulative or delta sums",
    DAEMON,
    flag="--otlp.temporality",
)
OTLP_HEADERS_FILE = _s(
    "OTLP_HEADERS_FILE",
    "str",
    None,
    "file of `name: value` lines sent with each push (an auth token: never on the command line)",
    DAEMON,
    flag="--otlp.headers-file",
)
OTLP_CA_FILE = _s(
    "OTLP_CA_FILE", "str", None, "CA bundle to verify the endpoint", DAEMON, flag="--otlp.ca-file"
)
OTLP_CERT_FILE = _s(
    "OTLP_CERT_FILE", "str", None, "client certificate (TLS)", DAEMON, flag="--otlp.cert-file"
)
OTLP_KEY_FILE = _s(
    "OTLP_KEY_FILE", "str", None, "client certificate's key (TLS)", DAEMON, flag="--otlp.key-file"
)
ALLOW_UID = _s(
    "ALLOW_UID",
    "list",
    None,
    "also trust segments owned by these UIDs (space-separated; default own UID only): **set it to "
    "the engine's UID**",
    DAEMON,
    CLI,
    flag="--allow-uid",
)
ALLOW_ANY_UID = _s(
    "ALLOW_ANY_UID",
    "bool",
    False,
    "trust segments of any owner (not on shared hosts)",
    DAEMON,
    CLI,
    flag="--allow-any-uid",
)
READY_REQUIRES_SOURCE = _s(
    "READY_REQUIRES_SOURCE",
    "bool",
    False,
    "`/-/ready` answers 503 until a segment is up",
    DAEMON,
    flag="--ready-requires-source",
)
HOLD_ON_ERROR = _s(
    "HOLD_ON_ERROR",
    "bool",
    False,
    "on a start-up error, log it and stay up until SIGTERM instead of exiting "
    "(a Kubernetes sidecar that exits holds the engine back), retrying the start with "
    "back-off (1 s to 60 s; at once on SIGHUP)",
    DAEMON,
    flag="--hold-on-error",
)
WEB_SYSTEMD_SOCKET = _s(
    "WEB_SYSTEMD_SOCKET",
    "bool",
    False,
    "serve the listening sockets systemd passes (socket activation: `LISTEN_FDS`, "
    "`LISTEN_PID`) instead of binding `--web.listen-address`",
    DAEMON,
    flag="--web.systemd-socket",
)
ALLOW_ROOT = _s(
    "ALLOW_ROOT",
    "bool",
    False,
    "root is intended: no start-up warning when the daemon runs as root (it needs only "
    "read access to the segments)",
    DAEMON,
    flag="--allow-root",
)
WEB_DISABLE_EXPORTER_METRICS = _s(
    "WEB_DISABLE_EXPORTER_METRICS",
    "bool",
    False,
    "leave out `process_*`, `python_*` and `kvsidecar_http_*` (metrics about the daemon itself)",
    DAEMON,
    flag="--web.disable-exporter-metrics",
)
MAX_TARGETS = _s(
    "MAX_TARGETS",
    "int",
    256,
    "segments followed at once; further files are refused "
    '(`kvsidecar_segment_refusals_total{reason="max_targets"}`)',
    DAEMON,
    flag="--max-targets",
)
MAX_POOLS_PER_RANK = _s(
    "MAX_POOLS_PER_RANK",
    "int",
    64,
    "per-target budget: more pools and the target is refused (checked before decoding)",
    DAEMON,
    flag="--max-pools-per-rank",
)
MAX_LABEL_LENGTH = _s(
    "MAX_LABEL_LENGTH",
    "int",
    256,
    "per-target budget: longest label value (engine, model_name, role, pool_name, info labels), in"
    " UTF-8 bytes",
    DAEMON,
    flag="--max-label-length",
)
MAX_SERIES_PER_TARGET = _s(
    "MAX_SERIES_PER_TARGET",
    "int",
    4096,
    "per-target budget: most series one segment may export",
    DAEMON,
    flag="--max-series-per-target",
)
MAX_EXPOSITION_BYTES = _s(
    "MAX_EXPOSITION_BYTES",
    "int",
    3 * 1024 * 1024,
    "daemon-wide budget: estimated exposition size (UTF-8 bytes) of all targets together; "
    "above it targets are shed, those served longest kept first (one alone over it too)",
    DAEMON,
    flag="--max-exposition-bytes",
)
MAX_PAYLOAD_BYTES = _s(
    "MAX_PAYLOAD_BYTES",
    "int",
    1024 * 1024,
    "per-target budget: largest slot read (the agent's default slot is 16 KiB)",
    DAEMON,
    flag="--max-payload-bytes",
)
# Admission of new segment names (kvsidecar/daemon/admission.py: the defaults' reasons).
MAX_NEW_TARGETS = _s(
    "MAX_NEW_TARGETS",
    "int",
    64,
    "new segment names (new `segment` label values) exported at once; more wait for "
    '`--new-target-interval` (`kvsidecar_segment_refusals_total{reason="admission"}`)',
    DAEMON,
    flag="--max-new-targets",
)
NEW_TARGET_INTERVAL = _s(
    "NEW_TARGET_INTERVAL",
    "float",
    3.0,
    "seconds per further new segment name once `--max-new-targets` are spent; "
    "a name exported before (a restarted engine) costs none",
    DAEMON,
    flag="--new-target-interval",
)
LOG_LEVEL = _s(
    "LOG_LEVEL",
    "str",
    "info",
    "`debug`, `info`, `warn` (or `warning`), `error`",
    DAEMON,
    flag="--log.level",
)
LOG_FORMAT = _s(
    "LOG_FORMAT",
    "str",
    "logfmt",
    "`logfmt` or `json`, one line per message on stderr",
    DAEMON,
    flag="--log.format",
)

# -- benchmarks ------------------------------------------------------------------------------
VLLM_PYTHON = _s(
    "VLLM_PYTHON", "path", None, "`kvsidecar bench vllm`: the Python of the vLLM environment", BENCH
)
BENCH_CHECKOUT = _s(
    "BENCH_CHECKOUT",
    "path",
    None,
    "every bench's daemon from this source tree (an older commit's worktree, its extension "
    "built in place), for side-by-side tables",
    BENCH,
)
SGLANG_PYTHON = _s(
    "SGLANG_PYTHON",
    "path",
    None,
    "`kvsidecar bench cost --sglang` and the SGLang tests: the Python of the SGLang environment",
    BENCH,
)

BY_NAME: dict[str, Setting] = {s.name: s for s in ALL}


def without_ours(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less every ``KVSIDECAR_*`` variable."""
    return {k: v for k, v in env.items() if not k.startswith(ENV_PREFIX)}


def _default(s: Setting) -> str:
    if s.default is None:
        return "none"
    if s.type == "bool":
        return "off"
    return f"`{s.default}`"


def markdown() -> str:
    """docs/operations.md's table of variables (between the generated-section markers)."""
    lines = [
        "| flag | variable | type | default | used by | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for s in ALL:
        flag = f"`{s.flag}`" if s.flag else ""
        used = ", ".join(s.used_by)
        lines.append(f"| {flag} | `{s.name}` | {s.type} | {_default(s)} | {used} | {s.meaning} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    print(markdown(), end="")
