"""The daemon's life: start (every start-up error logged, then exit or, with
--hold-on-error, hold and retry), serve until SIGTERM, shut down. `kvsidecar serve`
(cli/serve.py) parses its flags into a `ServeConfig` and calls `run`, as celery's
`bin/worker.py` hands its options to `apps/worker.py`.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import time

from kvsidecar import __version__, settings
from kvsidecar.daemon.admission import Admission
from kvsidecar.daemon.app import Daemon
from kvsidecar.daemon.config import ServeConfig
from kvsidecar.daemon.endpoints import WebServer
from kvsidecar.daemon.malloc import bound_malloc
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.discovery import dir_problem
from kvsidecar.exit_codes import EXIT_USAGE
from kvsidecar.logsetup import setup_logging
from kvsidecar.protocol.reader import FDS_PER_SEGMENT
from kvsidecar.stopflag import StopFlag
from kvsidecar.web.config import WebConfigError
from kvsidecar.web.config_file import load_web_config
from kvsidecar.web.sockets import raise_fd_limit
from kvsidecar.web.stats import HTTPStats

# Not __name__: docs/operations.md shows serve's lines as source=kvsidecar.
log = logging.getLogger("kvsidecar")


def run(config: ServeConfig, log_level: str, log_format: str) -> None:
    """Serve every segment's snapshots until SIGTERM/SIGINT; exit on a start-up error."""
    bound_malloc()  # before any thread: RSS near what is held (daemon/malloc.py)
    setup_logging(log_level, log_format)
    discovery, web = config.discovery, config.web
    hold_on_error = config.hold_on_error
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
    if (problem := dir_problem(discovery.shm_dir)) is not None:
        _start_error(problem)
        _exit(EXIT_USAGE, hold_on_error, stopping, hangups)
    addresses = list(web.listen_addresses)
    listen_sockets: list = []
    if web.systemd_socket:
        from kvsidecar.web.systemd_socket import SystemdSocketError
        from kvsidecar.web.systemd_socket import listen_sockets as passed

        try:
            listen_sockets = passed()
        except SystemdSocketError as e:
            _start_error(str(e))
            _exit(EXIT_USAGE, hold_on_error, stopping, hangups)
        addresses = []  # exporter-toolkit: the passed sockets replace the listen addresses
    try:
        web_config = load_web_config(web.config_file) if web.config_file else None
    except WebConfigError as e:
        _start_error(str(e))
        _exit(EXIT_USAGE, hold_on_error, stopping, hangups)
    targets = TargetSet(
        discovery,
        polling=config.polling,
        budget=config.budget,
        admission=Admission(config.max_new_targets, config.new_target_interval),
    )
    raise_fd_limit()  # every HTTP connection is an fd: 1,000 of them need more than 1,024
    stats = HTTPStats()
    daemon = Daemon(
        targets,
        http_stats=stats,
        ready_requires_source=web.ready_requires_source,
        exporter_metrics=web.exporter_metrics,
    )
    # The OTLP push (kvsidecar/otlp/push.py), checked before any port is bound; started
    # after the first poll, on its own threads, off the serving path.
    from kvsidecar.daemon.collector import rank_instances
    from kvsidecar.otlp.options import OtlpConfigError, build_push

    try:
        daemon.otlp_pusher = build_push(
            config.otlp, daemon.collector.collect, lambda: rank_instances(targets.views())
        )
    except OtlpConfigError as e:
        _start_error(str(e))
        _exit(EXIT_USAGE, hold_on_error, stopping, hangups)
    if (problem := _ports_overlap(addresses, config)) is not None:
        _start_error(problem)
        _exit(EXIT_USAGE, hold_on_error, stopping, hangups)
    # Bound before the main port answers: once /-/healthy does, polls find a listener.
    gateway = None
    if config.gateway is not None:
        from kvsidecar.daemon.gateway import GatewayListenError, start_gateway
        from kvsidecar.web.poll_tls import PollTLS

        try:
            gateway_tls = (
                PollTLS.load(config.gateway.web_config_file)
                if config.gateway.web_config_file
                else None
            )
            gateway = start_gateway(targets, config.gateway, gateway_tls)
        except (GatewayListenError, WebConfigError) as e:
            _start_error(str(e))
            _exit(EXIT_USAGE, hold_on_error, stopping, hangups)
        daemon.gateway_server = gateway
    try:
        server = WebServer(
            daemon,
            addresses,
            telemetry_path=web.telemetry_path,
            web_config=web_config,
            max_requests=web.max_requests,
            connection_memory=web.connection_memory,
            stats=stats,
            # A new engine's segment must still open when clients hold every connection.
            reserved_fds=discovery.max_targets * FDS_PER_SEGMENT,
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
    # The streams (kvsidecar/streams/, pyzmq: the kvsidecar[kvevents] extra).
    kv_events = load_push = None
    try:
        if config.kv_events is not None:
            from kvsidecar.streams.kv_events_zmq import KVEventsService

            kv_events = KVEventsService(
                config.kv_events,
                discovery.shm_dir,
                allowed_uids=discovery.allowed_uids,
                rediscover_interval=discovery.rediscover_interval,
            )
        if config.load_push is not None:
            from kvsidecar.streams.load_push import LoadPushService

            load_push = daemon.load_push = LoadPushService(targets, config.load_push)
    except ImportError as e:
        flag = "--kv-events.endpoint" if config.kv_events is not None else "--load-push.endpoint"
        _start_error(f"{flag} needs pyzmq ({e}): pip install 'kvsidecar[kvevents]'")
        if gateway is not None:
            gateway.shutdown()
        server.shutdown()
        _exit(EXIT_USAGE, hold_on_error, stopping, hangups)
    # Warned once serving is sure: a start-up error stays the one line that names its fix.
    if not config.allow_root:
        warn_if_root(log)
    targets.poll_all()
    targets.start()
    if daemon.otlp_pusher is not None:
        daemon.otlp_pusher.start()
    if kv_events is not None:
        kv_events.start()
    if load_push is not None:
        load_push.start()
    scheme = "https" if server.tls else "http"
    log.info(
        "kvsidecar %s serving %s on %s (%s), shm_dir=%s prefix=%s",
        __version__,
        web.telemetry_path,
        " ".join(server.addresses),
        scheme,
        discovery.shm_dir,
        discovery.prefix,
    )
    if gateway is not None:
        log.info(
            "gateway endpoint (model-server protocol, not for Prometheus) on %s",
            " ".join(f"{a}={what}" for a, what in zip(gateway.addresses, gateway.served)),
        )
    while not stopping.wait(0.2):
        if hangups:
            hangups.clear()
            log.info("received SIGHUP, reloading the web config")
            server.reload()
            if gateway is not None and gateway.tls is not None:
                gateway.tls.reload()
    log.info("received %s, shutting down", signal.Signals(received[0]).name)
    if kv_events is not None:
        kv_events.stop()
    if load_push is not None:
        load_push.stop()
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
    log.error("%s", message)


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
        log.warning(
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


def _ports_overlap(addresses: list[str], config: ServeConfig) -> str | None:
    """Two of the daemon's own listeners on one port: one line naming both flags."""
    from kvsidecar.daemon.ports import Claim, overlap
    from kvsidecar.web.listen_address import parse_listen_address

    claims = []
    for address in addresses:
        try:
            host, port = parse_listen_address(address)
        except ValueError:
            continue  # the web server's own error names it
        claims.append(Claim("--web.listen-address", address, host, port))
    if config.gateway is not None:
        host, port = config.gateway.address
        shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        count = config.gateway.ranks * max(1, len(config.gateway.roles))
        claims.append(Claim("--gateway.listen-address", shown, host, port, count))
    if config.kv_events is not None:
        for flag, endpoint in (
            ("--kv-events.endpoint", config.kv_events.endpoint),
            ("--kv-events.replay-endpoint", config.kv_events.replay_endpoint),
        ):
            claim = _tcp_claim(flag, endpoint)
            if claim is not None:
                claims.append(claim)
    if config.load_push is not None:
        claim = _tcp_claim("--load-push.endpoint", config.load_push.endpoint)
        if claim is not None:
            claims.append(claim)
    return overlap(claims)


def _tcp_claim(flag: str, endpoint: str | None):
    """A ZMQ ``tcp://host:port`` endpoint's base port (rank 0's; the others are dynamic)."""
    from kvsidecar.daemon.ports import Claim

    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if not port.isdigit():
        return None
    host = host.strip("[]")
    return Claim(flag, endpoint, "" if host == "*" else host, int(port))


def _suggest(addresses: list[str]) -> int:
    """The first listen port plus one: something concrete to type."""
    port = addresses[0].rpartition(":")[2] if addresses else ""
    return int(port) + 1 if port.isdigit() and int(port) < 65535 else 0
