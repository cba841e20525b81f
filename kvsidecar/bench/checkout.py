"""The benches that only a source checkout runs: the attack generators and audit benches
(hostile writers, floods, slow clients, descriptor exhaustion, costliest targets) are the
checkout's own tooling in ``tests/attacks/``, out of the wheel and the image, as vLLM keeps
its load generators out of its wheel. Their ``kvsidecar bench`` commands load them from the
checkout this package runs from; an installed package has none and says so (exit 2).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import click

REPO = Path(__file__).resolve().parents[2]
ATTACKS = REPO / "tests" / "attacks"


class NoCheckout(click.ClickException):
    """This package runs from no checkout with tests/attacks/: one line, exit 2 (`bench
    all` skips the command instead)."""

    exit_code = 2


def available() -> bool:
    """Whether this package runs from a checkout that has tests/attacks/."""
    return (ATTACKS / "__init__.py").is_file() and (REPO / "pyproject.toml").is_file()


def needs(command: str) -> str:
    """The one-line error for ``kvsidecar bench <command>`` without a checkout."""
    return (
        f"kvsidecar bench {command} needs a source checkout: its attack tools are in the "
        f"repository's tests/attacks/, not in the installed package; run it from a clone of "
        f"the repository (make venv, then .venv/bin/kvsidecar bench {command})"
    )


def load(name: str) -> ModuleType:
    """``tests.attacks.<name>`` from the checkout; without one, `NoCheckout`."""
    if not available():
        ctx = click.get_current_context(silent=True)
        raise NoCheckout(needs(ctx.info_name if ctx and ctx.info_name else name))
    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))
    module = importlib.import_module(f"tests.attacks.{name}")
    if not Path(module.__file__ or "").resolve().is_relative_to(ATTACKS):
        raise NoCheckout(f"tests.attacks.{name} came from {module.__file__}, not from {ATTACKS}")
    return module
