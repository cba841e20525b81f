"""serve's --otlp.* options, in one decorator, and starting the push from them.

Import-light: the OpenTelemetry packages load only when --otlp.endpoint is set, so the
default install (without the extra) serves as before.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import click

from kvsidecar import settings

_OPTS = (
    ("--otlp.endpoint", "otlp_endpoint", settings.OTLP_ENDPOINT, {}),
    ("--otlp.interval", "otlp_interval", settings.OTLP_INTERVAL, {"type": click.FloatRange(0.1)}),
    (
        "--otlp.temporality",
        "otlp_temporality",
        settings.OTLP_TEMPORALITY,
        {"type": click.Choice(["cumulative", "delta"])},
    ),
    ("--otlp.headers-file", "otlp_headers_file", settings.OTLP_HEADERS_FILE, {}),
    ("--otlp.ca-file", "otlp_ca_file", settings.OTLP_CA_FILE, {}),
    ("--otlp.cert-file", "otlp_cert_file", settings.OTLP_CERT_FILE, {}),
    ("--otlp.key-file", "otlp_key_file", settings.OTLP_KEY_FILE, {}),
)


def otlp_options(f: Callable) -> Callable:
    for flag, dest, s, extra in reversed(_OPTS):
        f = click.option(
            flag,
            dest,
            envvar=s.name,
            default=s.default,
            help=s.meaning[:1].upper() + s.meaning[1:] + ".",
            **extra,
        )(f)
    return f


class OtlpConfigError(Exception):
    """One line naming the fix."""


def read_headers(path: str) -> dict[str, str]:
    try:
        with open(path) as f:
            lines = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    except OSError as e:
        raise OtlpConfigError(
            f"--otlp.headers-file {path}: {e.strerror}: give a readable file of `name: value` lines"
        ) from None
    out = {}
    for n, ln in enumerate(lines, 1):
        name, sep, value = ln.partition(":")
        if not sep or not name.strip():
            raise OtlpConfigError(
                f"--otlp.headers-file {path}: line {n} is not `name: value` "
                "(e.g. `authorization: Bearer <token>`)"
            )
        out[name.strip().lower()] = value.strip()
    return out


def build_push(
    opts: dict[str, Any],
    families: Callable[[], Iterable],
    instances: Callable[[], Mapping[str, str]] | None = None,
) -> Any:
    """The Pusher, not started, or None when --otlp.endpoint is unset. Raises
    OtlpConfigError before serve listens: a bad setting never half-starts the daemon."""
    endpoint = opts.get("otlp_endpoint")
    if not endpoint:
        return None
    url = urlsplit(endpoint)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise OtlpConfigError(
            f"--otlp.endpoint {endpoint!r}: give an http(s) URL, e.g. "
            "http://collector:4318/v1/metrics"
        )
    for key in ("otlp_ca_file", "otlp_cert_file", "otlp_key_file"):
        if opts.get(key) and not os.access(opts[key], os.R_OK):
            flag = "--" + key.replace("_", ".", 1).replace("_", "-")
            raise OtlpConfigError(f"{flag} {opts[key]}: not readable: give a readable PEM file")
    headers = read_headers(opts["otlp_headers_file"]) if opts.get("otlp_headers_file") else {}
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        from kvsidecar.otlp.errors import Causes
        from kvsidecar.otlp.push import Pusher
    except ImportError:
        raise OtlpConfigError(
            "--otlp.endpoint needs the OTLP extra: pip install '.[otlp]' in a kvsidecar "
            "checkout, or the wheel with [otlp] (docs/otlp.md)"
        ) from None
    causes = Causes()
    exporter = OTLPMetricExporter(
        endpoint=endpoint,
        headers=headers,
        certificate_file=opts.get("otlp_ca_file"),
        client_certificate_file=opts.get("otlp_cert_file"),
        client_key_file=opts.get("otlp_key_file"),
        timeout=max(1.0, float(opts["otlp_interval"])),
        session=causes.session,
    )
    pusher = Pusher(
        families,
        exporter,
        float(opts["otlp_interval"]),
        delta=opts.get("otlp_temporality") == "delta",
        instances=instances,
        causes=causes,
        endpoint=endpoint,
    )
    return pusher
