"""A fast renderer of the Prometheus text format (0.0.4) for metric families.

prometheus_client's ``generate_latest`` spends ~10 ms on the ~1,200 samples of
8 ranks x 4 pools; this renders the same families byte-for-byte compatible
(byte-for-byte: the tests compare it with ``generate_latest``) about 4x faster by caching
each distinct label set's rendered form. OpenMetrics output still goes
through prometheus_client.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bounded in bytes, not entries: a writer churning a 2 KB model_name made 65,536 entries
# cost ~220 MB. Each entry holds its key's strings and the rendered text (about the
# same characters twice) plus ~200 bytes of tuple and dict overhead.
LABEL_CACHE_MAX_BYTES = 4 * 1024 * 1024
_ENTRY_OVERHEAD = 200
_label_cache: dict[tuple, str] = {}
_label_cache_bytes = 0


def label_cache_bytes() -> int:
    """Approximate bytes held by the label cache (never above LABEL_CACHE_MAX_BYTES)."""
    return _label_cache_bytes


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(labels: dict[str, str]) -> str:
    global _label_cache_bytes
    key = tuple(labels.items())
    text = _label_cache.get(key)
    if text is None:
        if not labels:
            text = ""
        else:
            text = "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(key)) + "}"
        cost = 2 * len(text) + _ENTRY_OVERHEAD
        if cost > LABEL_CACHE_MAX_BYTES // 64:
            return text  # too big to be worth keeping
        if _label_cache_bytes + cost > LABEL_CACHE_MAX_BYTES:
            # Live label sets churn only with targets: a reset is cheap and bounds memory.
            _label_cache.clear()
            _label_cache_bytes = 0
        _label_cache[key] = text
        _label_cache_bytes += cost
    return text


def render_text(families: Iterable[Metric]) -> bytes:
    # Encoded family by family: one string of the whole body is 4 bytes a character once a
    # label holds an emoji (a 3 MB body was a 7 MB string, and its lines as much again).
    parts: list[bytes] = []
    for fam in families:
        out: list[str] = []
        append = out.append
        mtype = fam.type
        name = fam.name
        if mtype == "counter":
            name += "_total"
        elif mtype == "info":
            name += "_info"
            mtype = "gauge"
        elif mtype in ("stateset", "gaugehistogram", "unknown"):
            mtype = {"stateset": "gauge", "gaugehistogram": "histogram"}.get(mtype, "untyped")
        help_text = fam.documentation.replace("\\", r"\\").replace("\n", r"\n")
        append(f"# HELP {name} {help_text}\n# TYPE {name} {mtype}\n")
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            append(f"{s.name}{_labels(s.labels)} {floatToGoString(s.value)}\n")
        parts.append("".join(out).encode())
    return b"".join(parts)
