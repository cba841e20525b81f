"""Helpers to scrape a daemon over real HTTP and look samples up."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def fetch(
    url: str, headers: dict[str, str] | None = None, timeout: float = 5
) -> tuple[int, str, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, dict(s.labels), s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    ]


def value(text: str, name: str, **labels: str) -> float | None:
    """The single sample of `name` whose labels include `labels`, or None."""
    found = [v for n, lab, v in samples(text) if n == name and labels.items() <= lab.items()]
    assert len(found) <= 1, f"{name}{labels} matched {len(found)} samples"
    return found[0] if found else None
