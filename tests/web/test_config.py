"""The exporter-toolkit web config: strict parsing, one-line errors, TLS context, basic auth."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import time
from pathlib import Path

import bcrypt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsidecar.web import basic_auth as web_auth
from kvsidecar.web.basic_auth import BasicAuth
from kvsidecar.web.config import WebConfigError
from kvsidecar.web.config_file import load_web_config, parse_duration, parse_web_config
from kvsidecar.web.tls_context import build_ssl_context, peer_san_allowed
from tests.support.certs import make_cert

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "web-config.example.yml"
EXAMPLE_USER, EXAMPLE_PASSWORD = "prometheus", "kvsidecar-example-password"  # documented there

requires_openssl = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="openssl CLI not installed"
)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    return make_cert(tmp_path_factory.mktemp("certs"))


def hashed(password: str) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()  # cost 4: fast tests


def error_of(text: str, base_dir: str = ".") -> str:
    with pytest.raises(WebConfigError) as info:
        parse_web_config(text, base_dir=base_dir)
    message = str(info.value)
    assert "\n" not in message, "errors must be one line"
    return message


# --- parsing -----------------------------------------------------------------------------------


def test_empty_file_means_no_tls_no_auth() -> None:
    for text in ("", "{}\n", "# only a comment\n", "tls_server_config:\n", "tls_server_config: {}"):
        cfg = parse_web_config(text)
        assert cfg.tls is None and not cfg.basic_auth_users and cfg.rate_limit is None
        assert dict(cfg.http.headers) == {}


def test_full_config_parses_and_resolves_paths_against_the_config_dir(tmp_path: Path) -> None:
    cfg = parse_web_config(
        f"""
tls_server_config:
  cert_file: tls/server.crt
  key_file: /abs/server.key
  min_version: TLS13
  cipher_suites: [TLS_AES_128_GCM_SHA256]
http_server_config:
  http2: false
  headers:
    X-Frame-Options: deny
    Strict-Transport-Security: max-age=31536000
basic_auth_users:
  alice: {hashed("secret")}
rate_limit:
  interval: 1m30s
  burst: 5
