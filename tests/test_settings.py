"""kvsidecar/settings.py is the one table of KVSIDECAR_* variables, and the docs follow it."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import click

from kvsidecar import settings
from tests.conftest import REPO

ROOT = Path(REPO)
BEGIN = "<!-- BEGIN settings table"
END = "<!-- END settings table -->"
NAME = re.compile(r"\bKVSIDECAR_[A-Z0-9_]*[A-Z0-9]")


def product_modules() -> list[Path]:
    return sorted(p for d in ("kvsidecar", "agent") for p in (ROOT / d).rglob("*.py"))


def test_operations_doc_table_is_current() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split(BEGIN, 1)[1].split("\n", 1)[1].split(END, 1)[0]
    assert section == settings.markdown(), (
        "regenerate the table in docs/operations.md: python -m kvsidecar.settings"
    )


def test_no_module_spells_a_name_outside_the_table() -> None:
    """Names come from the table (``settings.X.name``), never a ``"KVSIDECAR_...`` literal."""
    found = []
    for path in product_modules():
        if path == ROOT / "kvsidecar" / "settings.py":
            continue
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type == tokenize.STRING and re.match(r"[rbfuRBFU]*['\"]KVSIDECAR_", tok.string):
                found.append(f"{path.relative_to(ROOT)}:{tok.start[0]}: {tok.string[:40]}")
    assert not found, found


def test_every_name_mentioned_is_in_the_table() -> None:
    """Messages, docstrings, docs and deployment files name only variables that exist."""
    files = [*product_modules(), ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    files += [p for p in (ROOT / "deploy").rglob("*") if p.is_file()]
    unknown = set()
    for path in files:
        for name in NAME.findall(path.read_text(errors="replace")):
            if name not in settings.BY_NAME:
                unknown.add(f"{path.relative_to(ROOT)}: {name}")
    assert not unknown, sorted(unknown)


def test_names_are_unique_and_well_formed() -> None:
    names = [s.name for s in settings.ALL]
    assert len(names) == len(set(names))
    for s in settings.ALL:
        assert re.fullmatch(r"KVSIDECAR_[A-Z][A-Z0-9_]*", s.name), s.name
        assert s.meaning and s.used_by, s.name


def test_every_option_takes_name_and_default_from_the_table() -> None:
    from kvsidecar.cli.main import main

    def walk(cmd: click.Command):
        yield cmd
        if isinstance(cmd, click.Group):
            for sub in cmd.commands.values():
                yield from walk(sub)

    seen = set()
    for cmd in walk(main):
        for p in cmd.params:
            if not isinstance(p, click.Option) or not p.envvar:
                continue
            assert p.envvar in settings.BY_NAME, (cmd.name, p.envvar)
            assert p.show_envvar, (cmd.name, p.envvar)  # shown in --help
            s = settings.BY_NAME[p.envvar]
            seen.add(s.name)
            if s.type != "bool" and isinstance(p.default, (int, float, str, list, tuple)):
                default = list(p.default) if p.multiple else p.default
                expected = [s.default] if p.multiple else s.default
                assert default == expected, (cmd.name, p.envvar, p.default, s.default)
            if s.flag:
                assert s.flag in p.opts, (cmd.name, p.envvar, p.opts)
    flagged = {s.name for s in settings.ALL if s.flag}
    assert flagged <= seen, flagged - seen


def test_the_table_imports_light() -> None:
    code = (
        "import sys, kvsidecar.settings; "
        "print(sorted(m for m in ('click', 'msgspec', 'prometheus_client', 'torch') "
        "if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_used_by_matches_each_commands_options() -> None:
    """A setting's "used by" names exactly the commands that have its flag (issue #23: the
    table claimed --log.level/--log.format for dump/ls, which have neither)."""
    from kvsidecar.cli.main import main

    commands = {"serve": ["serve"], "dump/ls": ["dump", "ls"]}
    for s in settings.ALL:
        if not s.flag:
            continue
        for user, names in commands.items():
            for name in names:
                opts = {o for p in main.commands[name].params for o in p.opts}
                assert (s.flag in opts) == (user in s.used_by), (s.name, name)
