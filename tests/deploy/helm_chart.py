"""deploy/helm/kvsidecar through Helm's own Go SDK (helm-python-sdk: `helm lint` and
`helm template` in a C library, no helm binary), for the chart tests and the docs'
`helm` commands."""

from __future__ import annotations

import copy
import functools
import json

import helm_python
import yaml

from .support import DEPLOY

CHART = DEPLOY / "helm" / "kvsidecar"
CHART_PATH = "deploy/helm/kvsidecar"
# The CRDs the chart may render (kubernetes-validate has no schema for them).
MONITOR_KINDS = {"PodMonitor", "ServiceMonitor"}


def default_values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def merged(base: dict, extra: dict) -> dict:
    """`extra` over `base`, maps merged key by key (how helm layers --set and -f)."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def unknown_keys(values: dict, known: dict, prefix: str = "") -> list[str]:
    """Keys of `values` that values.yaml lacks (helm would ignore them silently)."""
    out = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if key not in known:
            out.append(path)
        elif isinstance(value, dict) and isinstance(known[key], dict) and known[key]:
            out += unknown_keys(value, known[key], path + ".")
    return out


@functools.cache
def _render(values_json: str, name: str, namespace: str) -> tuple[dict, ...]:
    chart = helm_python.Chart.load(str(CHART))
    rendered = chart.render(values=json.loads(values_json), name=name, namespace=namespace)
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return tuple(docs)


def render(values: dict | None = None, name: str = "llm", namespace: str = "llm") -> list[dict]:
    """The chart's objects, as `helm template NAME CHART -n NAMESPACE` with `values`."""
    return copy.deepcopy(list(_render(json.dumps(values or {}, sort_keys=True), name, namespace)))


def lint(values: dict | None = None) -> dict:
    return helm_python.lint(str(CHART), values, strict=True)


def lint_problems(report: dict) -> list:
    """Errors and warnings (severity 2 and 3) of a lint report: what --strict fails on."""
    return report["errors"] + [m for m in report["messages"] if m["severity"] >= 2]


# `helm` subcommands the docs may print, and the flags each takes (with a value or not).
HELM_FLAGS = {
    "lint": {"--strict": False, "--set": True, "--values": True, "-f": True},
    "template": {"--set": True, "--values": True, "-f": True, "--namespace": True, "-n": True},
    "install": {
        "--set": True,
        "--values": True,
        "-f": True,
        "--namespace": True,
        "-n": True,
        "--create-namespace": False,
    },
}
HELM_FLAGS["upgrade"] = {**HELM_FLAGS["install"], "--install": False}


def check_helm_command(argv: list[str]) -> None:
    """A documented `helm` command, as helm would take it: a known subcommand and flags, the
    chart path, every `--set` key in values.yaml (helm ignores unknown ones silently), and
    the chart linted or rendered with those values by Helm's SDK."""
    assert len(argv) > 1 and argv[1] in HELM_FLAGS, f"{argv}: helm {HELM_FLAGS.keys()} only"
    flags = HELM_FLAGS[argv[1]]
    values: dict = {}
    positional = []
    words = iter(argv[2:])
    for word in words:
        flag, eq, inline = word.partition("=")
        if not flag.startswith("-"):
            positional.append(word)
            continue
        assert flag in flags, f"{argv}: helm {argv[1]} has no flag {flag} here"
        if not flags[flag]:
            continue
        value = inline if eq else next(words)
        if flag == "--set":
            values = merged(values, helm_python.parse_set_string(value))
        elif flag in ("--values", "-f"):
            values = merged(values, yaml.safe_load((DEPLOY.parent / value).read_text()))
    chart_args = [p for p in positional if p.startswith("deploy/")]
    assert chart_args == [CHART_PATH], f"{argv}: the chart is {CHART_PATH}"
    names = [p for p in positional if p != CHART_PATH]
    assert len(names) == (0 if argv[1] == "lint" else 1), f"{argv}: one release name"
    unknown = unknown_keys(values, default_values())
    assert not unknown, f"{argv}: no such value {unknown} in values.yaml"
    try:
        if argv[1] == "lint":
            assert not lint_problems(lint(values)), argv
        else:
            assert any(d["kind"] == "Deployment" for d in render(values, name=names[0])), argv
    except helm_python.HelmError as e:
        raise AssertionError(f"{argv}: {e}") from e
