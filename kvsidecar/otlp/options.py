"""serve's --otlp.* options, in one decorator, the OpenTelemetry environment variables,
and starting the push from both.

Import-light: requests (the otlp extra) loads only when the push is on, so the default
install (without the extra) serves as before. Everything is checked here, before serve
listens: a bad setting never half-starts the daemon, and a PEM file that does not load is
named at start, not at the first TLS handshake.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

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


# The OpenTelemetry SDK environment variables the push reads (docs/otlp.md lists them):
# the metrics-specific one first, then the general one.
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
SIGNAL_PATH = "v1/metrics"  # appended to OTEL_EXPORTER_OTLP_ENDPOINT only (the spec's rule)
DEFAULT_TIMEOUT_S = 10.0  # the specification's default for OTEL_EXPORTER_OTLP_TIMEOUT


def _otel(environ: Mapping[str, str], what: str) -> tuple[str, str] | None:
    """(variable, value) of OTEL_EXPORTER_OTLP_METRICS_<what>, else OTEL_EXPORTER_OTLP_<what>."""
    for var in (f"OTEL_EXPORTER_OTLP_METRICS_{what}", f"OTEL_EXPORTER_OTLP_{what}"):
        value = environ.get(var, "").strip()
        if value:
            return var, value
    return None


def _pairs(var: str, text: str, example: str) -> dict[str, str]:
    """`key=value,key2=value2` (W3C Baggage style, values percent-decoded), as the
    specification has it for OTEL_RESOURCE_ATTRIBUTES and OTEL_EXPORTER_OTLP_HEADERS."""
    out = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise OtlpConfigError(f"{var}: {item.strip()!r} is not key=value (e.g. {example})")
        out[key.strip()] = unquote(value.strip())
    return out


@dataclass(frozen=True)
class PushConfig:
    """The push's settings, from --otlp.* and the OTEL_* environment, checked."""

    endpoint: str
    interval_s: float
    delta: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    gzip: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    resource_attrs: dict[str, str] = field(default_factory=dict)
    service_name: str = "kvsidecar"
    read: tuple[str, ...] = ()  # the OTEL_* variables that were set and used

    def describe(self) -> str:
        parts = ["delta" if self.delta else "cumulative", f"timeout {self.timeout_s:g} s"]
        if self.gzip:
            parts.append("gzip")
        if self.read:
            parts.append("from " + ", ".join(self.read))
        return ", ".join(parts)


def _endpoint(opts: dict[str, Any], environ: Mapping[str, str], read: list[str]) -> str | None:
    if opts.get("otlp_endpoint"):
        endpoint, source = opts["otlp_endpoint"], "--otlp.endpoint"  # used as is
    else:
        # The push is off unless asked for: an OTEL_* endpoint asks, unless the SDK's own
        # switches say no exporter (OTEL_SDK_DISABLED, OTEL_METRICS_EXPORTER=none).
        if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return None
        exporters = environ.get("OTEL_METRICS_EXPORTER", "").strip().lower()
        if exporters and "otlp" not in [e.strip() for e in exporters.split(",")]:
            return None
        found = _otel(environ, "ENDPOINT")
        if found is None:
            return None
        source, endpoint = found
        read.append(source)
        if source == "OTEL_EXPORTER_OTLP_ENDPOINT":  # a base URL: the signal's path appended
            endpoint += ("" if endpoint.endswith("/") else "/") + SIGNAL_PATH
    url = urlsplit(endpoint)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise OtlpConfigError(
            f"{source} {endpoint!r}: give an http(s) URL, e.g. http://collector:4318/v1/metrics"
        )
    return endpoint


def _tls_file(
    opts: dict[str, Any], key: str, var: str, environ: Mapping[str, str], read: list[str]
) -> tuple[str, str] | None:
    """(where it was given, path) of a PEM file: the flag, else the OTEL_* variable."""
    if opts.get(key):
        return "--" + key.replace("_", ".", 1).replace("_", "-"), opts[key]
    found = _otel(environ, var)
    if found is not None:
        read.append(found[0])
    return found


def _load_tls(
    ca: tuple[str, str] | None, cert: tuple[str, str] | None, key: tuple[str, str] | None
) -> None:
    """Load the PEM files as the TLS handshake will: a bad one is named now."""
    for given in (ca, cert, key):
        if given is not None and not os.access(given[1], os.R_OK):
            raise OtlpConfigError(f"{given[0]} {given[1]}: not readable: give a readable PEM file")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca is not None:
        try:
            ctx.load_verify_locations(cafile=ca[1])
        except (ssl.SSLError, OSError, ValueError) as e:
            raise OtlpConfigError(
                f"{ca[0]} {ca[1]}: no PEM certificate loads from it ({_reason(e)}): give the "
                "collector's CA certificate(s) in PEM"
            ) from None
    if key is not None and cert is None:
        raise OtlpConfigError(f"{key[0]} {key[1]}: needs --otlp.cert-file, the certificate")
    if cert is not None:
        try:  # the certificate alone first, so that the message names the right file
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert[1])
        except (ssl.SSLError, OSError, ValueError) as e:
            raise OtlpConfigError(
                f"{cert[0]} {cert[1]}: no PEM certificate loads from it ({_reason(e)}): give "
                "the client certificate in PEM"
            ) from None
        try:
            ctx.load_cert_chain(cert[1], key[1] if key is not None else None)
        except (ssl.SSLError, OSError, ValueError) as e:
            named = key if key is not None else cert
            raise OtlpConfigError(
                f"{named[0]} {named[1]}: no private key for {cert[1]} loads from it "
                f"({_reason(e)}): give the certificate's key in PEM, unencrypted"
            ) from None


