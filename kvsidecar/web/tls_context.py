"""The TLS side of the web config: the server's `ssl.SSLContext` and the client-SAN check."""

from __future__ import annotations

import ipaddress
import os
import ssl
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvsidecar.web.config import CLIENT_AUTH_TYPES, TLS_VERSIONS, TLSServerConfig, WebConfigError
from kvsidecar.web.safe_file import read_regular

__all__ = ["build_ssl_context", "peer_san_allowed"]


def _check_readable(key: str, path: str) -> None:
    # Regular and bounded, before OpenSSL opens it (a FIFO would block it forever).
    try:
        read_regular(path)
    except OSError as e:
        raise WebConfigError(f"tls_server_config.{key} {path}: {e.strerror or e}") from None


def build_ssl_context(tls: TLSServerConfig) -> ssl.SSLContext:
    """A server-side `ssl.SSLContext` for ``tls``; raises `WebConfigError` on bad files."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = TLS_VERSIONS[tls.min_version]
    ctx.maximum_version = TLS_VERSIONS[tls.max_version]
    if tls.prefer_server_cipher_suites:
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    # Answer ALPN with http/1.1 so HTTP/2-capable clients (Go) don't try h2.
    ctx.set_alpn_protocols(["http/1.1"])
    for key in ("cert_file", "key_file", "client_ca_file"):
        if getattr(tls, key):
            _check_readable(key, getattr(tls, key))
    try:
        with tempfile.TemporaryDirectory(prefix="kvsidecar-tls-") as tmp:
            # ssl only loads certificates from files: spill inline PEM into a private dir.
            cert_file, key_file = tls.cert_file, tls.key_file
            if tls.cert:
                cert_file = os.path.join(tmp, "cert.pem")
                Path(cert_file).write_text(tls.cert)
            if tls.key:
                key_file = os.path.join(tmp, "key.pem")
                fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(tls.key)
            ctx.load_cert_chain(cert_file, key_file)  # type: ignore[arg-type]
    except ssl.SSLError as e:
        raise WebConfigError(
            f"tls_server_config: cannot load certificate and key "
            f"({e.reason or e}); check both are PEM and the key matches "
            "the certificate"
        ) from None
    mode = CLIENT_AUTH_TYPES[tls.client_auth_type]
    assert mode is not None  # refused by the parser
    if tls.client_ca_file or tls.client_ca:
        try:
            ctx.load_verify_locations(cafile=tls.client_ca_file, cadata=tls.client_ca)
        except ssl.SSLError as e:
            raise WebConfigError(
                f"tls_server_config: cannot load client CA ({e.reason or e}); "
                "it must be PEM certificates"
            ) from None
    ctx.verify_mode = mode
    return ctx


def peer_san_allowed(peercert: Mapping[str, Any] | None, allowed: Sequence[str]) -> bool:
    """True if the verified peer certificate has a SAN exactly in ``allowed`` (IPs normalized)."""
    if not peercert:
        return False
    allowed_set = set(allowed)
    allowed_ips = set()
    for a in allowed:
        try:
            allowed_ips.add(ipaddress.ip_address(a))
        except ValueError:
            pass
    for kind, value in peercert.get("subjectAltName", ()):
        value = value.strip()
        if kind == "IP Address":
            try:
                if ipaddress.ip_address(value) in allowed_ips:
                    return True
            except ValueError:
                continue
        elif value in allowed_set:
            return True
    return False
