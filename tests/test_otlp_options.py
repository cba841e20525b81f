"""--otlp.* and the OpenTelemetry SDK environment variables (issue 45, item 1): which are
read, in which order, and what the specification says each does."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsidecar.otlp.options import OtlpConfigError, resolve

OPTS = {"otlp_interval": 15.0, "otlp_temporality": "cumulative"}


def _resolve(env: dict[str, str], **opts):
    return resolve({**OPTS, **opts}, env)


@pytest.mark.parametrize(
    "env, flag, endpoint",
    [
        # OTEL_EXPORTER_OTLP_ENDPOINT is a base URL: the signal's path is appended, relative
        # to the base's own path (the OTLP exporter specification's examples).
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, None, "http://c:4318/v1/metrics"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}, None, "http://c:4318/v1/metrics"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://c:4318/mycollector/"},
            None,
            "https://c:4318/mycollector/v1/metrics",
        ),
        # The signal-specific variable and the flag are used as is, and win.
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://base:4318",
                "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:4318/custom",
            },
            None,
            "http://c:4318/custom",
        ),
        (
            {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:4318/custom"},
            "http://flag:4318",
            "http://flag:4318",
        ),
        ({}, "http://flag:4318/v1/metrics", "http://flag:4318/v1/metrics"),
    ],
)
def test_endpoint_as_the_specification_builds_it(env, flag, endpoint) -> None:
    config = _resolve(env, otlp_endpoint=flag)
    assert config is not None and config.endpoint == endpoint


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_METRICS_EXPORTER": "none"},
        {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"},  # not ours
    ],
)
def test_push_stays_off(env) -> None:
    assert _resolve(env) is None


def test_the_flag_wins_over_the_sdk_switches() -> None:
    env = {"OTEL_SDK_DISABLED": "true", "OTEL_METRICS_EXPORTER": "none"}
    assert _resolve(env, otlp_endpoint="http://c:4318/v1/metrics") is not None


def test_resource_attributes_and_service_name() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
        "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=engine-0, service.name=from-attrs,note=a%20b%2Cc",
    }
    config = _resolve(env)
    assert config.resource_attrs == {"k8s.pod.name": "engine-0", "note": "a b,c"}
    assert config.service_name == "from-attrs"
    config = _resolve({**env, "OTEL_SERVICE_NAME": "sidecar-a"})
    assert config.service_name == "sidecar-a"  # OTEL_SERVICE_NAME takes precedence
    assert "OTEL_RESOURCE_ATTRIBUTES" in config.describe()


def test_headers_compression_timeout(tmp_path: Path) -> None:
    headers = tmp_path / "h"
    headers.write_text("Authorization: Bearer from-file\n")
    env = {
        "OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20env,x-tenant=a",
        "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "x-tenant=b",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
        "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "2500",
    }
    config = _resolve(env, otlp_endpoint="http://c:4318/v1/metrics")
    assert config.headers == {"x-tenant": "b"}  # the signal's variable replaces the general
    assert config.gzip and config.timeout_s == 2.5  # milliseconds
    del env["OTEL_EXPORTER_OTLP_METRICS_HEADERS"]
    config = _resolve(env, otlp_endpoint="http://c:4318/v1/metrics", otlp_headers_file=headers)
    assert config.headers == {"authorization": "Bearer from-file", "x-tenant": "a"}


@pytest.mark.parametrize(
    "env, fix",
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "c:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT 'c:4318/v1"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http/protobuf"),
        ({"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"}, "give gzip or none"),
        ({"OTEL_EXPORTER_OTLP_TIMEOUT": "10s"}, "give milliseconds"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name"}, "is not key=value"),
        ({"OTEL_EXPORTER_OTLP_HEADERS": "=x"}, "is not key=value"),
    ],
)
def test_a_bad_variable_is_one_line_naming_it(env: dict[str, str], fix: str) -> None:
    opts = {} if "OTEL_EXPORTER_OTLP_ENDPOINT" in env else {"otlp_endpoint": "http://c:4318"}
    with pytest.raises(OtlpConfigError) as e:
        _resolve(env, **opts)
    assert fix in str(e.value) and "\n" not in str(e.value)
    assert next(iter(env)) in str(e.value)


def test_certificate_variables_are_read_and_loaded(tmp_path: Path) -> None:
    junk = tmp_path / "ca.pem"
    junk.write_text("not a certificate\n")
    env = {"OTEL_EXPORTER_OTLP_CERTIFICATE": str(junk)}
    with pytest.raises(OtlpConfigError, match=r"OTEL_EXPORTER_OTLP_CERTIFICATE .*ca\.pem: no PEM"):
        _resolve(env, otlp_endpoint="https://c:4318/v1/metrics")


def test_docs_say_what_make_venv_installs() -> None:
    """docs/otlp.md: "`make venv` already installs it (`.venv` is made with
    `-e '.[agent,dev,otlp]'`)": the Makefile's venv target says the same."""
    from tests.conftest import REPO

    makefile = (Path(REPO) / "Makefile").read_text()
    docs = (Path(REPO) / "docs" / "otlp.md").read_text()
    said = "`-e '.[agent,dev,otlp]'`"
    assert said in docs and f"-c constraints.txt {said[1:-1]}" in makefile
