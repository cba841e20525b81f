"""The ``kvsidecar`` command line."""

from __future__ import annotations

import click


@click.group()
@click.version_option(package_name="kvsidecar")
def main() -> None:
    """kvsidecar: out-of-process KV-cache monitoring for LLM engines."""
