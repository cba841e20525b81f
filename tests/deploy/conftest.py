"""Fixtures for the deployment-artifact tests."""

from __future__ import annotations

import pytest

from .support import HERE


@pytest.fixture(scope="session")
def exported_metrics() -> set[str]:
    """tests/deploy/exported_metrics.txt: every sample name a scrape can contain."""
    lines = (HERE / "exported_metrics.txt").read_text().splitlines()
    return {ln.strip() for ln in lines if ln.strip()}
