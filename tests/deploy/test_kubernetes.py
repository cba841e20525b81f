"""deploy/kubernetes: schema-valid for Kubernetes 1.29+, native sidecar wired as documented."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from .support import DEPLOY, REPO, find_tool, require_tool, run

K8S = DEPLOY / "kubernetes"
# Native sidecars (initContainers[].restartPolicy) are on by default from 1.29.
VERSIONS = ["1.29.0", "1.31.0", "1.37.0"]
# CRDs kubernetes-validate has no schema for: checked structurally below.
CRD_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule", "InferencePool"}
SHM_DIR = "/run/kvsidecar"


def documents() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path, doc))
    return docs


def core_manifest_files() -> list[Path]:
    files = set()
    for path, doc in documents():
        if doc.get("kind") == "Kustomization" or doc.get("kind") in CRD_KINDS:
            continue
        files.add(path)
    return sorted(files)


# Engine-specific examples (vllm-example.yaml, ...) are applied on their own, outside the
# kustomization; they are validated like the rest and get the same pod checks.
STANDALONE = "vllm-*.yaml"


def one(kind: str) -> dict:
    standalone = set(K8S.glob(STANDALONE))
    found = [d for p, d in documents() if d.get("kind") == kind and p not in standalone]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def example_pods() -> list[tuple[str, dict]]:
    """The engine pods with the sidecar (not the endpoint picker's, vllm-epp.yaml)."""
    return [
        (p.name, d["spec"]["template"])
        for p, d in documents()
        if d.get("kind") == "Deployment"
        and any(
            c["name"] == "kvsidecar"
            for c in d["spec"]["template"]["spec"].get("initContainers", [])
        )
    ]


@pytest.fixture(scope="module", params=[name for name, _ in example_pods()])
def pod(request) -> dict:
    return dict(example_pods())[request.param]


@pytest.fixture(scope="module")
def sidecar(pod) -> dict:
    (c,) = [c for c in pod["spec"].get("initContainers", []) if c["name"] == "kvsidecar"]
    return c


@pytest.fixture(scope="module")
def engine(pod) -> dict:
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
    return c


def env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def kubernetes_validate() -> list[str]:
    pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (dev extra)"
    )
    tool = find_tool("kubernetes-validate")
    return [tool] if tool else [sys.executable, "-m", "kubernetes_validate"]


