"""``kvsidecar demo``: a real tiny engine (or a prefill/decode pair) plus the daemon.

Runs ``python -m kvsidecar.agent.demo`` (needs torch: the ``agent`` extra) and
``python -m kvsidecar serve`` as child processes on a private shm directory, prints where to
look, and stops everything on Ctrl-C, SIGTERM or ``--duration``. This module never imports
torch: the engines do, in their own processes.

Each child runs in its own process group (so one signal reaches a whole engine tree) and
gets SIGTERM from the kernel if this process dies without cleaning up (PR_SET_PDEATHSIG).
``KVSIDECAR_*`` variables are not passed on: the demo must not pick up a real deployment's
settings (segment names, shm directory) and collide with real engines.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import click

from kvsidecar.cli.options import printable
from kvsidecar.logsetup import LEVELS
from kvsidecar.settings import DEFAULT_PORT, without_ours
from kvsidecar.stopflag import StopFlag
from kvsidecar.supervise import parent_death_signal
from kvsidecar.web.listen_address import parse_listen_address

DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_PORT}"
STOP_GRACE_S = 10.0  # engines close their agents (unlink segments) within this


def split_address(addr: str) -> tuple[str, int]:
    """``host:port``, ``:port`` or ``[v6]:port`` -> (host, port); host "" = every address.
    The daemon's parser, so the demo accepts exactly what ``serve`` accepts."""
    try:
        return parse_listen_address(addr)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--web.listen-address") from None


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # Like the daemon's server: a TIME_WAIT leftover does not make the port busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def url_host(host: str) -> str:
    if host in ("", "0.0.0.0", "::"):
        return "localhost"
    return f"[{host}]" if ":" in host else host


def tls_configured(web_config_file: str | None) -> bool:
    if not web_config_file:
        return False
    try:
        import yaml

        with open(web_config_file) as f:
            return bool((yaml.safe_load(f) or {}).get("tls_server_config"))
    except (OSError, ValueError, AttributeError, ImportError):
        return False  # the daemon reports a bad file itself


def _child_setup() -> Callable[[], None]:
    """preexec_fn: own process group, and SIGTERM when this process dies (Linux)."""
    arm = parent_death_signal(signal.SIGTERM)
    parent = os.getpid()

    def setup() -> None:
        os.setpgid(0, 0)
        arm(parent)

    return setup


def clean_env() -> dict[str, str]:
    return without_ours(os.environ)


class Child:
    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            argv, env=clean_env(), preexec_fn=_child_setup(), stdin=subprocess.DEVNULL
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)  # the child leads its own group


def stop_children(children: list[Child], grace: float = STOP_GRACE_S) -> list[str]:
    """SIGTERM each child's process group in order (the daemon first, so it does not log
    the engines' segments vanishing), wait, SIGKILL what is left; returns those."""
    deadline = time.monotonic() + grace
    killed = []
    for c in children:
        c.signal_group(signal.SIGTERM)
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            killed.append(c.name)
    for c in children:
        c.signal_group(signal.SIGKILL)  # also reaps a group member that outlived its leader
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(5)
    return killed


def wait_listening(
    host: str, port: int, child: Child, stop: StopFlag, timeout: float = 30.0
) -> bool:
    deadline = time.monotonic() + timeout
    target = "127.0.0.1" if host in ("", "0.0.0.0") else ("::1" if host == "::" else host)
    while time.monotonic() < deadline and child.proc.poll() is None and not stop.is_set():
        with contextlib.suppress(OSError), socket.create_connection((target, port), timeout=0.5):
            return True
        time.sleep(0.05)
    return False


def argv(head: list[str], pairs: list[tuple[str, str]], flags: dict[str, object]) -> list[str]:
    """``python -m <head...>`` plus flag/value pairs (flags whose value is None are left
    out, so the child's own default applies)."""
    out = [sys.executable, "-m", *head]
    for flag, val in [*pairs, *flags.items()]:
        if val is not None:
            out += [flag, str(val)]
    return out


