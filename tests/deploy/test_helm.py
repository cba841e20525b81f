"""deploy/helm/kvsidecar (issue 45 item 2): `helm lint --strict` and `helm template` through
Helm's own Go SDK (helm-python-sdk, dev extra: there is no helm binary to install here);
the rendered pod gets deploy/kubernetes' pod checks and kubernetes-validate; the optional
blocks render when on and are absent when off; the README's values table is values.yaml's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import helm_python
import pytest
import yaml

from . import test_kubernetes as manifests
from .helm_chart import (
    CHART,
    MONITOR_KINDS,
    default_values,
    lint,
    lint_problems,
    render,
    unknown_keys,
)
from .support import DEPLOY, REPO, require_tool, run

EXTRA_ARGS = ["--log.format=json", "--poll-interval=0.5"]
ALL_ON = {
    "gateway": {"enabled": True, "role": "decode", "tlsSecret": "kvsidecar-gateway-tls"},
    "monitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "extraArgs": EXTRA_ARGS,
    "extraEnv": [{"name": "KVSIDECAR_LOG_FORMAT", "value": "json"}],
    "podLabels": {"llm-d.ai/engine-type": "vllm"},
    "engine": {
        "args": ["--model", "Qwen/Qwen2.5-1.5B-Instruct"],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}},
    },
}
CASES = {
    "defaults": {},
    "all-on": ALL_ON,
    "servicemonitor": {**ALL_ON, "monitor": {"enabled": True, "kind": "ServiceMonitor"}},
}


def objects(case: str) -> list[dict]:
    return render(CASES[case])


def kind(docs: list[dict], name: str) -> list[dict]:
    return [d for d in docs if d["kind"] == name]


def the_pod(docs: list[dict]) -> dict:
    (deployment,) = kind(docs, "Deployment")
    return deployment["spec"]["template"]


def the_sidecar(docs: list[dict]) -> dict:
    (c,) = [c for c in the_pod(docs)["spec"]["initContainers"] if c["name"] == "kvsidecar"]
    return c


# deploy/kubernetes' pod checks, run here on the rendered pod of each case (these fixtures
# replace that module's).
@pytest.fixture(scope="module", params=sorted(CASES))
def pod(request) -> dict:
    return the_pod(objects(request.param))


@pytest.fixture(scope="module")
def sidecar(pod) -> dict:
    (c,) = [c for c in pod["spec"]["initContainers"] if c["name"] == "kvsidecar"]
    return c


@pytest.fixture(scope="module")
def engine(pod) -> dict:
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
    return c


test_native_sidecar = manifests.test_native_sidecar
test_sidecar_can_never_hold_the_engine_back = manifests.test_sidecar_can_never_hold_the_engine_back
test_shared_segment_volume = manifests.test_shared_segment_volume
test_security_context = manifests.test_security_context
test_sidecar_guaranteed_resources = manifests.test_sidecar_guaranteed_resources


@pytest.mark.parametrize("case", sorted(CASES))
def test_lint_strict(case: str) -> None:
    report = lint(CASES[case])
    assert report["total_charts_linted"] == 1
    assert not lint_problems(report), report


def test_lint_strict_sees_a_broken_chart(tmp_path) -> None:
    """The lint above can fail: a template referring to a missing one is an error."""
    broken = tmp_path / "kvsidecar"
    helm_python.Chart.load(str(CHART)).save_dir(str(tmp_path))
    (broken / "templates" / "broken.yaml").write_text('{{ include "no-such-template" . }}\n')
    assert lint_problems(helm_python.lint(str(broken), None, strict=True))


@pytest.mark.parametrize("version", manifests.VERSIONS)
def test_rendered_objects_validate(version: str, tmp_path) -> None:
    files = []
    for case in sorted(CASES):
        core = [d for d in objects(case) if d["kind"] not in MONITOR_KINDS]
        assert {d["kind"] for d in core} == {"Deployment", "Service"}, case
        path = tmp_path / f"{case}.yaml"
        path.write_text(yaml.safe_dump_all(core))
        files.append(str(path))
    proc = run([*manifests.kubernetes_validate(), "--strict", "-k", version, *files])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ERROR" not in proc.stdout + proc.stderr


def test_defaults_are_the_shipped_manifest() -> None:
    """With its defaults the chart's sidecar, volume and pod security are those of
    deploy/kubernetes/deployment.yaml (the reviewed manifest), field for field."""
    shipped = manifests.one("Deployment")["spec"]["template"]["spec"]
    rendered = the_pod(objects("defaults"))["spec"]
    (shipped_sidecar,) = shipped["initContainers"]
    rendered_sidecar = the_sidecar(objects("defaults"))
    for key in ("restartPolicy", "args", "env", "ports", "resources", "securityContext"):
        assert rendered_sidecar[key] == shipped_sidecar[key], key
    assert rendered_sidecar["volumeMounts"] == shipped_sidecar["volumeMounts"]
    assert rendered["securityContext"] == shipped["securityContext"]
    assert rendered["volumes"] == shipped["volumes"]
    for key in ("automountServiceAccountToken", "enableServiceLinks"):
        assert rendered[key] == shipped[key], key


def test_engine_shares_the_segments_and_has_its_own_dev_shm() -> None:
    pod = the_pod(objects("defaults"))
    volumes = {v["name"]: v["emptyDir"] for v in pod["spec"]["volumes"]}
    (engine,) = pod["spec"]["containers"]
    mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert mounts["/run/kvsidecar"] == "kvsidecar-shm" != mounts["/dev/shm"]


def test_resources_as_documented() -> None:
    """The sidecar's resources are the ones docs/operations.md states (requests == limits)."""
    text = (REPO / "docs" / "operations.md").read_text()
    m = re.search(r"\*\*requests == limits\*\* \((\w+) CPU, (\w+)\)", text)
    assert m, "docs/operations.md no longer states the sidecar's resources"
    res = the_sidecar(objects("defaults"))["resources"]
    assert res["requests"] == res["limits"] == {"cpu": m.group(1), "memory": m.group(2)}