def _reason(e: Exception) -> str:
    return getattr(e, "reason", None) or type(e).__name__


def resolve(opts: dict[str, Any], environ: Mapping[str, str] | None = None) -> PushConfig | None:
    """The push's settings, or None when it is off. Raises OtlpConfigError (one line
    naming the fix) for anything that would fail later."""
    environ = os.environ if environ is None else environ
    read: list[str] = []
    endpoint = _endpoint(opts, environ, read)
    if endpoint is None:
        return None
    protocol = _otel(environ, "PROTOCOL")
    if protocol is not None and protocol[1] != "http/protobuf":
        raise OtlpConfigError(
            f"{protocol[0]}={protocol[1]}: the push speaks OTLP/HTTP with protobuf only: "
            "set it to http/protobuf or unset it"
        )
    headers: dict[str, str] = {}
    found = _otel(environ, "HEADERS")
    if found is not None:
        read.append(found[0])
        headers = {k.lower(): v for k, v in _pairs(*found, "authorization=Bearer%20t").items()}
    if opts.get("otlp_headers_file"):  # the file's headers win over the environment's
        headers.update(read_headers(opts["otlp_headers_file"]))
    ca = _tls_file(opts, "otlp_ca_file", "CERTIFICATE", environ, read)
    cert = _tls_file(opts, "otlp_cert_file", "CLIENT_CERTIFICATE", environ, read)
    key = _tls_file(opts, "otlp_key_file", "CLIENT_KEY", environ, read)
    _load_tls(ca, cert, key)
    gzip = False
    found = _otel(environ, "COMPRESSION")
    if found is not None:
        read.append(found[0])
        if found[1].lower() not in ("gzip", "none"):
            raise OtlpConfigError(f"{found[0]}={found[1]}: give gzip or none")
        gzip = found[1].lower() == "gzip"
    timeout_s = DEFAULT_TIMEOUT_S
    found = _otel(environ, "TIMEOUT")
    if found is not None:
        read.append(found[0])
        try:
            timeout_s = float(found[1]) / 1000.0  # milliseconds, as the specification says
        except ValueError:
            timeout_s = -1.0
        if not timeout_s > 0:
            raise OtlpConfigError(f"{found[0]}={found[1]}: give milliseconds, e.g. 10000")
    attrs: dict[str, str] = {}
    if environ.get("OTEL_RESOURCE_ATTRIBUTES", "").strip():
        read.append("OTEL_RESOURCE_ATTRIBUTES")
        attrs = _pairs(
            "OTEL_RESOURCE_ATTRIBUTES",
            environ["OTEL_RESOURCE_ATTRIBUTES"],
            "k8s.pod.name=engine-0,deployment.environment.name=prod",
        )
    service = attrs.pop("service.name", "kvsidecar")
    if environ.get("OTEL_SERVICE_NAME", "").strip():  # wins over OTEL_RESOURCE_ATTRIBUTES'
        read.append("OTEL_SERVICE_NAME")
        service = environ["OTEL_SERVICE_NAME"].strip()
    return PushConfig(
        endpoint=endpoint,
        interval_s=float(opts["otlp_interval"]),
        delta=opts.get("otlp_temporality") == "delta",
        headers=headers,
        ca_file=ca[1] if ca else None,
        cert_file=cert[1] if cert else None,
        key_file=key[1] if key else None,
        gzip=gzip,
        timeout_s=timeout_s,
        resource_attrs=attrs,
        service_name=service,
        read=tuple(read),
    )


def build_push(
    opts: dict[str, Any],
    families: Callable[[], Iterable],
    instances: Callable[[], Mapping[str, str]] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Any:
    """The Pusher, not started, or None when the push is off. Raises OtlpConfigError
    before serve listens: a bad setting never half-starts the daemon."""
    config = resolve(opts, environ)
    if config is None:
        return None
    try:
        from kvsidecar.otlp.convert import Encoder
        from kvsidecar.otlp.push import Pusher
        from kvsidecar.otlp.transport import Sender
    except ImportError:
        fix = (
            "the OTLP push needs the otlp extra: .venv/bin/pip install -e '.[otlp]' in a "
            "kvsidecar clone, or the wheel with [otlp] (docs/otlp.md)"
        )
        if not opts.get("otlp_endpoint"):
            # Asked for by an OTEL_* variable alone (often set for every container of a pod):
            # a sidecar built without the extra serves on without the push, never exits.
            logging.getLogger(__name__).warning(
                "%s set, but %s; serving without the push", ", ".join(config.read), fix
            )
            return None
        raise OtlpConfigError(fix) from None
    verify: bool | str = config.ca_file or True
    cert: Any = config.cert_file
    if config.cert_file and config.key_file:
        cert = (config.cert_file, config.key_file)
    sender = Sender(
        config.endpoint,
        headers=config.headers,
        timeout_s=config.timeout_s,
        gzip_body=config.gzip,
        verify=verify,
        cert=cert,
    )
    encoder = Encoder(config.resource_attrs, config.service_name)
    return Pusher(
        families,
        sender,
        config.interval_s,
        delta=config.delta,
        instances=instances,
        encoder=encoder,
        describe=config.describe(),
    )