def cli_command() -> str:
    """How to run *this* kvsidecar from a fresh shell: plain ``kvsidecar`` only when that
    is what PATH finds, else the script's absolute path (a venv that is not activated)."""
    script = os.path.join(os.path.dirname(sys.executable), "kvsidecar")
    if not os.path.exists(script):
        return f"{shlex.quote(sys.executable)} -m kvsidecar"
    found = shutil.which("kvsidecar")
    if found and os.path.realpath(found) == os.path.realpath(script):
        return "kvsidecar"
    return shlex.quote(os.path.abspath(script))


def say(text: str, err: bool = False) -> None:
    """Print to stdout now. A reader that went away (``| head``, ``| tee`` killed by the
    same Ctrl-C) must not turn into an exception in the middle of starting or stopping:
    stdout goes to /dev/null from then on and the demo carries on, and cleans up."""
    stream = sys.stderr if err else sys.stdout
    try:
        click.echo(text, file=stream)
        stream.flush()
    except (BrokenPipeError, ValueError):  # ValueError: the stream was closed
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)


def expected_segments(pd: bool) -> int:
    return 2 if pd else 1


def engine_states(shm_dir: str) -> dict[str, str]:
    """segment name -> "up", "dead", ... for what the engines have created so far."""
    from kvsidecar.discovery import list_segments
    from kvsidecar.protocol.reader import Reading, read_segment

    out = {}
    # The demo engine's names only (engine "demo"): with --shm-dir /dev/shm the directory
    # can hold real engines' segments, which are none of the demo's business.
    for name in list_segments(shm_dir, prefix="kvsidecar.demo."):
        r = read_segment(name, shm_dir=shm_dir)
        out[name] = "up" if isinstance(r, Reading) else r.kind
    return out


def banner(
    base_url: str,
    telemetry_path: str,
    shm_dir: str,
    private: bool,
    pids: str,
    mode: str,
    rate: float,
    duration: float,
    kv_events: str | None = None,
) -> str:
    """``kv_events``: the KV-event endpoint the demo's daemon publishes on, if any."""
    events = f"  kvevents:  {cli_command()} events --endpoint {kv_events}\n" if kv_events else ""
    watch = f"{cli_command()} dump --watch" + (
        "" if shm_dir == "/dev/shm" else f" --shm-dir {shlex.quote(shm_dir)}"
    )
    note = " (private, removed at exit)" if private else ""
    until = f"Stopping after {duration:g}s." if duration else "Ctrl-C to stop."
    return (
        f"kvsidecar demo: {mode}, {rate:g} req/s\n"
        f"  metrics:   {base_url}{telemetry_path}\n"
        f"  snapshots: {base_url}/api/v1/snapshots\n"
        f"  watch:     {watch}\n"
        f"{events}"
        f"  segments:  {shm_dir}{note}\n"
        f"  pids:      {pids}\n"
        f"{until} The engines are starting (building and warming up the model: "
        "kvsidecar_sources stays 0 until their segments appear); a line follows when they are up."
    )


@click.command()
@click.option(
    "--pd/--single",
    default=True,
    show_default=True,
    help="A prefill + decode engine pair with KV transfer, or one engine.",
)
@click.option(
    "--rate",
    type=click.FloatRange(0, min_open=True),
    default=10.0,
    show_default=True,
    help="Mean request arrivals per second (Poisson).",
)
@click.option(
    "--transfer-delay",
    type=click.FloatRange(0),
    default=0.5,
    show_default=True,
    metavar="SEC",
    help="P/D: decode waits SEC before pulling a request's KV "
    "(the prefill blocks stay deferred meanwhile).",
)
@click.option(
    "--max-requests",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Stop arrivals after N requests (0 = never); engines then idle.",
)
@click.option(
    "--stop-arrivals-after",
    type=click.FloatRange(0),
    default=0.0,
    metavar="SEC",
    help="Stop arrivals after SEC seconds (0 = never).",
)
@click.option(
    "--duration",
    type=click.FloatRange(0),
    default=0.0,
    metavar="SEC",
    help="Stop everything after SEC seconds (0 = until Ctrl-C).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Weights and requests.")
