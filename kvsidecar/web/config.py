"""What a web config is: the validated form of exporter-toolkit's web config file.

`config_file` parses the YAML into these records, `tls_context` builds the TLS context
from them and `live_config` keeps the one in force.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "ALLOWED_HEADERS",
    "CLIENT_AUTH_TYPES",
    "TLS_VERSIONS",
    "HTTPServerConfig",
    "RateLimitConfig",
    "TLSServerConfig",
    "WebConfig",
    "WebConfigError",
]


class WebConfigError(ValueError):
    """A web config file is unusable; the message is one line naming problem and fix."""


TLS_VERSIONS: dict[str, ssl.TLSVersion] = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}

# Go crypto/tls ClientAuthType names -> ssl verify mode. None: not supported.
CLIENT_AUTH_TYPES: dict[str, ssl.VerifyMode | None] = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
    "RequestClientCert": None,
    "RequireAnyClientCert": None,
    "RequireClientCert": None,
}

# exporter-toolkit's allow-list (web/handler.go extraHTTPHeaders); None = any value.
ALLOWED_HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}


@dataclass(frozen=True)
class TLSServerConfig:
    """``tls_server_config``; file paths are already absolute (joined with the config's dir)."""

    cert_file: str | None = None
    key_file: str | None = None
    cert: str | None = None
    key: str | None = field(default=None, repr=False)
    client_ca_file: str | None = None
    client_ca: str | None = None
    client_auth_type: str = "NoClientCert"
    client_allowed_sans: tuple[str, ...] = ()
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    prefer_server_cipher_suites: bool = True
    cipher_suites: tuple[str, ...] = ()
    curve_preferences: tuple[str, ...] = ()

    @property
    def files(self) -> tuple[str, ...]:
        """Files the TLS context is built from, for change detection."""
        paths = (self.cert_file, self.key_file, self.client_ca_file)
        return tuple(p for p in paths if p)


@dataclass(frozen=True)
class HTTPServerConfig:
    """``http_server_config``: extra response headers (``http2`` is accepted and ignored)."""

    headers: Mapping[str, str] = field(default_factory=dict)
    http2: bool = True


@dataclass(frozen=True)
class RateLimitConfig:
    """``rate_limit``: a token bucket, one token per ``interval_s``, ``burst`` tokens deep."""

    interval_s: float
    burst: int


@dataclass(frozen=True)
class WebConfig:
    """A validated web config. ``path`` is the file it came from (None when parsed from text)."""

    tls: TLSServerConfig | None = None
    http: HTTPServerConfig = field(default_factory=HTTPServerConfig)
    basic_auth_users: Mapping[str, str] = field(default_factory=dict, repr=False)
    rate_limit: RateLimitConfig | None = None
    path: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def files(self) -> tuple[str, ...]:
        """The config file plus every file it references, for reload-on-change."""
        own = (self.path,) if self.path else ()
        return own + (self.tls.files if self.tls else ())