def test_optional_blocks_are_off_by_default() -> None:
    docs = objects("defaults")
    assert not [d for d in docs if d["kind"] in MONITOR_KINDS], "the CRDs may be absent"
    sidecar = the_sidecar(docs)
    assert [p["name"] for p in sidecar["ports"]] == ["metrics"]
    assert "KVSIDECAR_GATEWAY_LISTEN_ADDRESS" not in manifests.env(sidecar)
    assert sidecar["args"] == ["serve"]
    (service,) = kind(docs, "Service")
    assert [p["name"] for p in service["spec"]["ports"]] == ["http"]


def test_extra_args_reach_serve_and_parse() -> None:
    from kvsidecar.cli.main import main

    args = the_sidecar(objects("all-on"))["args"]
    assert args == ["serve", *EXTRA_ARGS]
    main.commands["serve"].make_context("serve", args[1:])  # a UsageError if not serve's


def test_gateway_port_served_and_never_scraped() -> None:
    docs = objects("all-on")
    sidecar = the_sidecar(docs)
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports == {"metrics": 19440, "gateway": 19450}
    assert manifests.env(sidecar)["KVSIDECAR_GATEWAY_LISTEN_ADDRESS"] == ":19450"
    (monitor,) = kind(docs, "PodMonitor")
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    # Sized for the picker's polls (docs/gateway.md "The cost of a poll, and sizing").
    res = sidecar["resources"]
    assert res["requests"]["cpu"] == res["limits"]["cpu"] == "100m"
    assert the_sidecar(objects("defaults"))["resources"]["limits"]["cpu"] == "50m"