""",
        base_dir=str(tmp_path),
    )
    assert cfg.tls is not None
    assert cfg.tls.cert_file == str(tmp_path / "tls/server.crt")
    assert cfg.tls.key_file == "/abs/server.key"
    assert cfg.tls.min_version == "TLS13" and cfg.tls.max_version == "TLS13"
    assert cfg.tls.client_auth_type == "NoClientCert"
    assert cfg.http.headers["X-Frame-Options"] == "deny"
    assert list(cfg.basic_auth_users) == ["alice"]
    assert (
        cfg.rate_limit is not None and cfg.rate_limit.interval_s == 90 and cfg.rate_limit.burst == 5
    )
    assert any("cipher_suites is ignored" in n for n in cfg.notes)


def test_tls_defaults_to_tls12_minimum() -> None:
    cfg = parse_web_config("tls_server_config: {cert_file: a, key_file: b}")
    assert cfg.tls is not None and cfg.tls.min_version == "TLS12"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tls_server_conf: {}", "unknown key 'tls_server_conf' in the top level"),
        (
            "tls_server_config: {cert_file: a, key_file: b, cert_fil: c}",
            "unknown key 'cert_fil' in tls_server_config",
        ),
        ("http_server_config: {header: {}}", "unknown key 'header' in http_server_config"),
        ("basic_auth_users: {a: x}\nbasic_auth_users: {b: y}", "duplicate key 'basic_auth_users'"),
        ("tls_server_config: [a, b]", "tls_server_config must be a mapping"),
        ("- a\n- b\n", "the top level must be a mapping"),
        ("tls_server_config: {cert_file: a", "invalid YAML"),
        ("tls_server_config: {key_file: b}", "missing cert_file"),
        ("tls_server_config: {cert_file: a}", "missing key_file"),
        ("tls_server_config: {min_version: TLS12}", "missing cert_file"),
        ("tls_server_config: {cert_file: a, cert: x, key_file: b}", "only one of cert"),
        (
            "tls_server_config: {cert_file: a, key_file: b, min_version: TLS14}",
            "unknown TLS version 'TLS14'",
        ),
        (
            "tls_server_config: {cert_file: a, key_file: b, "
            "min_version: TLS13, max_version: TLS12}",
            "min_version TLS13 is above max_version TLS12",
        ),
        (
            "tls_server_config: {cert_file: a, key_file: b, client_auth_type: Sometimes}",
            "client_auth_type: unknown value 'Sometimes'",
        ),
        (
            "tls_server_config: {cert_file: a, key_file: b, "
            "client_auth_type: RequireAnyClientCert}",
            "not supported; use RequireAndVerifyClientCert",
        ),
        (
            "tls_server_config: {cert_file: a, key_file: b, client_ca_file: ca}",
            "client CA configured without a client auth policy",
        ),
        (
            "tls_server_config: {cert_file: a, key_file: b, "
            "client_auth_type: RequireAndVerifyClientCert}",
            "set client_ca_file",
        ),
        (
            "tls_server_config: {cert_file: a, key_file: b, client_allowed_sans: [x]}",
            "client_allowed_sans requires",
        ),
        ("tls_server_config: {cert_file: 5, key_file: b}", "cert_file must be a string"),
        (
            "tls_server_config: {cert_file: a, key_file: b, "
            "prefer_server_cipher_suites: yes please}",
            "must be true or false",
        ),
        (
            "http_server_config: {headers: {X-Powered-By: me}}",
            "'X-Powered-By' can not be configured",
        ),
        (
            "http_server_config: {headers: {X-Frame-Options: allow}}",
            "invalid value 'allow' for X-Frame-Options",
        ),
        ("basic_auth_users: {alice: hunter2}", "is not a bcrypt hash"),
        ("basic_auth_users: [alice]", "basic_auth_users must be a mapping"),
        ("rate_limit: {interval: 1 sec, burst: 1}", "rate_limit.interval: invalid duration"),
        ("rate_limit: {interval: 1s, burst: 0}", "burst must be at least 1"),
        ("rate_limit: {interval: 1s, burst: many}", "burst must be a non-negative integer"),
    ],
)
def test_invalid_configs_give_one_line_errors(text: str, expected: str) -> None:
    assert expected in error_of(text)


def test_plaintext_password_is_not_echoed_in_the_error() -> None:
    message = error_of("basic_auth_users: {alice: hunter2}")
    assert "hunter2" not in message and "alice" in message and "htpasswd" in message


def test_error_names_the_section_plainly() -> None:
    assert error_of("basic_auth_users: [alice]").startswith("basic_auth_users must be a mapping")
    assert error_of("http_server_config: {headers: [a]}").startswith(
        "http_server_config.headers must be a mapping"
    )


def test_every_bcrypt_variant_is_accepted() -> None:
    h = hashed("pw")
    for prefix in ("$2a$", "$2b$", "$2y$"):
        cfg = parse_web_config(f"basic_auth_users: {{u: '{prefix}{h[4:]}'}}")
        assert BasicAuth(cfg.basic_auth_users).check("u", "pw")


def test_disabled_rate_limit() -> None:
    assert parse_web_config("rate_limit: {interval: 0, burst: 0}").rate_limit is None


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("0", 0.0),
        ("1s", 1.0),
        ("250ms", 0.25),
        ("1m30s", 90.0),
        ("1h", 3600.0),
        ("1.5s", 1.5),
        ("10us", 1e-5),
        ("100ns", 1e-7),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "1", "s", "1d", "1 s", "-1s", "1s2"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


@given(h=st.integers(0, 99), m=st.integers(0, 59), s=st.integers(0, 59), ms=st.integers(0, 999))
def test_parse_duration_compound(h: int, m: int, s: int, ms: int) -> None:
    text = f"{h}h{m}m{s}s{ms}ms"
    assert parse_duration(text) == pytest.approx(h * 3600 + m * 60 + s + ms / 1000)


# --- loading files and certificates ------------------------------------------------------------


def test_load_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(WebConfigError, match=r"nope\.yml: cannot read web config"):
        load_web_config(tmp_path / "nope.yml")


def test_load_prefixes_errors_with_the_file_name(tmp_path: Path) -> None:
    path = tmp_path / "web.yml"
    path.write_text("basic_auth_user: {}\n")
    with pytest.raises(WebConfigError) as info:
        load_web_config(path)
    assert str(info.value).startswith(str(path) + ": unknown key 'basic_auth_user'")


@requires_openssl
def test_load_checks_certificate_files(tmp_path: Path, certs: tuple[Path, Path]) -> None:
    cert, key = certs
    path = tmp_path / "web.yml"
    path.write_text(f"tls_server_config: {{cert_file: missing.crt, key_file: {key}}}\n")
    with pytest.raises(WebConfigError, match=r"cert_file .*missing\.crt: No such file"):
        load_web_config(path)

    other_cert, _ = make_cert(tmp_path, "other")  # a certificate that doesn't match the key
    path.write_text(f"tls_server_config: {{cert_file: {other_cert}, key_file: {key}}}\n")
    with pytest.raises(WebConfigError, match="key matches the certificate"):
        load_web_config(path)

    path.write_text(f"tls_server_config: {{cert_file: {cert}, key_file: {key}}}\n")
    cfg = load_web_config(path)
    assert cfg.files == (str(path), str(cert), str(key))


@requires_openssl
def test_ssl_context_versions_and_inline_pem(certs: tuple[Path, Path]) -> None:
    cert, key = certs
    cfg = parse_web_config(
        "tls_server_config:\n"
        f"  cert: |\n{_indent(cert.read_text())}"
        f"  key: |\n{_indent(key.read_text())}"
        "  min_version: TLS13\n"
    )
    assert cfg.tls is not None
    ctx = build_ssl_context(cfg.tls)
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    assert ctx.maximum_version == ssl.TLSVersion.TLSv1_3
    assert ctx.verify_mode == ssl.CERT_NONE


@requires_openssl
def test_ssl_context_client_auth(certs: tuple[Path, Path]) -> None:
    cert, key = certs
    cfg = parse_web_config(
        f"tls_server_config: {{cert_file: {cert}, key_file: {key}, "
        f"client_ca_file: {cert}, client_auth_type: VerifyClientCertIfGiven}}"
    )
    assert cfg.tls is not None
    assert build_ssl_context(cfg.tls).verify_mode == ssl.CERT_OPTIONAL


def _indent(pem: str) -> str:
    return "".join(f"    {line}\n" for line in pem.splitlines())


def test_peer_san_allowed() -> None:
    peer = {"subjectAltName": (("DNS", "scraper.example"), ("IP Address", "0:0:0:0:0:0:0:1"))}
    assert peer_san_allowed(peer, ["scraper.example"])
    assert peer_san_allowed(peer, ["::1"])  # IPs compare as addresses, not strings
    assert not peer_san_allowed(peer, ["other.example", "127.0.0.1"])
    assert not peer_san_allowed(None, ["scraper.example"])
    assert not peer_san_allowed({}, ["scraper.example"])


# --- basic auth --------------------------------------------------------------------------------


def test_basic_auth_caches_outcomes(monkeypatch: pytest.MonkeyPatch) -> None:
    auth = BasicAuth({"alice": hashed("right")})
    calls = []
    real = web_auth.bcrypt.checkpw
    monkeypatch.setattr(web_auth.bcrypt, "checkpw", lambda pw, h: calls.append(pw) or real(pw, h))

    assert not auth.check("alice", "wrong")
    assert not auth.check("alice", "wrong")
    assert len(calls) == 1, "a repeated wrong password is answered from the cache"
    assert auth.check("alice", "right")
    assert auth.check("alice", "right")
    assert len(calls) == 2, "success is cached"
    assert not auth.check("alice", "wrong"), "a cached success must not admit another password"
    assert not auth.check("alice", "other")
    assert len(calls) == 3, "a new password is checked"
    assert not auth.check("bob", "right")
    assert len(calls) == 4, "unknown users still pay for a bcrypt check (no timing oracle)"


def test_basic_auth_cache_is_fast() -> None:
    auth = BasicAuth({"alice": bcrypt.hashpw(b"right", bcrypt.gensalt(10)).decode()})
    t0 = time.perf_counter()
    assert auth.check("alice", "right")  # uncached: one bcrypt check, the baseline
    uncached = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(100):
        assert auth.check("alice", "right")
    # A ratio measured side by side, not a bound in seconds: 100 cached checks cost less
    # than the one bcrypt check (each is microseconds against ~85 ms); without the cache
    # they would cost 100 of them.
    assert time.perf_counter() - t0 < uncached


def test_basic_auth_cache_is_bounded() -> None:
    auth = BasicAuth({"alice": hashed("right")}, cache_size=2)
    auth.check("alice", "right")
    auth._cache[("x", "y", b"1")] = 0.0
    auth._cache[("x", "y", b"2")] = 1.0
    assert auth.check("alice", "right")  # cached
    auth2 = BasicAuth({"alice": hashed("a"), "bob": hashed("b"), "carol": hashed("c")}, 2)
    for user, pw in (("alice", "a"), ("bob", "b"), ("carol", "c")):
        assert auth2.check(user, pw)
    assert len(auth2._cache) == 2


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        ("Basic YWxpY2U6cmlnaHQ=", True),  # alice:right
        ("basic   YWxpY2U6cmlnaHQ=  ", True),
        ("Basic YWxpY2U6d3Jvbmc=", False),  # alice:wrong
        ("Basic YWxpY2U=", False),  # no colon
        ("Basic !!!", False),
        ("Bearer YWxpY2U6cmlnaHQ=", False),
        ("", False),
        (None, False),
    ],
)
def test_basic_auth_header(header: str | None, ok: bool) -> None:
    assert BasicAuth({"alice": hashed("right")}).check_header(header) is ok


def test_password_with_colon() -> None:
    import base64

    auth = BasicAuth({"alice": hashed("a:b")})
    assert auth.check_header("Basic " + base64.b64encode(b"alice:a:b").decode())


# --- the shipped example -----------------------------------------------------------------------


@pytest.fixture
def example_dir(tmp_path: Path) -> Path:
    """The example next to the certificate files it names (relative paths)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    shutil.copy(EXAMPLE, tmp_path / "web-config.yml")
    (tmp_path / "tls").mkdir()
    cert, key = make_cert(tmp_path / "tls")
    cert.rename(tmp_path / "tls" / "tls.crt")
    key.rename(tmp_path / "tls" / "tls.key")
    return tmp_path


def test_example_loads_and_documented_password_works(example_dir: Path) -> None:
    cfg = load_web_config(example_dir / "web-config.yml")
    assert cfg.tls is not None and cfg.tls.min_version == "TLS12"
    assert BasicAuth(cfg.basic_auth_users).check(EXAMPLE_USER, EXAMPLE_PASSWORD)
    assert not cfg.notes


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)"
)
def test_example_passes_promtool(example_dir: Path) -> None:
    result = subprocess.run(
        ["promtool", "check", "web-config", "web-config.yml"],
        cwd=example_dir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
