"""An endpoint picker's reading of a metrics body, for tests (the picker itself is Go).

What llm-d-router's `metrics-data-source` and `core-metrics-extractor` do with a body
(../shared/research/gateway-epp.md, and the router's source/metrics and extractor/metrics):
parse it with Prometheus `expfmt`'s text parser (format 0.0.4, legacy name rules), where a
second HELP or TYPE line for a name, or a TYPE after that name's samples, fails the whole
body; then, per spec ("name" or "name{label=value,...}"), take the first series of the
family whose labels match (no timestamps: the first in exposition order wins) and read a
gauge's or counter's value, an untyped family reading 0. Block size and count come from
the labels of the cache-info family's first matching series.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

LEGACY_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
TYPES = ("counter", "gauge", "histogram", "summary", "untyped")
# The picker's --metrics-staleness-threshold default (llm-d-router; research/gateway-epp.md):
# it keeps routing on an endpoint's last good sample this long.
STALENESS_THRESHOLD_S = 2.0
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\\n]|\\.)*)"\s*(,|(?=\}))')
_VALUE = re.compile(r"\s+(\S+)(?:\s+(-?\d+))?\s*\Z")


class ParseError(ValueError):
    """The body fails as expfmt would fail it: the picker counts the poll as an error."""


@dataclass
class Family:
    name: str
    type: str = "untyped"
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)


def _unescape(v: str) -> str:
    return v.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")


def _sample(line: str, lineno: int) -> tuple[str, dict[str, str], float]:
    """name, labels, value of a sample line; quoted label values may hold any character."""
    m = _NAME.match(line)
    if m is None:
        raise ParseError(f"line {lineno}: not a sample: {line!r}")
    name, pos, labels = m.group(), m.end(), {}
    if line[pos : pos + 1] == "{":
        pos += 1
        while line[pos : pos + 1] != "}":
            lab = _LABEL.match(line, pos)
            if lab is None:
                raise ParseError(f"line {lineno}: bad label set in {line!r}")
            if lab.group(1) in labels:
                raise ParseError(f"line {lineno}: duplicate label {lab.group(1)!r}")
            labels[lab.group(1)] = _unescape(lab.group(2))
            pos = lab.end()
            if lab.group(3) == "," and line[pos : pos + 1].isspace():
                pos += len(line[pos:]) - len(line[pos:].lstrip())
        pos += 1
    v = _VALUE.match(line, pos)
    if v is None:
        raise ParseError(f"line {lineno}: not a sample: {line!r}")
    return name, labels, _value(v.group(1), lineno)


def _value(text: str, lineno: int) -> float:
    try:
        return float(text)  # NaN, +Inf, -Inf and Go's float forms
    except ValueError:
        raise ParseError(f"line {lineno}: bad value {text!r}") from None


def _family_of(name: str, families: dict[str, Family]) -> str:
    # A histogram's or summary's _bucket/_sum/_count samples belong to its family.
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and base in families and families[base].type in ("histogram", "summary"):
            return base
    return name


def parse(text: str) -> dict[str, Family]:
    """Families by name, in exposition order, or ParseError."""
    families: dict[str, Family] = {}
    helped: set[str] = set()
    typed: set[str] = set()
    sampled: set[str] = set()
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
                continue  # a comment
            kind, name = parts[1], parts[2]
            if not LEGACY_NAME.match(name):
                raise ParseError(f"line {lineno}: invalid metric name {name!r}")
            fam = families.setdefault(name, Family(name))
            if kind == "HELP":
                if name in helped:
                    raise ParseError(f"line {lineno}: second HELP line for metric name {name!r}")
                helped.add(name)
                continue
            if name in typed or name in sampled:
                raise ParseError(
                    f"line {lineno}: second TYPE line for metric name {name!r}, or TYPE "
                    "reported after samples"
                )
            kind_text = parts[3].strip() if len(parts) > 3 else ""
            if kind_text not in TYPES:
                raise ParseError(f"line {lineno}: unknown metric type {kind_text!r}")
            fam.type = kind_text
            typed.add(name)
            continue
        name, labels, val = _sample(line, lineno)
        base = _family_of(name, families)
        families.setdefault(base, Family(base)).samples.append((labels, val))
        sampled.add(base)
    return families


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """'name{a=b,c="d"}' -> ('name', {'a': 'b', 'c': 'd'}) as the picker's spec strings."""
    name, _, rest = spec.partition("{")
    matchers: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.rstrip("}").split(","))):
        k, _, v = part.partition("=")
        matchers[k.strip()] = v.strip().strip('"')
    return name.strip(), matchers


def first_match(families: dict[str, Family], spec: str) -> tuple[Family, dict[str, str], float]:
    name, matchers = parse_spec(spec)
    fam = families.get(name)
    if fam is None:
        raise KeyError(f"metric family {name!r} not found")
    for labels, value in fam.samples:
        if all(labels.get(k) == v for k, v in matchers.items()):
            return fam, labels, value
    raise KeyError(f"no series of {name!r} matches {matchers}")


def value(families: dict[str, Family], spec: str) -> float:
    """The picker's value for a spec: gauges and counters as is, anything else 0."""
    fam, _, v = first_match(families, spec)
    return v if fam.type in ("gauge", "counter") else 0.0


@dataclass(frozen=True)
class EngineSpec:
    """A picker engineConfigs entry (llm-d-router's built-ins for vllm and sglang)."""

    queued: str
    running: str
    kv_usage: str
    cache_info: str
    block_size_label: str = "block_size"
    num_blocks_label: str = "num_gpu_blocks"


ENGINES = {
    "vllm": EngineSpec(
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
    ),
    "sglang": EngineSpec(
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang:token_usage",
        "sglang:cache_config_info",
        "page_size",
        "num_pages",
    ),
    # Not built in: the engineConfigs entry docs/gateway.md gives for ATOM.
    "atom": EngineSpec(
        "atom:requests_waiting",
        "atom:requests_running",
        "atom:kv_cache_usage_ratio",
        "atom:cache_config_info",
    ),
}


def extract(text: str, engine: str = "vllm", labels: str = "") -> dict[str, float]:
    """What the picker stores for an endpoint: queue, running, usage, block size and count.
    `labels` (e.g. 'engine=0') narrows every spec, as a picker's spec may."""
    spec = ENGINES[engine]
    families = parse(text)
    sel = "{" + labels + "}" if labels else ""
    out = {
        "waiting": value(families, spec.queued + sel),
        "running": value(families, spec.running + sel),
        "usage": value(families, spec.kv_usage + sel),
    }
    _, info, _ = first_match(families, spec.cache_info + sel)
    out["block_size"] = float(info[spec.block_size_label])
    out["num_blocks"] = float(info[spec.num_blocks_label])
    for k, v in out.items():
        if math.isnan(v):
            raise ParseError(f"{k} is NaN")
    return out
