"""``kvsidecar serve``: flags in exporter-toolkit style, each with a KVSIDECAR_* twin."""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import time

import click

from kvsidecar import __version__, settings
from kvsidecar.cli.options import (
    EXIT_USAGE,
    allowed_uids,
    dir_problem,
    prefix_option,
    printable,
    shm_dir_option,
    trust_options,
)
from kvsidecar.logsetup import log_options, setup_logging
from kvsidecar.otlp.options import otlp_options
from kvsidecar.protocol.names import InvalidName, validate_name
from kvsidecar.settings import DEFAULT_LISTEN
from kvsidecar.stopflag import StopFlag

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
        "What open connections may cost together, each counted at 64 KiB with TLS, 32 KiB "
        "without (the default allows 192 TLS / 384 plain); idle ones are closed first at the cap."
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
    "gateway_role",
    type=click.Choice(GATEWAY_ROLES),
    default=settings.GATEWAY_ROLE.default,
    envvar=settings.GATEWAY_ROLE.name,
    help="Serve only segments of this role on the gateway (default: any).",
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
def serve(
    shm_dir: str,
    prefix: str,
    segments: tuple[str, ...],
    poll_interval: float,
    stale_after: float,
    rediscover_interval: float,
    listen_addresses: tuple[str, ...],
    systemd_socket: bool,
    web_config_file: str | None,
    telemetry_path: str,
    max_requests: int,
    connection_memory: int,
    gateway_address: tuple[str, int] | None,
    gateway_ranks: int,
    gateway_role: str | None,
    gateway_max_connections: int,
    allow_uids: tuple[int, ...],
    allow_any_uid: bool,
    ready_requires_source: bool,
    hold_on_error: bool,
    allow_root: bool,
    disable_exporter_metrics: bool,
    max_targets: int,
    max_pools_per_rank: int,
    max_label_length: int,
    max_series_per_target: int,
    max_exposition_bytes: int,
    max_payload_bytes: int,
    max_new_targets: int,
    new_target_interval: float,
    log_level: str,
    log_format: str,
    **otlp: object,  # --otlp.* (kvsidecar/otlp/options.py)
) -> None:
    """Serve every segment's snapshots: Prometheus /metrics, JSON and health endpoints."""
    from kvsidecar.daemon.admission import Admission
    from kvsidecar.daemon.app import Daemon
    from kvsidecar.daemon.budget import Budget
    from kvsidecar.daemon.endpoints import WebServer
    from kvsidecar.daemon.malloc import bound_malloc
    from kvsidecar.daemon.targets import TargetSet
    from kvsidecar.protocol.reader import FDS_PER_SEGMENT
    from kvsidecar.web.config import WebConfigError
    from kvsidecar.web.config_file import load_web_config
    from kvsidecar.web.sockets import raise_fd_limit
    from kvsidecar.web.stats import HTTPStats

    bound_malloc()  # before any thread: RSS near what is held (daemon/malloc.py)
    setup_logging(log_level, log_format)
    log = logging.getLogger("kvsidecar")
    # Exporter convention: SIGHUP reloads the web config and the daemon keeps serving
    # (the default action would kill it). Handled in the main loop: a reload takes locks.
    hangups: list[int] = []
    signal.signal(signal.SIGHUP, lambda signum, _frame: hangups.append(signum))
    # First of all: a SIGTERM during start-up must stop it (with --hold-on-error too, where a
    # start error then exits at once), and one that follows the first answered probe must
    # shut down cleanly, not find the default action (exit -15, nothing flushed).
    stopping = StopFlag()
    received: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        received.append(signum)
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # A --hold-on-error retry execs with these blocked (pending ones kept): handled from here.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD_SIGNALS)
    # A missing default directory only means no engine has started yet (the agent creates
    # it): serve and wait, as under systemd at boot. Any other missing directory is a typo.
    if (problem := dir_problem(shm_dir)) is not None:
        _start_error(problem)
        _exit(EXIT_USAGE, hold_on_error, stopping, hangups)
    # Env twins of repeatable flags are space-separated (click splits them).
    addresses = [a for item in listen_addresses for a in item.split()]
    listen_sockets: list = []
    if systemd_socket:
        from kvsidecar.web.systemd_socket import SystemdSocketError
        from kvsidecar.web.systemd_socket import listen_sockets as passed

        try:
            listen_sockets = passed()
        except SystemdSocketError as e:
            _start_error(str(e))
            _exit(EXIT_USAGE, hold_on_error, stopping, hangups)
        addresses = []  # exporter-toolkit: the passed sockets replace the listen addresses
    try:
        web_config = load_web_config(web_config_file) if web_config_file else None
    except WebConfigError as e:
        _start_error(str(e))
        _exit(EXIT_USAGE, hold_on_error, stopping, hangups)
    allowed = allowed_uids(allow_uids, allow_any_uid)
    targets = TargetSet(
        shm_dir,
        prefix=prefix,
        names=list(segments),
        stale_after=stale_after,
        poll_interval=poll_interval,
        rediscover_interval=rediscover_interval,
        allowed_uids=allowed,
        budget=Budget(
            max_payload_bytes=max_payload_bytes,
            max_pools_per_rank=max_pools_per_rank,
            max_label_length=max_label_length,
            max_series_per_target=max_series_per_target,
            max_exposition_bytes=max_exposition_bytes,
        ),
        max_targets=max_targets,
        confirm_after=rediscover_interval,
        admission=Admission(max_new_targets, new_target_interval),
    )
    raise_fd_limit()  # every HTTP connection is an fd: 1,000 of them need more than 1,024
    stats = HTTPStats()
    daemon = Daemon(
        targets,
        http_stats=stats,
        ready_requires_source=ready_requires_source,
        exporter_metrics=not disable_exporter_metrics,
    )
    # The OTLP push (kvsidecar/otlp/push.py), checked before any port is bound; started
    # after the first poll, on its own threads, off the serving path.
    from kvsidecar.daemon.collector import rank_instances
    from kvsidecar.otlp.options import OtlpConfigError, build_push

    try:
        daemon.otlp_pusher = build_push(
            otlp, daemon.collector.collect, lambda: rank_instances(targets.views())
        )
    except OtlpConfigError as e:
        _start_error(str(e))
        _exit(EXIT_USAGE, hold_on_error, stopping, hangups)
    # Bound before the main port answers: once /-/healthy does, polls find a listener.
    gateway = None
    if gateway_address is not None:
        from kvsidecar.daemon.gateway import GatewayListenError, start_gateway

        try:
            gateway = start_gateway(
                targets,
                gateway_address,
                ranks=gateway_ranks,
                role=gateway_role,
                max_connections=gateway_max_connections,
            )
        except GatewayListenError as e:
            _start_error(str(e))
            _exit(EXIT_USAGE, hold_on_error, stopping, hangups)
        daemon.gateway_server = gateway
    try:
        server = WebServer(
            daemon,
            addresses,
            telemetry_path=telemetry_path,
            web_config=web_config,
            max_requests=max_requests,
            connection_memory=connection_memory,
            stats=stats,
            # A new engine's segment must still open when clients hold every connection.
            reserved_fds=max_targets * FDS_PER_SEGMENT,
            version=__version__,
            listen_sockets=listen_sockets,
        )
        server.start()
    except (OSError, ValueError, WebConfigError) as e:
        why = str(e)
        if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
            why = (
                "port in use by another process: pass --web.listen-address "
                f"({settings.WEB_LISTEN_ADDRESS.name}) with a free port, "
                f"e.g. :{_suggest(addresses)}"
            )
        _start_error(f"cannot listen on {' '.join(addresses)}: {why}")
        if gateway is not None:
            gateway.shutdown()
        _exit(EXIT_USAGE, hold_on_error, stopping, hangups)
    # Warned once serving is sure: a start-up error stays the one line that names its fix.
    if not allow_root:
        warn_if_root(log)
    targets.poll_all()
    targets.start()
    if daemon.otlp_pusher is not None:
        daemon.otlp_pusher.start()
    scheme = "https" if server.tls else "http"
    log.info(
        "kvsidecar %s serving %s on %s (%s), shm_dir=%s prefix=%s",
        __version__,
        telemetry_path,
        " ".join(server.addresses),
        scheme,
        shm_dir,
        prefix,
    )
    if gateway is not None:
        log.info(
            "gateway endpoint (model-server protocol, not for Prometheus) on %s",
            " ".join(f"{a}=dp_rank {r}" for r, a in enumerate(gateway.addresses)),
        )
    while not stopping.wait(0.2):
        if hangups:
            hangups.clear()
            log.info("received SIGHUP, reloading the web config")
            server.reload()
    log.info("received %s, shutting down", signal.Signals(received[0]).name)
    if gateway is not None:
        gateway.shutdown()
    server.shutdown()
    if daemon.otlp_pusher is not None:
        daemon.otlp_pusher.stop()
    targets.stop()


