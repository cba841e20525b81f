"""The Prometheus exporter-toolkit web config file (``--web.config.file``).

Same YAML format as node_exporter and friends (exporter-toolkit
docs/web-configuration.md), so one file and one ``promtool check web-config``
serve every exporter on a host. Parsing is strict like the Go side
(``yaml.UnmarshalStrict``): unknown or duplicate keys are errors, not silently
ignored typos that leave an endpoint unprotected.

Differences from exporter-toolkit, all reported as errors or `WebConfig.notes`:

* ``cipher_suites`` and ``curve_preferences`` use Go names and are ignored
  (OpenSSL defaults apply); ``http2`` is ignored (HTTP/1.1 only).
* ``client_auth_type`` values that accept unverified client certificates
  (``RequestClientCert``, ``RequireAnyClientCert``) are refused: Python's ssl
  module cannot request a certificate without verifying it.
* A ``tls_server_config`` without any certificate is an error (Go quietly
  serves plain HTTP), and ``cert`` plus ``cert_file`` together is an error.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Sequence
from typing import Any

import yaml

from kvsidecar.web.config import (
    ALLOWED_HEADERS,
    CLIENT_AUTH_TYPES,
    TLS_VERSIONS,
    HTTPServerConfig,
    RateLimitConfig,
    TLSServerConfig,
    WebConfig,
    WebConfigError,
)
from kvsidecar.web.safe_file import read_regular
from kvsidecar.web.tls_context import build_ssl_context

__all__ = ["load_web_config", "parse_duration", "parse_web_config"]

_BCRYPT_RE = re.compile(r"^\$2[abxy]?\$(\d\d)\$[./A-Za-z0-9]{53}$")


# --- YAML -------------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (Go's UnmarshalStrict does too)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            line = key_node.start_mark.line + 1
            raise WebConfigError(f"duplicate key {key!r} at line {line}; keep only one")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,  # type: ignore[arg-type]
)


class _Section:
    """Typed, strict access to one YAML mapping; every key must be consumed."""

    def __init__(self, data: Any, where: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise WebConfigError(f"{where} must be a mapping, got {type(data).__name__}")
        self.data = data
        self.where = where

    def check_keys(self, allowed: Sequence[str]) -> None:
        for key in self.data:
            if key not in allowed:
                raise WebConfigError(
                    f"unknown key {key!r} in {self.where}; allowed keys: {', '.join(allowed)}"
                )

    def get_str(self, key: str, default: str | None = None) -> str | None:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise WebConfigError(f"{self.where}.{key} must be a string (quote it), got {value!r}")
        return value

    def get_bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise WebConfigError(f"{self.where}.{key} must be true or false, got {value!r}")
        return value

    def str_list(self, key: str) -> tuple[str, ...]:
        value = self.data.get(key)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise WebConfigError(f"{self.where}.{key} must be a list of strings, got {value!r}")
        return tuple(value)

    def str_map(self, key: str) -> dict[str, str]:
        sub = _Section(self.data.get(key), f"{self.where}.{key}" if self.where else key)
        out: dict[str, str] = {}
        for k, v in sub.data.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise WebConfigError(
                    f"{sub.where} must map strings to strings (quote them), got {k!r}: {v!r}"
                )
            out[k] = v
        return out


# --- parsing -----------------------------------------------------------------------------------

_DURATION_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}


def parse_duration(text: str) -> float:
    """Parse a Go/Prometheus duration ("1s", "1m30s", "250ms", "0") into seconds."""
    text = text.strip()
    if text == "0":
        return 0.0
    pos, total = 0, 0.0
    for m in _DURATION_RE.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ValueError(f"invalid duration {text!r} (examples: 500ms, 1s, 1m30s)")
    return total


def _join(base_dir: str, path: str | None) -> str | None:
    # exporter-toolkit resolves relative paths against the config file's directory.
    if not path:
        return None
    return path if os.path.isabs(path) else os.path.join(base_dir, path)


def _parse_tls(data: Any, base_dir: str, notes: list[str]) -> TLSServerConfig | None:
    if data is None or data == {}:
        return None  # an empty section means no TLS, as in exporter-toolkit
    s = _Section(data, "tls_server_config")
    s.check_keys(
        [
            "cert",
            "key",
            "client_ca",
            "cert_file",
            "key_file",
            "client_auth_type",
            "client_ca_file",
            "client_allowed_sans",
            "min_version",
            "max_version",
            "cipher_suites",
            "prefer_server_cipher_suites",
            "curve_preferences",
        ]
    )
    tls = TLSServerConfig(
        cert_file=_join(base_dir, s.get_str("cert_file")),
        key_file=_join(base_dir, s.get_str("key_file")),
        cert=s.get_str("cert"),
        key=s.get_str("key"),
        client_ca_file=_join(base_dir, s.get_str("client_ca_file")),
        client_ca=s.get_str("client_ca"),
        client_auth_type=s.get_str("client_auth_type") or "NoClientCert",
        client_allowed_sans=s.str_list("client_allowed_sans"),
        min_version=s.get_str("min_version") or "TLS12",
        max_version=s.get_str("max_version") or "TLS13",
        prefer_server_cipher_suites=s.get_bool("prefer_server_cipher_suites", True),
        cipher_suites=s.str_list("cipher_suites"),
        curve_preferences=s.str_list("curve_preferences"),
    )
    w = "tls_server_config"
    if tls.cert and tls.cert_file:
        raise WebConfigError(f"{w}: set only one of cert (inline PEM) or cert_file")
    if tls.key and tls.key_file:
        raise WebConfigError(f"{w}: set only one of key (inline PEM) or key_file")
    if tls.client_ca and tls.client_ca_file:
        raise WebConfigError(f"{w}: set only one of client_ca (inline PEM) or client_ca_file")
    if not (tls.cert or tls.cert_file):
        raise WebConfigError(f"{w}: missing cert_file (or cert); add it or remove {w}")
    if not (tls.key or tls.key_file):
        raise WebConfigError(f"{w}: missing key_file (or key); add it or remove {w}")
    for key in ("min_version", "max_version"):
        value = getattr(tls, key)
        if value not in TLS_VERSIONS:
            raise WebConfigError(
                f"{w}.{key}: unknown TLS version {value!r}; use one of {', '.join(TLS_VERSIONS)}"
            )
    if TLS_VERSIONS[tls.min_version] > TLS_VERSIONS[tls.max_version]:
        raise WebConfigError(
            f"{w}: min_version {tls.min_version} is above max_version "
            f"{tls.max_version}; lower min_version or raise max_version"
        )
    if tls.client_auth_type not in CLIENT_AUTH_TYPES:
        raise WebConfigError(
            f"{w}.client_auth_type: unknown value {tls.client_auth_type!r}; "
            "use NoClientCert, VerifyClientCertIfGiven or "
            "RequireAndVerifyClientCert"
        )
    mode = CLIENT_AUTH_TYPES[tls.client_auth_type]
    if mode is None:
        raise WebConfigError(
            f"{w}.client_auth_type {tls.client_auth_type} (unverified client "
            "certificates) is not supported; use RequireAndVerifyClientCert"
        )
    has_ca = bool(tls.client_ca or tls.client_ca_file)
    if has_ca and mode == ssl.CERT_NONE:
        raise WebConfigError(
            f"{w}: client CA configured without a client auth policy; "
            "set client_auth_type: RequireAndVerifyClientCert"
        )
    if mode != ssl.CERT_NONE and not has_ca:
        raise WebConfigError(
            f"{w}.client_auth_type {tls.client_auth_type} needs the CA that "
            "signs client certificates; set client_ca_file"
        )
    if tls.client_allowed_sans and mode != ssl.CERT_REQUIRED:
        raise WebConfigError(
            f"{w}.client_allowed_sans requires client_auth_type: RequireAndVerifyClientCert"
        )
    if tls.cipher_suites:
        notes.append(f"{w}.cipher_suites is ignored: OpenSSL's default cipher list is used")
    if tls.curve_preferences:
        notes.append(f"{w}.curve_preferences is ignored: OpenSSL's default curves are used")
    if TLS_VERSIONS[tls.min_version] < ssl.TLSVersion.TLSv1_2:
        notes.append(
            f"{w}.min_version {tls.min_version}: OpenSSL's security level may still "
            "refuse TLS below 1.2"
        )
    return tls


def _parse_http(data: Any) -> HTTPServerConfig:
    s = _Section(data, "http_server_config")
    s.check_keys(["http2", "headers"])
    headers = s.str_map("headers")
    for name, value in headers.items():
        if name not in ALLOWED_HEADERS:
            raise WebConfigError(
                f"http_server_config.headers: header {name!r} can not be "
                f"configured; allowed: {', '.join(ALLOWED_HEADERS)}"
            )
        allowed = ALLOWED_HEADERS[name]
        if allowed is not None and value not in allowed:
            raise WebConfigError(
                f"http_server_config.headers: invalid value {value!r} for "
                f"{name}; expected one of {', '.join(allowed)}"
            )
    return HTTPServerConfig(headers=headers, http2=s.get_bool("http2", True))


def _parse_users(data: Any) -> dict[str, str]:
    users = _Section({"basic_auth_users": data}, "").str_map("basic_auth_users")
    for user, hashed in users.items():
        m = _BCRYPT_RE.match(hashed)
        if not m or not 4 <= int(m.group(1)) <= 31:
            raise WebConfigError(
                f"basic_auth_users: password of user {user!r} is not a bcrypt "
                "hash; store a hash (htpasswd -nBC 10 \"\" | tr -d ':\\n'), "
                "never the password"
            )
        if ":" in user:
            raise WebConfigError(
                f"basic_auth_users: user name {user!r} contains ':', which "
                "basic auth cannot carry; rename the user"
            )
    return users


def _parse_rate_limit(data: Any) -> RateLimitConfig | None:
    if data is None:
        return None
    s = _Section(data, "rate_limit")
    s.check_keys(["interval", "burst"])
    raw = s.data.get("interval", 0)
    try:
        # A bare number is nanoseconds, as for Go's time.Duration.
        interval = raw / 1e9 if isinstance(raw, int) else parse_duration(str(raw))
    except ValueError as e:
        raise WebConfigError(f"rate_limit.interval: {e}") from None
    burst = s.data.get("burst", 0)
    if not isinstance(burst, int) or isinstance(burst, bool) or burst < 0:
        raise WebConfigError(f"rate_limit.burst must be a non-negative integer, got {burst!r}")
    if interval <= 0:
        return None  # 0 disables the limiter, as in exporter-toolkit
    if burst < 1:
        raise WebConfigError(
            "rate_limit.burst must be at least 1 when interval is set, or every request is refused"
        )
    return RateLimitConfig(interval_s=interval, burst=burst)


def parse_web_config(text: str, base_dir: str = ".", path: str | None = None) -> WebConfig:
    """Parse and validate web config YAML. Relative file paths resolve against ``base_dir``.

    Certificates are not loaded here; `load_web_config` and `build_ssl_context` do that.
    """
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise WebConfigError(f"invalid YAML{where}: {problem}") from None
    top = _Section(data, "the top level")
    top.check_keys(["tls_server_config", "http_server_config", "basic_auth_users", "rate_limit"])
    notes: list[str] = []
    return WebConfig(
        tls=_parse_tls(top.data.get("tls_server_config"), base_dir, notes),
        http=_parse_http(top.data.get("http_server_config")),
        basic_auth_users=_parse_users(top.data.get("basic_auth_users")),
        rate_limit=_parse_rate_limit(top.data.get("rate_limit")),
        path=path,
        notes=tuple(notes),
    )


def load_web_config(path: str | os.PathLike[str]) -> WebConfig:
    """Read, validate and (if TLS is set) test-load the certificates, like ``promtool``.

    Every problem is a `WebConfigError` whose message starts with the file name.
    """
    p = os.fspath(path)
    try:
        text = read_regular(p).decode("utf-8")
    except OSError as e:
        raise WebConfigError(f"{p}: cannot read web config: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise WebConfigError(f"{p}: web config is not UTF-8 text") from None
    try:
        cfg = parse_web_config(text, base_dir=os.path.dirname(os.path.abspath(p)), path=p)
        if cfg.tls is not None:
            build_ssl_context(cfg.tls)
    except WebConfigError as e:
        raise WebConfigError(f"{p}: {e}") from None
    return cfg
