"""``kvsidecar serve``: flags in exporter-toolkit style, each with a KVSIDECAR_* twin."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from kvsidecar import settings
from kvsidecar.cli.options import (
    allowed_uids,
    prefix_option,
    printable,
    shm_dir_option,
    trust_options,
)
from kvsidecar.logsetup import log_options
from kvsidecar.otlp.options import otlp_options
from kvsidecar.protocol.names import InvalidName, validate_name
from kvsidecar.settings import DEFAULT_LISTEN

if TYPE_CHECKING:
    from kvsidecar.daemon.config import ServeConfig

# schema.ROLES, written out: importing the schema would load msgspec for --help
# (tests/daemon/test_gateway.py checks they are equal).
GATEWAY_ROLES = ("prefill", "decode", "both")


def _segment_names(
    _ctx: click.Context, _param: click.Parameter, value: tuple[str, ...]
) -> tuple[str, ...]:
    # Env twin: space-separated. Checked here so a bad name stops the start, rather than
    # being followed forever as a segment that can never exist.
    names = tuple(n for item in value for n in item.split())
    for n in names:
        try:
            validate_name(n)
        except InvalidName as e:
            raise click.BadParameter(printable(e)) from None
    return names


def _gateway_address(value: str | None) -> tuple[str, int] | None:
    """A bad address is a usage error naming the option, not "cannot listen"."""
    if value is None or value == "":
        return None
    from kvsidecar.web.listen_address import parse_listen_address

    try:
        return parse_listen_address(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _gateway_roles(value: str | None) -> tuple[str, ...]:
    """`prefill,decode` -> ("prefill", "decode"); a role twice or unknown is a usage error."""
    if not value:
        return ()
    roles = tuple(r.strip() for r in value.split(","))
    for r in roles:
        if r not in GATEWAY_ROLES:
            raise click.BadParameter(f"{r!r} is not one of {', '.join(GATEWAY_ROLES)}")
    if len(set(roles)) != len(roles):
        raise click.BadParameter(f"{value!r} names a role twice")
    return roles


def _telemetry_path(value: str) -> str:
    """A bad path is a usage error naming the option, not "cannot listen"."""
    from kvsidecar.daemon.endpoints import telemetry_path_problem

    problem = telemetry_path_problem(value)
    if problem is not None:
        raise click.BadParameter(f"{value!r}: {problem}")
    return value


@click.command()
@shm_dir_option
@prefix_option
@click.option(
    "--segment",
    "segments",
    multiple=True,
    envvar=settings.SEGMENT.name,
    callback=_segment_names,
    help="Follow this segment name (repeatable); default: every PREFIX* segment.",
)
@click.option(
    "--poll-interval",
    type=click.FloatRange(0.01, 60),
    default=settings.POLL_INTERVAL.default,
    show_default=True,
    envvar=settings.POLL_INTERVAL.name,
    help="Seconds between polls.",
)
@click.option(
    "--stale-after",
    type=click.FloatRange(0.05, 3600),
    default=settings.STALE_AFTER.default,
    show_default=True,
    envvar=settings.STALE_AFTER.name,
    help="A live writer whose heartbeat is older than this is stale (up 0).",
)
@click.option(
    "--rediscover-interval",
    type=click.FloatRange(0.05, 3600),
    default=settings.REDISCOVER_INTERVAL.default,
    show_default=True,
    envvar=settings.REDISCOVER_INTERVAL.name,
    help="Seconds between scans of the shm directory.",
)
@click.option(
    "--web.listen-address",
    "listen_addresses",
    multiple=True,
    envvar=settings.WEB_LISTEN_ADDRESS.name,
    default=[settings.WEB_LISTEN_ADDRESS.default],
    show_default=True,
    help=f"Address to listen on (repeatable), e.g. {DEFAULT_LISTEN}, "
    f"127.0.0.1{DEFAULT_LISTEN}, [::1]{DEFAULT_LISTEN}.",
)
@click.option(
    "--web.systemd-socket",
    "systemd_socket",
    is_flag=True,
    envvar=settings.WEB_SYSTEMD_SOCKET.name,
    help=(
        "Serve the listening sockets systemd passes (socket activation) instead of binding "
        "--web.listen-address."
    ),
)
@click.option(
    "--web.config.file",
    "web_config_file",
    envvar=settings.WEB_CONFIG_FILE.name,
    type=click.Path(dir_okay=False),
    default=settings.WEB_CONFIG_FILE.default,
    help="exporter-toolkit web config (TLS, basic auth).",
)
@click.option(
    "--web.telemetry-path",
    "telemetry_path",
    envvar=settings.WEB_TELEMETRY_PATH.name,
    default=settings.WEB_TELEMETRY_PATH.default,
    show_default=True,
    callback=lambda ctx, param, value: _telemetry_path(value),
    help="Path of the metrics endpoint.",
)
@click.option(
    "--web.max-requests",
    "max_requests",
    type=click.IntRange(0),
    default=settings.WEB_MAX_REQUESTS.default,
    show_default=True,
    envvar=settings.WEB_MAX_REQUESTS.name,
    help=(
        "Concurrent requests; more wait their turn (fair per client address) up to 5 s, "
        "then 503 (0 = no limit)."
    ),
)
@click.option(
    "--web.connection-memory-bytes",
    "connection_memory",
    type=click.IntRange(256 * 1024),
    default=settings.WEB_CONNECTION_MEMORY_BYTES.default,
    show_default=True,
    envvar=settings.WEB_CONNECTION_MEMORY_BYTES.name,
    help=(
        "What open connections may cost together, each counted at 64 KiB with TLS, 48 KiB "
        "without (the default allows 192 TLS / 256 plain); idle ones are closed first at the cap."
    ),
)
@click.option(
    "--gateway.listen-address",
    "gateway_address",
    envvar=settings.GATEWAY_LISTEN_ADDRESS.name,
    default=settings.GATEWAY_LISTEN_ADDRESS.default,
    callback=lambda ctx, param, value: _gateway_address(value),
    help=(
        "Serve an endpoint picker's model-server protocol (vllm:*/sglang:*/atom:* names, "
        "read fresh per poll) on this address, DP rank r on its port + r; never scrape it "
        "with Prometheus (docs/gateway.md). Off when unset."
    ),
)
@click.option(
    "--gateway.ranks",
    "gateway_ranks",
    type=click.IntRange(1, 256),
    default=settings.GATEWAY_RANKS.default,
    show_default=True,
    envvar=settings.GATEWAY_RANKS.name,
    help="Gateway listeners, one per DP rank (ports from --gateway.listen-address up).",
)
@click.option(
    "--gateway.role",
    "gateway_roles",
    default=settings.GATEWAY_ROLE.default,
    envvar=settings.GATEWAY_ROLE.name,
    callback=lambda ctx, param, value: _gateway_roles(value),
    help=(
        "Serve only segments of this role on the gateway (default: any); several, "
        "comma-separated (prefill,decode), give each role its own listeners: role i's "
        "dp_rank r on the port + i * --gateway.ranks + r."
    ),
)
@click.option(
    "--gateway.max-connections",
    "gateway_max_connections",
    type=click.IntRange(4),
    default=settings.GATEWAY_MAX_CONNECTIONS.default,
    show_default=True,
    envvar=settings.GATEWAY_MAX_CONNECTIONS.name,
    help="Open gateway connections, all listeners together; the idlest makes room at the cap.",
)
@click.option(
    "--gateway.web-config-file",
    "gateway_web_config_file",
    type=click.Path(dir_okay=False),
    default=settings.GATEWAY_WEB_CONFIG_FILE.default,
    envvar=settings.GATEWAY_WEB_CONFIG_FILE.name,
    help=(
        "Serve the gateway over TLS (client certificates optional): a web config file with "
        "only tls_server_config, re-read on change and on SIGHUP (docs/gateway.md)."
    ),
)
@click.option(
    "--gateway.stale-after",
    "gateway_stale_after",
    type=click.FloatRange(0.05, 3600),
    default=settings.GATEWAY_STALE_AFTER.default,
    show_default=True,
    envvar=settings.GATEWAY_STALE_AFTER.name,
    help=(
        "A rank with no progress for this long (the daemon's clock) is answered 503 on the "
        "gateway, before --stale-after marks it stale; keep it below the picker's staleness "
        "threshold (2 s) and above the agent's idle heartbeat (1 s)."
    ),
)
@click.option(
    "--kv-events.endpoint",
    "kv_events_endpoint",
    envvar=settings.KV_EVENTS_ENDPOINT.name,
    default=settings.KV_EVENTS_ENDPOINT.default,
    help=(
        "Publish the engines' KV events (KVSIDECAR_KV_EVENTS=1 in the agent) on vLLM's ZMQ "
        "wire, a PUB per DP rank r on this endpoint's port + r, e.g. tcp://*:5557 "
        "(docs/kv-events.md; needs kvsidecar[kvevents]). Off when unset."
    ),
)
@click.option(
    "--kv-events.replay-endpoint",
    "kv_events_replay_endpoint",
    envvar=settings.KV_EVENTS_REPLAY_ENDPOINT.name,
    default=settings.KV_EVENTS_REPLAY_ENDPOINT.default,
    help="vLLM's replay ROUTER per DP rank (port + r); older than the buffer: the full state.",
)
@click.option(
    "--kv-events.topic",
    "kv_events_topic",
    envvar=settings.KV_EVENTS_TOPIC.name,
    default=settings.KV_EVENTS_TOPIC.default,
    help="Topic frame of every message (llm-d: kv@<pod>@<model>).",
)
@click.option(
    "--kv-events.buffer-steps",
    "kv_events_buffer_steps",
    type=click.IntRange(1, 1_000_000),
    envvar=settings.KV_EVENTS_BUFFER_STEPS.name,
    default=settings.KV_EVENTS_BUFFER_STEPS.default,
    show_default=True,
    help="Batches kept per DP rank for replay.",
)
@click.option(
    "--kv-events.memory-bytes",
    "kv_events_memory_bytes",
    type=click.IntRange(0),
    envvar=settings.KV_EVENTS_MEMORY_BYTES.name,
    default=settings.KV_EVENTS_MEMORY_BYTES.default,
    show_default=True,
    help=(
        "What the KV-event publishers may take of the daemon's memory, all segments together "
        "(each 6 MiB + 20 bytes a slot + 60 a cached block; a segment over what is left is not "
        "published, with one line saying by how much): one engine's of up to 75,366 blocks by "
        "default. Raise "
        "it with the container's memory limit (docs/kv-events.md#memory)."
    ),
)
@click.option(
    "--kv-events.max-connections",
    "kv_events_max_connections",
    type=click.IntRange(1, 100_000),
    envvar=settings.KV_EVENTS_MAX_CONNECTIONS.name,
    default=settings.KV_EVENTS_MAX_CONNECTIONS.default,
    show_default=True,
    help=(
        "Connections each KV-event socket admits (each rank's PUB, each rank's replay "
        "ROUTER); past it, as many are held 3 s and then retried, the rest closed with a "
        "log line (docs/kv-events.md#limits)."
    ),
)
@click.option(
    "--kv-events.poll-interval",
    "kv_events_poll_interval",
    type=click.FloatRange(0.001, 10),
    envvar=settings.KV_EVENTS_POLL_INTERVAL.name,
    default=settings.KV_EVENTS_POLL_INTERVAL.default,
    show_default=True,
    help="Seconds between reads of a KV-event segment (one batch per read).",
)
@click.option(
    "--load-push.endpoint",
    "load_push_endpoint",
    envvar=settings.LOAD_PUSH_ENDPOINT.name,
    default=settings.LOAD_PUSH_ENDPOINT.default,
    help=(
        "Publish every engine's load on SGLang's LoadStat ZMQ wire (--load-publish-endpoint), "
        "a PUB per DP rank r on this endpoint's port + r, e.g. tcp://*:5560 "
        "(docs/load-push.md; needs kvsidecar[kvevents]). Off when unset."
    ),
)
@click.option(
    "--load-push.role",
    "load_push_role",
    type=click.Choice(GATEWAY_ROLES),
    envvar=settings.LOAD_PUSH_ROLE.name,
    default=settings.LOAD_PUSH_ROLE.default,
    help="Push only segments of this role (default: any).",
)
@click.option(
    "--load-push.poll-interval",
    "load_push_poll_interval",
    type=click.FloatRange(0.001, 1),
    envvar=settings.LOAD_PUSH_POLL_INTERVAL.name,
    default=settings.LOAD_PUSH_POLL_INTERVAL.default,
    show_default=True,
    help="Seconds between reads of each rank (a changed LoadStat is sent at the read).",
)
@click.option(
    "--load-push.max-connections",
    "load_push_max_connections",
    type=click.IntRange(1, 100_000),
    envvar=settings.LOAD_PUSH_MAX_CONNECTIONS.name,
    default=settings.LOAD_PUSH_MAX_CONNECTIONS.default,
    show_default=True,
    help=(
        "Connections each load-push PUB (one a rank) admits; past it, as many are held 3 s "
        "and then retried, the rest closed with a log line (docs/kv-events.md#limits)."
    ),
)
@trust_options
@click.option(
    "--ready-requires-source",
    is_flag=True,
    envvar=settings.READY_REQUIRES_SOURCE.name,
    help="/-/ready answers 503 until at least one segment is up.",
)
@click.option(
    "--hold-on-error",
    is_flag=True,
    envvar=settings.HOLD_ON_ERROR.name,
    help=(
        "On a start-up error (bad web config, address in use, bad directory), log it and "
        "stay up until SIGTERM instead of exiting, retrying the start with back-off (at once "
        "on SIGHUP): a Kubernetes native sidecar that exits would hold the engine back and "
        "take the Pod out of Ready."
    ),
)
@click.option(
    "--allow-root",
    is_flag=True,
    envvar=settings.ALLOW_ROOT.name,
    help="Root is intended: do not warn at start-up when running as root.",
)
@click.option(
    "--web.disable-exporter-metrics",
    "disable_exporter_metrics",
    is_flag=True,
    envvar=settings.WEB_DISABLE_EXPORTER_METRICS.name,
    help="Leave out metrics about the daemon itself (process_*, python_*, kvsidecar_http_*).",
)
@click.option(
    "--max-targets",
    type=click.IntRange(1),
    default=settings.MAX_TARGETS.default,
    show_default=True,
    envvar=settings.MAX_TARGETS.name,
    help="Most segments followed at once; further files are refused and counted.",
)
@click.option(
    "--max-pools-per-rank",
    type=click.IntRange(1),
    default=settings.MAX_POOLS_PER_RANK.default,
    show_default=True,
    envvar=settings.MAX_POOLS_PER_RANK.name,
    help="A segment with more pools is refused (checked before decoding them).",
)
@click.option(
    "--max-label-length",
    type=click.IntRange(16),
    default=settings.MAX_LABEL_LENGTH.default,
    show_default=True,
    envvar=settings.MAX_LABEL_LENGTH.name,
    help="A segment with a longer label value (model_name, pool_name, ...; in UTF-8 bytes) "
    "is refused.",
)
@click.option(
    "--max-series-per-target",
    type=click.IntRange(64),
    default=settings.MAX_SERIES_PER_TARGET.default,
    show_default=True,
    envvar=settings.MAX_SERIES_PER_TARGET.name,
    help="A segment that would export more series is refused.",
)
@click.option(
    "--max-exposition-bytes",
    type=click.IntRange(64 * 1024),
    default=settings.MAX_EXPOSITION_BYTES.default,
    show_default=True,
    envvar=settings.MAX_EXPOSITION_BYTES.name,
    help=(
        "Daemon-wide budget: the estimated exposition size (UTF-8 bytes) of all targets "
        "together; above it targets are refused (shed) with a reason, those served longest "
        "kept first."
    ),
)
@click.option(
    "--max-payload-bytes",
    type=click.IntRange(4096),
    default=settings.MAX_PAYLOAD_BYTES.default,
    show_default=True,
    envvar=settings.MAX_PAYLOAD_BYTES.name,
    help="A segment whose slot is bigger is refused before any payload is read.",
)
@click.option(
    "--max-new-targets",
    type=click.IntRange(1),
    default=settings.MAX_NEW_TARGETS.default,
    show_default=True,
    envvar=settings.MAX_NEW_TARGETS.name,
    help=(
        "New segment names exported at once (each a new `segment` label); more wait for "
        "--new-target-interval, live and longest-followed first."
    ),
)
@click.option(
    "--new-target-interval",
    type=click.FloatRange(0),
    default=settings.NEW_TARGET_INTERVAL.default,
    show_default=True,
    envvar=settings.NEW_TARGET_INTERVAL.name,
    help="Seconds per further new segment name; a name exported before costs none.",
)
@otlp_options
@log_options
def serve(**options: Any) -> None:
    """Serve every segment's snapshots: Prometheus /metrics, JSON and health endpoints."""
    from kvsidecar.daemon.run import run

    o = dict(options)
    log_level, log_format = o.pop("log_level"), o.pop("log_format")
    run(serve_config(o), log_level, log_format)


