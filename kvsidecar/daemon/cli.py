"""``kvsidecar serve``: flags in exporter-toolkit style, each with a KVSIDECAR_* twin."""

from __future__ import annotations

import logging
import os
import signal
import sys

import click

from kvsidecar import __version__
from kvsidecar.cli_options import EXIT_USAGE, prefix_option, shm_dir_option
from kvsidecar.stopflag import StopFlag

DEFAULT_LISTEN = ":9400"


@click.command()
@shm_dir_option
@prefix_option
@click.option(
    "--segment",
    "segments",
    multiple=True,
    envvar="KVSIDECAR_SEGMENT",
    help="Follow this segment name (repeatable); default: every PREFIX* segment.",
)
@click.option(
    "--poll-interval",
    type=click.FloatRange(0.01, 60),
    default=0.25,
    show_default=True,
    envvar="KVSIDECAR_POLL_INTERVAL",
    help="Seconds between polls.",
)
@click.option(
    "--stale-after",
    type=click.FloatRange(0.05, 3600),
    default=5.0,
    show_default=True,
    envvar="KVSIDECAR_STALE_AFTER",
    help="A live writer whose heartbeat is older than this is stale (up 0).",
)
@click.option(
    "--rediscover-interval",
    type=click.FloatRange(0.05, 3600),
    default=1.0,
    show_default=True,
    envvar="KVSIDECAR_REDISCOVER_INTERVAL",
    help="Seconds between scans of the shm directory.",
)
@click.option(
    "--web.listen-address",
    "listen_addresses",
    multiple=True,
    envvar="KVSIDECAR_WEB_LISTEN_ADDRESS",
    default=[DEFAULT_LISTEN],
    show_default=True,
    help="Address to listen on (repeatable), e.g. :9400, 127.0.0.1:9400, [::1]:9400.",
)
@click.option(
    "--web.config.file",
    "web_config_file",
    envvar="KVSIDECAR_WEB_CONFIG_FILE",
    type=click.Path(dir_okay=False),
    default=None,
    help="exporter-toolkit web config (TLS, basic auth).",
)
@click.option(
    "--web.telemetry-path",
    "telemetry_path",
    envvar="KVSIDECAR_WEB_TELEMETRY_PATH",
    default="/metrics",
    show_default=True,
    help="Path of the metrics endpoint.",
)
@click.option(
    "--web.max-requests",
    "max_requests",
    type=click.IntRange(0),
    default=40,
    show_default=True,
    envvar="KVSIDECAR_WEB_MAX_REQUESTS",
    help="Concurrent requests served before answering 503 (0 = no limit).",
)
@click.option(
    "--allow-uid",
    "allow_uids",
    multiple=True,
    type=int,
    envvar="KVSIDECAR_ALLOW_UID",
    help="Also trust segments owned by this uid (repeatable). Default: own uid only.",
)
@click.option(
    "--allow-any-uid",
    is_flag=True,
    envvar="KVSIDECAR_ALLOW_ANY_UID",
    help="Trust segments of any owner (not recommended on shared hosts).",
)
@click.option(
    "--ready-requires-source",
    is_flag=True,
    envvar="KVSIDECAR_READY_REQUIRES_SOURCE",
    help="/-/ready answers 503 until at least one segment is up.",
)
@click.option(
    "--max-targets",
    type=click.IntRange(1),
    default=256,
    show_default=True,
    envvar="KVSIDECAR_MAX_TARGETS",
    help="Most segments followed at once; further files are refused and counted.",
)
@click.option(
    "--max-pools-per-rank",
    type=click.IntRange(1),
    default=64,
    show_default=True,
    envvar="KVSIDECAR_MAX_POOLS_PER_RANK",
    help="A segment with more pools is refused (checked before decoding them).",
)
@click.option(
    "--max-label-length",
    type=click.IntRange(16),
    default=256,
    show_default=True,
    envvar="KVSIDECAR_MAX_LABEL_LENGTH",
    help="A segment with a longer label value (model_name, pool_name, ...) is refused.",
)
@click.option(
    "--max-series-per-target",
    type=click.IntRange(64),
    default=4096,
    show_default=True,
    envvar="KVSIDECAR_MAX_SERIES_PER_TARGET",
    help="A segment that would export more series is refused.",
)
@click.option(
    "--max-payload-bytes",
    type=click.IntRange(4096),
    default=1024 * 1024,
    show_default=True,
    envvar="KVSIDECAR_MAX_PAYLOAD_BYTES",
    help="A segment whose slot is bigger is refused before any payload is read.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
    envvar="KVSIDECAR_LOG_LEVEL",
)
def serve(
    shm_dir: str,
    prefix: str,
    segments: tuple[str, ...],
    poll_interval: float,
    stale_after: float,
    rediscover_interval: float,
    listen_addresses: tuple[str, ...],
    web_config_file: str | None,
    telemetry_path: str,
    max_requests: int,
    allow_uids: tuple[int, ...],
    allow_any_uid: bool,
    ready_requires_source: bool,
    max_targets: int,
    max_pools_per_rank: int,
    max_label_length: int,
    max_series_per_target: int,
    max_payload_bytes: int,
    log_level: str,
) -> None:
    """Serve every segment's snapshots: Prometheus /metrics, JSON and health endpoints."""
    from kvsidecar.daemon.app import Daemon
    from kvsidecar.daemon.budget import Budget
    from kvsidecar.daemon.http import HTTPStats, WebServer
    from kvsidecar.daemon.targets import TargetSet
    from kvsidecar.daemon.webconfig import WebConfigError, load_web_config

    logging.basicConfig(
        level=log_level.upper(),
        stream=sys.stderr,
        format="ts=%(asctime)s level=%(levelname)s msg=%(message)s",
    )
    log = logging.getLogger("kvsidecar")
    if not os.path.isdir(shm_dir):
        click.echo(
            f"kvsidecar: --shm-dir {shm_dir} is not a directory: create it or point "
            "--shm-dir/KVSIDECAR_SHM_DIR at the agent's segment directory",
            err=True,
        )
        sys.exit(EXIT_USAGE)
    # Env twins of repeatable flags are space-separated (click splits them).
    addresses = [a for item in listen_addresses for a in item.split()]
    try:
        web_config = load_web_config(web_config_file) if web_config_file else None
    except WebConfigError as e:
        click.echo(f"kvsidecar: {e}", err=True)
        sys.exit(EXIT_USAGE)
    allowed = None if allow_any_uid else frozenset({os.getuid(), *allow_uids})
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
        ),
        max_targets=max_targets,
        confirm_after=rediscover_interval,
    )
    stats = HTTPStats()
    daemon = Daemon(targets, http_stats=stats, ready_requires_source=ready_requires_source)
    try:
        server = WebServer(
            daemon,
            addresses,
            telemetry_path=telemetry_path,
            web_config=web_config,
            max_requests=max_requests,
            stats=stats,
            version=__version__,
        )
        server.start()
    except (OSError, ValueError, WebConfigError) as e:
        click.echo(f"kvsidecar: cannot listen on {' '.join(addresses)}: {e}", err=True)
        sys.exit(EXIT_USAGE)
    targets.poll_all()
    targets.start()
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
    stopping = StopFlag()
    received: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        received.append(signum)
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping.wait(0.2):
        pass
    log.info("received %s, shutting down", signal.Signals(received[0]).name)
    server.shutdown()
    targets.stop()