def warn_if_root(log: logging.Logger) -> None:
    """One warning line when serving as root (the exporter convention): the daemon only
    reads the segments and serves HTTP, so root only widens what a bug in either could
    reach. Root that is intended (a container whose user is root anyway, the tests) says
    so with --allow-root / KVSIDECAR_ALLOW_ROOT."""
    if os.geteuid() == 0:
        log.warning(
            "running as root: the daemon needs only read access to the segments (the "
            "engine's group, docs/operations.md); run it as an unprivileged user, or pass "
            "--allow-root (%s=1) if root is intended",
            settings.ALLOW_ROOT.name,
        )


def _start_error(message: str) -> None:
    """A start-up error, in --log.format like every other line (issue 33 item 2): under
    Kubernetes with --hold-on-error these are the only lines explaining a silent sidecar."""
    logging.getLogger("kvsidecar").error("%s", message)


_HELD_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
HOLD_RETRY_MIN_S, HOLD_RETRY_MAX_S = 1.0, 60.0


def _exit(code: int, hold: bool, stopping: StopFlag, hangups: list[int]) -> None:
    """Exit with ``code`` now, or with --hold-on-error once SIGTERM/SIGINT arrives (set
    ``stopping``; one that came during start-up counts): the error is already on stderr, and
    a process that stays up keeps a Kubernetes sidecar "started" and ready, so the engine
    starts and keeps serving (docs/operations.md). Meanwhile the whole start is retried,
    after a back-off or at once on SIGHUP (a fixed web config): holding for ever left a
    sidecar that had lost a 4-second port race serving nothing until restarted."""
    if hold and not stopping.is_set():
        delay = min(HOLD_RETRY_MAX_S, max(HOLD_RETRY_MIN_S, _held_seconds() / 2))
        logging.getLogger("kvsidecar").warning(
            "--hold-on-error: staying up, not serving; retrying in %.0f s "
            "(at once on SIGHUP) until SIGTERM",
            delay,
        )
        deadline = time.monotonic() + delay
        while not stopping.wait(0.2):
            if hangups or time.monotonic() >= deadline:
                _restart()
    sys.exit(code)


def _held_seconds() -> float:
    """How long this process has been up: exec keeps its start time, so the back-off grows
    across retries (by half each time, up to HOLD_RETRY_MAX_S) with no state to carry."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _restart() -> None:
    """Run the same command again in this process (same pid, arguments, environment): the
    directory, the web config and the port are retried from scratch, nothing half-started
    kept. Signals stay blocked across the exec, pending ones kept, until `serve` installs
    its handlers: a SIGTERM or SIGHUP then is neither lost nor fatal."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)


def _suggest(addresses: list[str]) -> int:
    """The first listen port plus one: something concrete to type."""
    port = addresses[0].rpartition(":")[2] if addresses else ""
    return int(port) + 1 if port.isdigit() and int(port) < 65535 else 0