def _group(o: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The options named ``prefix...``, taken out of `o`, by their record's field names."""
    return {k.removeprefix(prefix): o.pop(k) for k in [k for k in o if k.startswith(prefix)]}


def serve_config(o: dict[str, Any]) -> ServeConfig:
    """The flags (their click names), dealt once into the daemon's records
    (daemon/config.py); `o` is emptied, and a flag no record takes is an error."""
    from kvsidecar.daemon.budget import Budget
    from kvsidecar.daemon.config import (
        Discovery,
        GatewayOptions,
        KVEventsOptions,
        LoadPushOptions,
        Polling,
        ServeConfig,
        WebOptions,
    )

    # --gateway.* -> GatewayOptions' fields by name (gateway_ranks -> ranks), and so on
    gateway = _group(o, "gateway_")
    kv_events = _group(o, "kv_events_")
    load_push = _group(o, "load_push_")
    rediscover_interval = o.pop("rediscover_interval")
    config = ServeConfig(
        discovery=Discovery(
            o.pop("shm_dir"),
            prefix=o.pop("prefix"),
            names=o.pop("segments"),
            allowed_uids=allowed_uids(o.pop("allow_uids"), o.pop("allow_any_uid")),
            max_targets=o.pop("max_targets"),
            rediscover_interval=rediscover_interval,
            confirm_after=rediscover_interval,
        ),
        polling=Polling(poll_interval=o.pop("poll_interval"), stale_after=o.pop("stale_after")),
        budget=Budget(
            max_payload_bytes=o.pop("max_payload_bytes"),
            max_pools_per_rank=o.pop("max_pools_per_rank"),
            max_label_length=o.pop("max_label_length"),
            max_series_per_target=o.pop("max_series_per_target"),
            max_exposition_bytes=o.pop("max_exposition_bytes"),
        ),
        web=WebOptions(
            # Env twins of repeatable flags are space-separated (click splits them).
            listen_addresses=tuple(a for item in o.pop("listen_addresses") for a in item.split()),
            systemd_socket=o.pop("systemd_socket"),
            config_file=o.pop("web_config_file"),
            telemetry_path=o.pop("telemetry_path"),
            max_requests=o.pop("max_requests"),
            connection_memory=o.pop("connection_memory"),
            exporter_metrics=not o.pop("disable_exporter_metrics"),
            ready_requires_source=o.pop("ready_requires_source"),
        ),
        gateway=None if gateway["address"] is None else GatewayOptions(**gateway),
        kv_events=None if kv_events["endpoint"] is None else KVEventsOptions(**kv_events),
        load_push=None if load_push["endpoint"] is None else LoadPushOptions(**load_push),
        max_new_targets=o.pop("max_new_targets"),
        new_target_interval=o.pop("new_target_interval"),
        otlp={k: o.pop(k) for k in [k for k in o if k.startswith("otlp_")]},  # otlp/options.py
        hold_on_error=o.pop("hold_on_error"),
        allow_root=o.pop("allow_root"),
    )
    if o:
        raise TypeError(f"serve options in no record: {sorted(o)}")
    return config