@click.option(
    "--num-blocks",
    type=click.IntRange(16),
    default=64,
    show_default=True,
    help="KV blocks per engine pool (small: pressure, evictions).",
)
@click.option(
    "--step-ms",
    type=click.FloatRange(0),
    default=10.0,
    show_default=True,
    help="Pad each engine step to this many ms (a GPU-like pace).",
)
@click.option(
    "--report-interval",
    type=click.FloatRange(0),
    default=10.0,
    show_default=True,
    metavar="SEC",
    help="Engine status line every SEC (0 = none).",
)
@click.option(
    "--engine-arg",
    "engine_args",
    multiple=True,
    metavar="ARG",
    help="Extra argument for `python -m kvsidecar.agent.demo` (repeatable).",
)
@click.option(
    "--shm-dir",
    default=None,
    help="Segment directory. Default: a fresh private one under /dev/shm, removed "
    "at exit, so the demo never meets real engines.",
)
@click.option(
    "--web.listen-address",
    "listen_addresses",
    multiple=True,
    help=f"Daemon address (repeatable). Default {DEFAULT_LISTEN}, or a free port "
    "if that one is taken.",
)
@click.option(
    "--web.config.file",
    "web_config_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Daemon: exporter-toolkit web config (TLS, basic auth).",
)
@click.option(
    "--web.telemetry-path",
    "telemetry_path",
    default="/metrics",
    show_default=True,
    help="Daemon: path of the metrics endpoint.",
)
@click.option(
    "--web.max-requests",
    "web_max_requests",
    type=click.IntRange(0),
    default=None,
    help="Daemon: concurrent HTTP requests before 503.",
)
@click.option(
    "--poll-interval",
    type=click.FloatRange(0.01, 60),
    default=None,
    help="Daemon: seconds between polls.",
)
@click.option(
    "--stale-after",
    type=click.FloatRange(0.05, 3600),
    default=None,
    help="Daemon: heartbeat age after which a segment is stale.",
)
@click.option("--prefix", default=None, help="Daemon: only segments starting with this.")
@click.option(
    "--log.level",
    "--log-level",
    "log_level",
    type=click.Choice([*LEVELS, "warning"], case_sensitive=False),
    default="warn",
    show_default=True,
    help="Daemon log level.",
)
def demo(
    pd: bool,
    rate: float,
    transfer_delay: float,
    max_requests: int,
    stop_arrivals_after: float,
    duration: float,
    seed: int,
    num_blocks: int,
    step_ms: float,
    report_interval: float,
    engine_args: tuple[str, ...],
    shm_dir: str | None,
    listen_addresses: tuple[str, ...],
    web_config_file: str | None,
    telemetry_path: str,
    web_max_requests: int | None,
    poll_interval: float | None,
    stale_after: float | None,
    prefix: str | None,
    log_level: str,
) -> None:
    """Run a tiny real engine (default: a P/D pair) and the daemon; Ctrl-C stops all."""
    if importlib.util.find_spec("torch") is None:
        raise click.ClickException(
            "the demo engine needs torch: pip install 'kvsidecar[agent]' (the daemon does not)"
        )
    addresses = list(listen_addresses)
    if not addresses:
        host, port = split_address(DEFAULT_LISTEN)
        if not port_free(host, port):
            new = free_port(host)
            click.echo(f"kvsidecar demo: {DEFAULT_LISTEN} is in use; using port {new}", err=True)
            port = new
        addresses = [f"{host}:{port}"]
    for a in addresses:  # before starting anything; also: a connect then reaches the daemon
        if not port_free(*split_address(a)):
            raise click.BadParameter(f"{a} is in use", param_hint="--web.listen-address")
    host, port = split_address(addresses[0])

    if shm_dir is not None and not os.path.isdir(shm_dir):
        raise click.BadParameter(f"{shm_dir} is not a directory", param_hint="--shm-dir")
    stop = StopFlag()
    reason = ["error"]  # why we stop: a signal name, "duration", or what went wrong

    def on_signal(signum: int, _frame: object) -> None:
        reason[0] = signal.Signals(signum).name
        stop.set()

    # Before the private directory and any child exist: from here on a signal (Ctrl-C on
    # `demo | tee log` reaches tee and us alike) is handled, never fatal, so the cleanup
    # below always runs.
    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    private = shm_dir is None
    if private:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        shm_dir = tempfile.mkdtemp(prefix="kvsidecar-demo-", dir=base)

    # The prefill engine's KV events (docs/kv-events.md), when pyzmq is there to publish them.
    kv_events = None
    if importlib.util.find_spec("zmq") is not None:
        kv_events = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    serve = argv(
        # --allow-root: the demo's daemon reads the demo's own private directory; whoever
        # runs the try-out as root (a container) chose to, and needs no warning about it.
        ["kvsidecar", "serve", "--shm-dir", shm_dir, "--allow-root"]
        + (["--kv-events.endpoint", kv_events] if kv_events else []),
        [("--web.listen-address", a) for a in addresses],
        {
            "--web.telemetry-path": telemetry_path,
            "--web.config.file": web_config_file,
            "--web.max-requests": web_max_requests,
            "--poll-interval": poll_interval,
            "--stale-after": stale_after,
            "--prefix": prefix,
            "--log.level": log_level,
        },
    )
    engine = argv(
        ["kvsidecar.agent.demo", "--shm-dir", shm_dir, *(["--pd"] if pd else [])],
        [],
        {
            "--rate": rate,
            "--transfer-delay": transfer_delay if pd else None,
            "--max-requests": max_requests,
            "--stop-arrivals-after": stop_arrivals_after,
            "--seed": seed,
            "--num-blocks": num_blocks,
            "--step-ms": step_ms,
            "--report-interval": report_interval,
        },
    ) + list(engine_args)

    children: list[Child] = []
    rc = 0
    try:
        daemon = Child("daemon", serve)
        children.append(daemon)
        children.append(Child("engine", engine))
        if not wait_listening(host, port, daemon, stop) and not stop.is_set():
            raise click.ClickException(f"the daemon did not start listening on {addresses[0]}")
        if not stop.is_set():
            scheme = "https" if tls_configured(web_config_file) else "http"
            say(
                banner(
                    f"{scheme}://{url_host(host)}:{port}",
                    telemetry_path,
                    shm_dir,
                    private,
                    f"daemon {daemon.pid}, engine {children[1].pid}",
                    f"P/D pair (prefill + decode engines, transfer delay {transfer_delay:g}s)"
                    if pd
                    else "one engine (prefill + decode)",
                    rate,
                    duration,
                    kv_events,
                )
            )
        deadline = time.monotonic() + duration if duration else float("inf")
        started, want, seen_up = time.monotonic(), expected_segments(pd), set()
        while not stop.wait(0.2):
            # An engine process can die under a launcher that lives on, or take the
            # launcher down after it: its segment says which one it was (a killed writer
            # leaves its file with no lock holder; the others close theirs cleanly).
            states = engine_states(shm_dir)
            lost = sorted(
                # Only the definite verdicts: a read the writer lapped is not a death.
                (n for n in seen_up if states.get(n, "not_found") in ("writer_dead", "not_found")),
                key=lambda n: (states.get(n) != "writer_dead", n),
            )
            if lost and not stop.is_set():
                why = states.get(lost[0], "not_found")
                reason[0] = f"the engine writing {printable(lost[0])} died ({why})"
                rc = 1
                break
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                reason[0] = f"the {dead[0].name} exited with {dead[0].proc.returncode}"
                rc = 1
                break
            up = {n for n, st in states.items() if st == "up"}
            if len(up) >= want and len(seen_up) < want:
                say(
                    f"kvsidecar demo: engines up after {time.monotonic() - started:.1f}s: "
                    + ", ".join(printable(n) for n in sorted(up))
                )
            seen_up |= up
            if time.monotonic() >= deadline:
                reason[0] = "duration"
                break
    finally:
        if children:
            say(f"kvsidecar demo: stopping ({reason[0]})", err=True)
        killed = stop_children(children)
        if killed:
            say(f"kvsidecar demo: killed {', '.join(killed)} (no clean exit)", err=True)
            rc = rc or 1
        for sig, handler in old.items():
            signal.signal(sig, handler)
        leftovers = sorted(os.listdir(shm_dir)) if os.path.isdir(shm_dir) else []
        if leftovers:  # an engine that did not close its agent
            say(f"kvsidecar demo: segments left in {shm_dir}: {' '.join(leftovers)}", err=True)
        if private:
            shutil.rmtree(shm_dir, ignore_errors=True)
    sys.exit(rc)
