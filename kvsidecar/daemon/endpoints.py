"""The daemon's endpoints, served by the metric-agnostic `kvsidecar.web` server.

Routes: the telemetry path (``/metrics``), ``/api/v1/snapshots`` and a landing page at
``/``; the server itself answers ``/-/healthy`` and asks `Handlers.ready` for
``/-/ready``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvsidecar.web import server
from kvsidecar.web.landing import landing_page
from kvsidecar.web.request import Request

__all__ = ["SNAPSHOTS_PATH", "Handlers", "WebServer"]

SNAPSHOTS_PATH = "/api/v1/snapshots"
LANDING_PATH = "/"
_RESERVED = (LANDING_PATH, SNAPSHOTS_PATH, server.HEALTHY_PATH, server.READY_PATH)


def telemetry_path_problem(path: str) -> str | None:
    """Why `path` cannot be the metrics endpoint's path, or None."""
    if not path.startswith("/") or path in _RESERVED:
        return f"it must start with / and not be {', '.join(_RESERVED)}"
    return None


class Handlers(Protocol):
    """What the endpoints need from the rest of the daemon."""

    def metrics(self, accept_header: str) -> tuple[bytes, str]:
        """Exposition body and its content type; the implementation picks OpenMetrics or text."""
        ...

    def snapshots_json(self) -> bytes:
        """The current snapshots as JSON."""
        ...

    def ready(self) -> tuple[bool, str]:
        """(ready, reason); the reason is the 503 body when not ready."""
        ...

    @property
    def landing_links(self) -> Sequence[tuple[str, str]]:
        """Extra (href, text) links for the landing page."""
        ...


class WebServer(server.WebServer):
    """The daemon's HTTP(S) server: `kvsidecar.web.server.WebServer` (whose keyword
    options it takes) with the daemon's routes."""

    def __init__(
        self,
        handlers: Handlers,
        listen_addresses: Sequence[str],
        *,
        telemetry_path: str = "/metrics",
        title: str = "kvsidecar",
        version: str | None = None,
        **options: Any,
    ) -> None:
        problem = telemetry_path_problem(telemetry_path)
        if problem is not None:
            raise ValueError(f"invalid telemetry path {telemetry_path!r}: {problem}")
        self.handlers = handlers
        self.telemetry_path = telemetry_path
        self.title = title
        self.version = version
        routes: dict[str, server.Render] = {
            telemetry_path: self._metrics,
            SNAPSHOTS_PATH: self._snapshots,
            LANDING_PATH: self._landing,
        }
        super().__init__(routes, listen_addresses, ready=handlers.ready, **options)

    def _metrics(self, request: Request) -> tuple[bytes, str]:
        return self.handlers.metrics(request.header("accept"))

    def _snapshots(self, request: Request) -> tuple[bytes, str]:
        return self.handlers.snapshots_json(), "application/json"

    def _landing(self, request: Request) -> tuple[bytes, str]:
        return self.landing_page(), "text/html; charset=utf-8"

    def landing_page(self) -> bytes:
        links = [
            (self.telemetry_path, "Metrics"),
            (SNAPSHOTS_PATH, "Snapshots (JSON)"),
            (server.HEALTHY_PATH, "Health"),
            (server.READY_PATH, "Readiness"),
            *self.handlers.landing_links,
        ]
        return landing_page(self.title, "KV-cache monitoring sidecar", self.version, links)