def test_gateway_tls_secret_is_mounted_where_serve_reads_it(monkeypatch) -> None:
    """gateway.tlsSecret: the Secret mounted read-only in the sidecar, and
    KVSIDECAR_GATEWAY_WEB_CONFIG_FILE naming web-config.yml inside that mount; serve takes
    the rendered gateway variables."""
    from kvsidecar.cli.main import main

    docs = objects("all-on")
    sidecar, pod = the_sidecar(docs), the_pod(docs)
    env = manifests.env(sidecar)
    path = Path(env["KVSIDECAR_GATEWAY_WEB_CONFIG_FILE"])
    (mount,) = [m for m in sidecar["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    assert mount["readOnly"] is True and path.name == "web-config.yml"
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "kvsidecar-gateway-tls"
    for name, value in env.items():
        if name.startswith("KVSIDECAR_GATEWAY_"):
            monkeypatch.setenv(name, value)
    params = main.commands["serve"].make_context("serve", []).params
    assert params["gateway_roles"] == ("decode",)
    assert params["gateway_web_config_file"] == str(path)
    assert "KVSIDECAR_GATEWAY_WEB_CONFIG_FILE" not in manifests.env(
        the_sidecar(objects("defaults"))
    )


@pytest.mark.parametrize("case", ["all-on", "servicemonitor"])
def test_monitor_selects_the_sidecar_metrics_port(case: str) -> None:
    docs = objects(case)
    (monitor,) = [d for d in docs if d["kind"] in MONITOR_KINDS]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    pod_labels = the_pod(docs)["metadata"]["labels"]
    assert all(pod_labels.get(k) == v for k, v in selector.items()), "misses the engine pods"
    endpoints = monitor["spec"].get("podMetricsEndpoints") or monitor["spec"]["endpoints"]
    (endpoint,) = endpoints
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    relabel = {r["targetLabel"]: r.get("replacement") for r in endpoint["relabelings"]}
    assert relabel["job"] == "kvsidecar", "the KvsidecarDown rule selects job=~kvsidecar.*"
    metrics_port = {p["name"]: p["containerPort"] for p in the_sidecar(docs)["ports"]}["metrics"]
    (service,) = kind(docs, "Service")
    if monitor["kind"] == "ServiceMonitor":
        svc_labels = service["metadata"]["labels"]
        assert all(svc_labels.get(k) == v for k, v in selector.items()), "misses the Service"
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        assert ports["metrics"]["targetPort"] == metrics_port
    else:
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert "metrics" not in {p["name"] for p in service["spec"]["ports"]}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"runAsUser": 1000}, "must differ from engine.runAsUser"),
        ({"monitor": {"enabled": True, "kind": "Probe"}}, "neither PodMonitor nor"),
        (
            {"monitor": {"enabled": True, "kind": "ServiceMonitor"}, "service": {"enabled": False}},
            "needs service.enabled",
        ),
    ],
)
def test_bad_values_fail_with_a_reason(values: dict, message: str) -> None:
    with pytest.raises(helm_python.HelmError, match=message):
        render(values)


def readme_values() -> dict[str, str]:
    """The README's values table: `value` -> its default column."""
    text = (CHART / "README.md").read_text()
    section = text.split("## Values", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w.]+)` \| ([^|]*) \|", section, re.M)
    assert len(rows) > 20, rows
    return {key: default.strip() for key, default in rows}


def leaf_paths(values: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in values.items():
        if isinstance(value, dict) and value:
            out += leaf_paths(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def literal(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if value in ("", [], {}) else str(value)


def test_readme_documents_every_value() -> None:
    """Every value in values.yaml has its row (itself or a documented parent, as
    `resources`), every row is a value, and a row's literal default is values.yaml's."""
    values = default_values()
    rows = readme_values()
    assert len(rows) == len(set(rows))
    for path in leaf_paths(values):
        covering = [r for r in rows if path == r or path.startswith(r + ".")]
        assert len(covering) == 1, f"{path}: documented by {covering}"
    for row, default in rows.items():
        node = values
        for part in row.split("."):
            assert isinstance(node, dict) and part in node, f"README row {row}: no such value"
            node = node[part]
        m = re.fullmatch(r"`([^`]*)`", default)
        if m:
            assert m.group(1) == literal(node), f"{row}: README {default}, values.yaml {node!r}"


def test_unknown_value_keys_are_found() -> None:
    """What the docs check relies on: a misspelt --set key is reported."""
    assert unknown_keys({"gateway": {"enable": True}}, default_values()) == ["gateway.enable"]
    assert unknown_keys({"monitor": {"labels": {"release": "x"}}}, default_values()) == []


def test_yamllint() -> None:
    yamllint = require_tool("yamllint", "dev extra")
    files = [CHART / "Chart.yaml", CHART / "values.yaml"]
    proc = run([yamllint, "--strict", "-c", str(DEPLOY / ".yamllint"), *map(str, files)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
