"""The attack benches need the checkout's tests/attacks/: without one (an installed wheel),
each says so in one line and exits 2, and `bench all` skips them and goes on."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from kvsidecar.bench import checkout
from kvsidecar.bench.cli import bench


@pytest.fixture
def no_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkout, "available", lambda: False)


@pytest.mark.parametrize("command", ["labels", "hostile", "worsttarget", "gateway"])
def test_an_attack_bench_without_a_checkout_is_one_line_and_exit_2(
    no_checkout: None, command: str
) -> None:
    r = CliRunner().invoke(bench, [command, "--quick"])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and f"kvsidecar bench {command} needs a source checkout" in lines[0]


def test_bench_all_skips_them_and_goes_on(
    no_checkout: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[bool] = []

    @click.command(name="after")
    def after(quick: bool, out: str) -> None:  # needs no checkout: still runs
        ran.append(quick)

    kept = {name: bench.commands[name] for name in ("labels", "worsttarget", "all")}
    monkeypatch.setattr(bench, "commands", {**kept, "after": after})
    r = CliRunner().invoke(bench, ["all", "--quick"])
    assert r.exit_code == 0, r.output
    for name in ("labels", "worsttarget"):
        assert f"skipped: kvsidecar bench {name} needs a source checkout" in r.output
    assert ran == [True]