@pytest.mark.parametrize("version", VERSIONS)
def test_core_manifests_validate(version: str) -> None:
    files = core_manifest_files()
    assert files, "no core manifests found"
    proc = run([*kubernetes_validate(), "--strict", "-k", version, *map(str, files)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ERROR" not in proc.stdout + proc.stderr


def test_validator_rejects_sidecar_before_1_29() -> None:
    """The schemas are strict enough to see the sidecar field (absent in 1.27)."""
    proc = run([*kubernetes_validate(), "--strict", "-k", "1.27.0", str(K8S / "deployment.yaml")])
    assert proc.returncode != 0
    assert "restartPolicy" in proc.stdout + proc.stderr


def test_native_sidecar(sidecar: dict) -> None:
    # kubernetes-validate accepts any restartPolicy string; only Always makes
    # an init container a sidecar.
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["args"][0] == "serve"  # the image's ENTRYPOINT is kvsidecar
    ports = {p["name"]: p for p in sidecar["ports"]}
    assert ports["metrics"]["containerPort"] == 19440
    assert env(sidecar).get("KVSIDECAR_WEB_LISTEN_ADDRESS", ":19440").endswith(":19440")


def test_sidecar_can_never_hold_the_engine_back(sidecar: dict) -> None:
    """Issue 24 item 7, from Kubernetes' native-sidecar semantics: the engine starts once
    the sidecar is "started" (running, and its startupProbe passed if any), and the
    sidecar's readiness counts in the Pod's. So no startupProbe (it held the engine
    while the sidecar crash-looped), no readinessProbe, no livenessProbe (a restart makes
    it unready, and a flood on its port could trigger one), and a start-up error must
    not exit the process (tests/deploy/test_hold_on_error.py runs that case)."""
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe not in sidecar, f"{probe} on the sidecar can gate the engine"
    assert env(sidecar).get("KVSIDECAR_HOLD_ON_ERROR") == "true"


def test_shared_segment_volume(pod: dict, sidecar: dict, engine: dict) -> None:
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    side_mounts = [
        m for m in sidecar["volumeMounts"] if m["mountPath"] == env(sidecar)["KVSIDECAR_SHM_DIR"]
    ]
    assert len(side_mounts) == 1, "sidecar must mount KVSIDECAR_SHM_DIR"
    mount = side_mounts[0]
    assert mount["mountPath"] == SHM_DIR
    assert mount.get("readOnly") is True
    vol = volumes[mount["name"]]
    assert vol["emptyDir"]["medium"] == "Memory"
    assert vol["emptyDir"]["sizeLimit"] == "16Mi"
    # The engine (agent) writes the same volume at the same path.
    eng_mounts = [m for m in engine["volumeMounts"] if m["name"] == mount["name"]]
    assert len(eng_mounts) == 1
    assert eng_mounts[0]["mountPath"] == SHM_DIR == env(engine)["KVSIDECAR_SHM_DIR"]
    assert not eng_mounts[0].get("readOnly", False)
    # Not the pod's /dev/shm: NCCL and torch fill that one.
    assert SHM_DIR != "/dev/shm"


def test_security_context(pod: dict, sidecar: dict, engine: dict) -> None:
    spec = pod["spec"]
    psc = spec["securityContext"]
    assert isinstance(psc.get("fsGroup"), int), (
        "fsGroup makes the segments group-readable by the sidecar"
    )
    assert psc.get("runAsNonRoot") is True
    for key in ("hostIPC", "hostPID", "hostNetwork", "shareProcessNamespace"):
        assert not spec.get(key, False), key
    assert spec.get("automountServiceAccountToken") is False
    sc = sidecar["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert not sc["capabilities"].get("add")
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert not sc.get("privileged", False)
    # The sidecar only trusts segments of the engine's UID.
    assert env(sidecar)["KVSIDECAR_ALLOW_UID"].split() == [
        str(engine["securityContext"]["runAsUser"])
    ]
    assert sc["runAsUser"] != engine["securityContext"]["runAsUser"]


def test_sidecar_guaranteed_resources(sidecar: dict) -> None:
    res = sidecar["resources"]
    assert res["requests"] == res["limits"]
    assert set(res["limits"]) >= {"cpu", "memory"}


def test_podmonitor() -> None:
    """The PodMonitor is a CRD (no schema offline): check its shape by hand."""
    pod = one("Deployment")["spec"]["template"]  # the kustomization's own engine
    (sidecar,) = [c for c in pod["spec"]["initContainers"] if c["name"] == "kvsidecar"]
    pm = one("PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(pm) <= {"apiVersion", "kind", "metadata", "spec"}
    assert pm["metadata"]["name"]
    selector = pm["spec"]["selector"]["matchLabels"]
    labels = pod["metadata"]["labels"]
    assert selector and all(labels.get(k) == v for k, v in selector.items()), (
        "selector misses the engine pods"
    )
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in sidecar["ports"]}
    assert endpoint.get("path", "/metrics") == "/metrics"
    known = {
        "port",
        "path",
        "interval",
        "scrapeTimeout",
        "scheme",
        "relabelings",
        "metricRelabelings",
        "honorLabels",
        "tlsConfig",
        "basicAuth",
    }
    assert set(endpoint) <= known, f"unexpected endpoint fields {set(endpoint) - known}"


def test_kustomization_lists_every_manifest() -> None:
    kust = one("Kustomization")
    resources = set(kust["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    on_disk -= {p.name for p in K8S.glob(STANDALONE)}
    assert resources == on_disk


def test_kustomize_builds() -> None:
    kubectl = find_tool("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (only needed to render the kustomization)")
    proc = run([kubectl, "kustomize", str(K8S)])
    assert proc.returncode == 0, proc.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(proc.stdout) if d)
    assert kinds == ["Deployment", "PodMonitor"]


def test_yamllint() -> None:
    yamllint = require_tool("yamllint", "dev extra")
    targets = [DEPLOY / ".yamllint", DEPLOY / "kubernetes", DEPLOY / "prometheus"]
    proc = run(
        [yamllint, "--strict", "-c", str(DEPLOY / ".yamllint"), *map(str, targets)], cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _port_names(pod: dict) -> dict[str, int]:
    return {
        p["name"]: p["containerPort"]
        for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
        for p in c.get("ports", [])
    }


def test_the_gateway_port_is_served_and_never_scraped() -> None:
    """vllm-example.yaml serves the endpoint picker on a port named `gateway`; no shipped
    scrape config (PodMonitor, Prometheus' pod discovery, static targets) selects it: it
    repeats the engine's own vllm:* series, and scraping both doubles every sum."""
    pod = dict(example_pods())["vllm-example.yaml"]
    (sidecar,) = [c for c in pod["spec"]["initContainers"] if c["name"] == "kvsidecar"]
    ports = _port_names(pod)
    address = env(sidecar)["KVSIDECAR_GATEWAY_LISTEN_ADDRESS"]
    assert ports["gateway"] == int(address.rpartition(":")[2])
    assert pod["metadata"]["labels"]["llm-d.ai/engine-type"] == "vllm"
    # PodMonitor: only the metrics port.
    (endpoint,) = one("PodMonitor")["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" != "gateway"
    # Prometheus' own pod discovery: the keep rule, anchored as Prometheus anchors it.
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-kubernetes.yml").read_text())
    for job in config["scrape_configs"]:
        keeps = [r for r in job.get("relabel_configs", []) if r.get("action") == "keep"]
        assert keeps, f"{job['job_name']}: no keep rule: it would scrape every port"
        for rule in keeps:
            if "__meta_kubernetes_pod_container_port_name" not in rule["source_labels"]:
                continue
            sep = rule.get("separator", ";")
            values = {
                "__meta_kubernetes_pod_container_name": "kvsidecar",
                "__meta_kubernetes_pod_container_port_name": "gateway",
            }
            joined = sep.join(values.get(s, "") for s in rule["source_labels"])
            assert not re.fullmatch(rule["regex"], joined), (job["job_name"], rule)
            values["__meta_kubernetes_pod_container_port_name"] = "metrics"
            joined = sep.join(values.get(s, "") for s in rule["source_labels"])
            assert re.fullmatch(rule["regex"], joined), (job["job_name"], rule)
    # Static targets (systemd hosts): the main port, never the gateway's.
    static = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    gateway_port = str(ports["gateway"])
    for job in static["scrape_configs"]:
        for sc in job.get("static_configs", []):
            for target in sc["targets"]:
                assert target.rpartition(":")[2] != gateway_port, target
