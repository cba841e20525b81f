"""deploy/kubernetes' gateway deployment is whole and agrees with itself (issue 44, item 6):
the InferencePool, the endpoint picker (its config, RBAC, Deployment, Service) and the
NetworkPolicy, against vllm-example.yaml's pod and the sidecar's own flags. Schemas: the
core kinds are validated by test_kubernetes.py (kubernetes-validate); the InferencePool (a
CRD) and the picker's config are checked here field by field. Before: none of these files
existed, and the EndpointPickerConfig in docs/gateway.md had no scoring profile."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml

from kvsidecar.daemon.gateway import METRICS_PATH
from kvsidecar.daemon.gateway_body import render
from tests.daemon.gateway_writer import build
from tests.support import picker

from .support import DEPLOY, REPO

K8S = DEPLOY / "kubernetes"


def _docs(name: str) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all((K8S / name).read_text()) if d}


@pytest.fixture(scope="module")
def engine_pod() -> dict:
    return _docs("vllm-example.yaml")["Deployment"]["spec"]["template"]


@pytest.fixture(scope="module")
def epp() -> dict[str, dict]:
    return _docs("vllm-epp.yaml")


@pytest.fixture(scope="module")
def pool() -> dict:
    return _docs("vllm-inferencepool.yaml")["InferencePool"]


@pytest.fixture(scope="module")
def config(epp) -> dict:
    (text,) = epp["ConfigMap"]["data"].values()
    return yaml.safe_load(text)


def _ports(pod: dict, container: str | None = None) -> dict[str, int]:
    spec = pod["spec"]
    return {
        p["name"]: p["containerPort"]
        for c in spec.get("initContainers", []) + spec["containers"]
        if container is None or c["name"] == container
        for p in c.get("ports", [])
    }


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def _gateway_port(pod: dict) -> int:
    (sidecar,) = [c for c in pod["spec"]["initContainers"] if c["name"] == "kvsidecar"]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    port = int(env["KVSIDECAR_GATEWAY_LISTEN_ADDRESS"].rpartition(":")[2])
    assert _ports(pod, "kvsidecar")["gateway"] == port
    return port


def _plugin(config: dict, type_: str) -> dict:
    (p,) = [p for p in config["plugins"] if p["type"] == type_]
    return p.get("parameters", {})


def test_the_pool_selects_the_engine_and_names_its_picker(pool, engine_pod, epp) -> None:
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert _selects(pool["spec"]["selector"], engine_pod["metadata"]["labels"])
    # The pool's target port is the engine's inference port, never the sidecar's.
    assert [t["number"] for t in pool["spec"]["targetPorts"]] == [_ports(engine_pod)["http"]]
    ref = pool["spec"]["endpointPickerRef"]
    service = epp["Service"]
    assert (ref["kind"], ref["name"]) == ("Service", service["metadata"]["name"])
    (sport,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    epp_pod = epp["Deployment"]["spec"]["template"]
    assert _selects({"matchLabels": service["spec"]["selector"]}, epp_pod["metadata"]["labels"])
    assert _ports(epp_pod)[sport["targetPort"]] == sport["port"] == 9002


def test_the_picker_reads_its_config_for_this_pool(pool, epp) -> None:
    pod = epp["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    assert args[args.index("--pool-group") + 1] == pool["apiVersion"].split("/")[0]
    path = Path(args[args.index("--config-file") + 1])
    (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == epp["ConfigMap"]["metadata"]["name"]
    assert path.name in epp["ConfigMap"]["data"]
    assert pod["spec"]["serviceAccountName"] == epp["ServiceAccount"]["metadata"]["name"]
    binding = epp["RoleBinding"]
    assert binding["roleRef"]["name"] == epp["Role"]["metadata"]["name"]
    assert [s["name"] for s in binding["subjects"]] == [epp["ServiceAccount"]["metadata"]["name"]]
    watched = {(g, r) for rule in epp["Role"]["rules"] for g in rule["apiGroups"]
               for r in rule["resources"]}  # fmt: skip
    assert ("", "pods") in watched and ("inference.networking.k8s.io", "inferencepools") in watched


def test_the_config_polls_the_sidecar_and_scores(config, engine_pod) -> None:
    assert config["apiVersion"] == "llm-d.ai/v1alpha1"
    assert config["kind"] == "EndpointPickerConfig"
    source = _plugin(config, "metrics-data-source")
    assert source["port"] == _gateway_port(engine_pod)
    assert source["path"] == METRICS_PATH and source["scheme"] == "http"
    names = {p.get("name", p["type"]) for p in config["plugins"]}
    refs = [pl["pluginRef"] for prof in config["schedulingProfiles"] for pl in prof["plugins"]]
    refs += [s["pluginRef"] for s in config["dataLayer"]["sources"]]
    refs += [e["pluginRef"] for s in config["dataLayer"]["sources"] for e in s["extractors"]]
    assert set(refs) <= names, set(refs) - names
    (profile,) = config["schedulingProfiles"]
    weights = {pl["pluginRef"]: pl.get("weight") for pl in profile["plugins"]}
    # The two scorers that read what the sidecar serves are in the profile, weighted.
    assert weights["queue-scorer"] and weights["kv-cache-utilization-scorer"]
    assert "max-score-picker" in weights


@pytest.mark.parametrize("engine", ["vllm", "atom"])
def test_every_engine_spec_finds_its_value_in_a_gateway_body(config, engine) -> None:
    """An entry named like a built-in replaces it whole (llm-d-router factories.go): each
    spec it gives must resolve in the body the gateway renders for that engine."""
    (entry,) = [
        e for e in _plugin(config, "core-metrics-extractor")["engineConfigs"] if e["name"] == engine
    ]
    spec = picker.ENGINES[engine]
    assert entry["queuedRequestsSpec"] == spec.queued
    assert entry["runningRequestsSpec"] == spec.running
    assert entry["kvUsageSpec"] == spec.kv_usage
    assert entry["cacheInfoSpec"] == spec.cache_info
    assert not entry.get("loraSpec")  # the gateway serves no LoRA family
    body = render(build(engine, 0, "both", 12), time.monotonic_ns()).decode()
    families = picker.parse(body)
    assert picker.extract(body, engine)  # the four built-in specs, read as the picker does
    for custom in entry.get("customMetrics", []):
        assert picker.value(families, custom["metricSpec"]) >= 0


def test_the_network_policy_admits_only_the_picker_to_the_gateway_port(engine_pod, epp) -> None:
    policy = _docs("vllm-gateway-networkpolicy.yaml")["NetworkPolicy"]
    assert _selects(policy["spec"]["podSelector"], engine_pod["metadata"]["labels"])
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    epp_labels = epp["Deployment"]["spec"]["template"]["metadata"]["labels"]
    gateway = _gateway_port(engine_pod)

    def admitted(port: int, labels: dict) -> bool:
        for rule in policy["spec"]["ingress"]:
            if port not in [p["port"] for p in rule.get("ports", [])]:
                continue
            peers = rule.get("from")
            if peers is None or any(_selects(p["podSelector"], labels) for p in peers):
                return True
        return False

    assert admitted(gateway, epp_labels)
    assert not admitted(gateway, {"app.kubernetes.io/name": "anyone"})
    # Selecting the pod closes every port the policy does not open: the others stay open.
    for name, port in _ports(engine_pod).items():
        if port != gateway:
            assert admitted(port, {"app.kubernetes.io/name": "anyone"}), name


def test_the_documented_config_is_the_shipped_one(config) -> None:
    doc = (Path(REPO) / "docs" / "gateway.md").read_text()
    section = doc.split("### A complete EndpointPickerConfig", 1)[1]
    block = re.search(r"^```yaml\n(.*?)^```", section, re.M | re.S)
    assert block is not None
    assert yaml.safe_load(block.group(1)) == config
