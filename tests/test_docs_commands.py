"""Every shell command in README.md and docs/*.md runs as printed (issue #13, item 3).

Each command of each ``sh``/``bash``/``console`` block is split into simple commands and
checked against what it names: our CLI (parsed by the real click command, so an unknown
option or a bad value fails), ``python -m`` modules (each flag must be in the module's
``--help``), make targets, repository paths, the default port. Commands for other tools
(systemctl, kubectl, docker, ...) must be on a known list, so a new kind of command is
looked at rather than passed. The cheap ones are run for real: ``--version``, shell
completion, ``ls``/``dump`` on an empty directory.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

from kvsidecar.cli.main import main
from tests.conftest import REPO
from tests.deploy.helm_chart import check_helm_command

DOCS = [Path(REPO) / "README.md", *sorted((Path(REPO) / "docs").glob("*.md"))]
VENV_BIN = Path(sys.executable).parent

# Programs that are not ours, documented for the host they run on (checked for the paths
# and ports they name, not run).
EXTERNAL = {
    "systemctl", "systemd-tmpfiles", "useradd", "install", "ln", "echo", "id", "ls", "curl",
    "grep", "docker", "kubectl", "journalctl", "df", "getent", "cut", "promtool", "eval",
    "mkdir", "man",
}  # fmt: skip
# A command starting with one of these must not be used: kvsidecar is on no index, and
# the system Python has no kvsidecar.
FORBIDDEN = {"pip", "pip3", "python", "python3"}


def shell_blocks(text: str) -> list[str]:
    return re.findall(r"^```(?:sh|bash|console)\n(.*?)^```", text, re.M | re.S)


def commands(block: str) -> list[str]:
    """Lines of a block, continuation lines joined; ``$ `` prompts in console blocks."""
    lines = block.splitlines()
    if any(ln.startswith("$ ") for ln in lines):
        lines = [ln[2:] for ln in lines if ln.startswith("$ ")]
    out, cur = [], ""
    for ln in lines:
        cur += ln
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        if cur.strip() and not cur.lstrip().startswith("#"):
            out.append(cur.strip())
        cur = ""
    return out


def simple_commands(line: str) -> list[list[str]]:
    """``a && b | c; d`` -> [[a...], [b...], [c...], [d...]], comments and ``VAR=x``
    prefixes dropped; ``$(...)`` and ``>`` redirections kept as words."""
    lex = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
    lex.whitespace_split = True
    lex.commenters = "#"
    parts: list[list[str]] = [[]]
    redirect = False
    for tok in lex:
        if tok in ("|", "&&", "||", ";", "&"):
            parts.append([])
        elif tok in (">", ">>", "<"):
            redirect = True
        elif redirect:
            redirect = False  # the file name of a redirection is not an argument
        else:
            parts[-1].append(tok)
    out = []
    for p in parts:
        while p and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", p[0]):
            p = p[1:]
        if p:
            out.append(p)
    return out


def all_commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        lines = [ln for block in shell_blocks(text) for ln in commands(block)]
        # Inline commands meant to be pasted: `.venv/bin/...` in running text.
        lines += re.findall(r"`(\.venv/bin/[^`]+)`", text)
        for line in lines:
            for argv in simple_commands(line):
                found.append((doc.name, line, argv))
    return found


@functools.cache
def module_help(module: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode == 0, f"python -m {module} --help: {r.stderr[-2000:]}"
    return r.stdout


@functools.cache
def script_help(script: str) -> str:
    r = subprocess.run(
        ["bash", script, "--help"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert r.returncode == 0, f"bash {script} --help: {r.stderr[-2000:]}"
    return r.stdout


def check_cli(args: list[str]) -> None:
    """Parse (not run) ``kvsidecar args`` with the real click commands."""
    cmd: click.Command = main
    name = "kvsidecar"
    while isinstance(cmd, click.Group) and args and not args[0].startswith("-"):
        sub = cmd.commands.get(args[0])
        assert sub is not None, f"no command {name} {args[0]}"
        cmd, name, args = sub, f"{name} {args[0]}", args[1:]
    if "--help-man" in args:  # cheap: run it, as a man page reader would get it
        path = name.split()[1:]
        r = _run([str(VENV_BIN / "kvsidecar"), *path, "--help-man"])
        assert r.returncode == 0 and r.stdout.startswith(".TH "), (name, r.stderr)
        return
    if "--help" in args or "--version" in args or isinstance(cmd, click.Group):
        return
    cmd.make_context(name, list(args))  # raises UsageError on a bad option or value


def default_port() -> int:
    """The port `serve` listens on by default, as its option says."""
    opt = next(p for p in main.commands["serve"].params if p.name == "listen_addresses")
    return int(next(iter(opt.default)).rpartition(":")[2])


def check_paths(argv: list[str]) -> None:
    port_default = default_port()
    for a in argv:
        m = re.match(r"(deploy/[\w./-]+|docs/[\w./-]+|tests/[\w./-]+)", a)
        if m and "*" not in a:
            assert (Path(REPO) / m.group(1)).exists(), f"{a}: no such file in the repository"
        for port in re.findall(r"localhost:(\d+)", a):
            assert int(port) == port_default, f"{a}: the default port is {port_default}"


def makefile_targets() -> set[str]:
    text = (Path(REPO) / "Makefile").read_text()
    return set(re.findall(r"^([\w.-]+):", text, re.M))


def check_extras(extras: str | None) -> None:
    if extras:
        text = (Path(REPO) / "pyproject.toml").read_text()
        section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
        known = set(re.findall(r"^(\w+) = ", section, re.M))
        assert set(extras.split(",")) <= known, f"no extra {extras} in pyproject.toml"


def check_line(line: str) -> None:
    """What shlex hides: a glob in quotes never expands, and an unquoted `*.whl[x]` is a
    bracket glob that matches nothing (pip then gets the `*`)."""
    for word in re.findall(r"'[^']*'|\"[^\"]*\"", line):
        inner = re.sub(r"\$\([^)]*\)", "", word)  # $(...) expands inside double quotes
        assert "*" not in inner, f"{line}: the quoted glob {word} reaches the program as is"
    assert not re.search(
        r"(?<![\w)])[\w./-]*\*[\w.-]*\[", line.replace("$(", "").replace(")[", " ")
    ), f"{line}: an unquoted glob followed by [ is a bracket expression"


def check(argv: list[str]) -> None:
    prog = argv[0]
    check_paths(argv)
    if prog in ("kvsidecar", ".venv/bin/kvsidecar"):
        check_cli(argv[1:])
    elif prog in (".venv/bin/python", "/opt/kvsidecar/bin/python") or re.fullmatch(
        r"/opt/[\w-]+/bin/python", prog
    ):  # ours, or an engine's environment with kvsidecar installed (ATOM's)
        assert argv[1] == "-m", argv
        module, flags = argv[2], [a.split("=")[0] for a in argv[3:] if a.startswith("--")]
        if module == "kvsidecar":
            check_cli(argv[3:])
            return
        text = module_help(module)
        missing = [f for f in flags if f not in text]
        assert not missing, f"python -m {module}: {missing} not in its --help"
    elif prog == "bash" and len(argv) > 1 and not argv[1].startswith("-"):
        # Our scripts, run from the clone's root: the script exists; a .sh script's flags
        # are in its --help (it runs, so its option parser is checked too).
        script = Path(REPO) / argv[1]
        assert script.is_file(), f"{argv[1]}: no such script in the repository"
        if script.suffix == ".sh":
            flags = [a for a in argv[2:] if a.startswith("--")]
            missing = [f for f in flags if f not in script_help(argv[1])]
            assert not missing, f"bash {argv[1]}: {missing} not in its --help"
        elif argv[1] == ".ci/engine-env":
            assert (Path(REPO) / ".ci" / "locks" / f"{argv[2]}.txt").is_file(), argv
    elif prog == "make":
        targets = [a for a in argv[1:] if "=" not in a and not a.startswith("-")]
        unknown = set(targets) - makefile_targets()
        assert not unknown, f"make: no target {sorted(unknown)}"
    elif re.fullmatch(r"/opt/[\w-]+/bin/pip", prog):  # our venv, or an engine's (vLLM's)
        assert argv[1] == "install" and len(argv) == 3, argv
        # The wheel, or the wheel with extras: "$(echo dist/...*.whl)[extra]" (the shell
        # expands the glob inside $(...); quoted as a whole it would reach pip unexpanded).
        m = re.fullmatch(
            r"(?:\$\(echo (dist/kvsidecar-\S+\.whl)\)\[([\w,]+)\])|(dist/kvsidecar-.*)", argv[2]
        )
        assert m, f'{argv}: install dist/kvsidecar-<version>-*.whl, or "$(echo <it>)[extra]"'
        check_extras(m.group(2))
    elif prog == ".venv/bin/pip":  # a clone's venv: only ever the editable install, kept
        m = re.fullmatch(r"\.\[([\w,]+)\]", argv[-1])
        assert argv[1:3] == ["install", "-e"] and len(argv) == 4 and m, (
            f"{argv}: .venv/bin/pip install -e '.[extra]' (without -e, pip replaces the "
            "editable install with a copy)"
        )
        check_extras(m.group(1))
    elif prog == "helm":  # linted or rendered with its values by Helm's own SDK
        check_helm_command(argv)
    elif prog == "python3" and argv[1:3] == ["-m", "venv"]:
        pass  # creating a venv with the system Python is fine
    else:
        assert prog not in FORBIDDEN, f"{' '.join(argv)}: use .venv/bin/... (see README)"
        assert prog in EXTERNAL, f"unknown command {prog!r}: add a check for it"


def test_every_documented_command_checks_out() -> None:
    found = all_commands()
    assert len(found) > 40, len(found)
    failures = []
    for doc, line, argv in found:
        try:
            if argv[0].endswith("/pip"):
                check_line(line)
            check(argv)
        except (AssertionError, click.ClickException) as e:
            failures.append(f"{doc}: {line}\n    {e}")
    assert not failures, "\n".join(failures)


def test_checker_catches_what_the_issue_found() -> None:
    """The checker fails the commands item 3 reported (and a typo'd option)."""
    bad = [
        "dump --allow-uid 1000",  # fine now: must pass
        "python -m kvsidecar.agent.demo --pd",
        "pip install kvsidecar",
        "kvsidecar dump --no-such-option",
        "kvsidecar serve --log.level verbose",
        "curl -s localhost:9400/metrics",
        # issue 45: a quoted glob, a replaced editable install, a bracket glob
        "/opt/kvsidecar/bin/pip install 'dist/kvsidecar-0.1.0-*.whl[otlp]'",
        ".venv/bin/pip install '.[otlp]'",
        "/opt/kvsidecar/bin/pip install dist/kvsidecar-0.1.0-*.whl[otlp]",
        ".venv/bin/pip install -e '.[nosuchextra]'",
        # issue 45 item 2: a misspelt value (helm ignores it), values the chart refuses, a
        # flag helm install lacks, a chart that is not ours
        "helm install llm deploy/helm/kvsidecar --set gateway.enable=true",
        "helm template llm deploy/helm/kvsidecar --set runAsUser=1000",
        "helm install llm deploy/helm/kvsidecar --wait-for-it",
        "helm install llm deploy/kubernetes",
    ]
    ok = ["kvsidecar " + bad[0]]
    for line in ok:
        for argv in simple_commands(line):
            check(argv)
    for line in bad[1:]:
        with pytest.raises((AssertionError, click.ClickException)):
            for argv in simple_commands(line):
                if argv[0].endswith("/pip"):
                    check_line(line)
                check(argv)


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSIDECAR_")}
    return subprocess.run(
        args, capture_output=True, text=True, timeout=60, cwd=REPO, env={**env, **kw}
    )


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_documented_shell_completion_works(shell: str) -> None:
    text = (Path(REPO) / "docs" / "operations.md").read_text()
    assert f"_KVSIDECAR_COMPLETE={shell}_source kvsidecar" in text
    r = _run([str(VENV_BIN / "kvsidecar")], _KVSIDECAR_COMPLETE=f"{shell}_source")
    assert r.returncode == 0 and "kvsidecar" in r.stdout and len(r.stdout) > 100, r


def test_version_on_every_command() -> None:
    def walk(cmd: click.Command, path: list[str]):
        yield path
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                yield from walk(sub, [*path, name])

    paths = list(walk(main, []))
    assert ["serve"] in paths and ["bench", "torn"] in paths
    for path in paths:
        r = _run([str(VENV_BIN / "kvsidecar"), *path, "--version"])
        assert r.returncode == 0 and "version 0." in r.stdout, (path, r.stdout, r.stderr)


def test_help_shows_env_twins() -> None:
    r = _run([str(VENV_BIN / "kvsidecar"), "serve", "--help"])
    text = re.sub(r"\s+", " ", r.stdout)
    for env in ("KVSIDECAR_SHM_DIR", "KVSIDECAR_ALLOW_UID", "KVSIDECAR_LOG_FORMAT"):
        assert f"env var: {env}" in text, env
    r = _run([str(VENV_BIN / "kvsidecar"), "dump", "--help"])
    assert "KVSIDECAR_ALLOW_UID" in r.stdout


def test_exit_codes_are_documented() -> None:
    text = (Path(REPO) / "docs" / "operations.md").read_text()
    section = text.split("### Exit codes", 1)[1].split("###", 1)[0]
    for code in ("**0**", "**1**", "**2**"):
        assert code in section


def test_make_dist_builds_an_installable_wheel_and_sdist(tmp_path: Path) -> None:
    r = subprocess.run(["make", "dist"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    dist = Path(REPO) / "dist"
    wheels = list(dist.glob("kvsidecar-*.whl"))
    sdists = list(dist.glob("kvsidecar-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, os.listdir(dist)
    # The documented install, into a target of its own (dependencies from this venv).
    target = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, wheels[0]],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    # docs/otlp.md's wheel line with the extra, run by the shell as printed (issue 45: the
    # quoted glob it had reached pip unexpanded); no dependencies: they are this venv's.
    otlp = (Path(REPO) / "docs" / "otlp.md").read_text()
    line = next(
        ln for b in shell_blocks(otlp) for ln in commands(b) if "[otlp]" in ln and "whl" in ln
    )
    pip = f"{sys.executable} -m pip install -q --no-deps --target {tmp_path / 'otlp'}"
    r = subprocess.run(
        ["bash", "-c", line.replace("/opt/kvsidecar/bin/pip install", pip, 1)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0 and (tmp_path / "otlp" / "kvsidecar").is_dir(), (line, r.stderr)
    r = subprocess.run(
        [sys.executable, "-c", "import kvsidecar, sys; print(kvsidecar.__file__); "
         "from kvsidecar.cli.main import main; sys.argv=['kvsidecar','--version']; main()"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(target)},
    )  # fmt: skip
    assert r.returncode == 0 and str(target) in r.stdout and "version" in r.stdout, r
    # The wheel carries its source revision (there is no .git beside an installed copy).
    head = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    assert f"(revision {head})" in r.stdout, r.stdout
    # And its build date (the commit's, as --version in the checkout says it).
    date = subprocess.run(
        ["git", "log", "-1", "--date=format-local:%Y%m%d-%H:%M:%S", "--format=%cd"],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "TZ": "UTC"},
    ).stdout.strip()  # fmt: skip
    assert f"build date:       {date}\n" in r.stdout, r.stdout
    for product in ("REVISION", "BUILD_DATE"):
        assert not (Path(REPO) / "kvsidecar" / product).exists(), "make dist leaves no file"
    assert (target / "kvsidecar" / "agent" / "__init__.py").exists()
    assert list((target / "kvsidecar" / "protocol").glob("_seqlock*.so"))
    assert list((target / "kvsidecar" / "web").glob("_pollfast*.so"))  # built where it can be
    import tarfile

    with tarfile.open(sdists[0]) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    for needed in (
        "setup.py",
        "pyproject.toml",
        "kvsidecar/protocol/_seqlock.c",
        "kvsidecar/web/_pollfast.c",
        "kvsidecar/protocol/_seqlock_api.h",  # the C API the other extensions include
        "kvsidecar/web/_pollfast_api.h",
        "agent/pool.py",
    ):
        assert needed in names, needed


def test_quickstart_never_uses_the_production_or_the_bare_shm_directory() -> None:
    """Demo segments go to a directory of their own (issue #23 item 3): every demo engine
    and serve command of the quickstart names --shm-dir, and never the production default
    or bare /dev/shm."""
    from kvsidecar.protocol.names import DEFAULT_SHM_DIR

    text = (Path(REPO) / "docs" / "quickstart.md").read_text()
    checked = 0
    for block in shell_blocks(text):
        for line in commands(block):
            for argv in simple_commands(line):
                engine = argv[:3] == [".venv/bin/python", "-m", "kvsidecar.agent.demo"]
                serve = argv[:2] in ([".venv/bin/kvsidecar", "serve"], ["kvsidecar", "serve"])
                if not (engine or serve):
                    continue
                checked += 1
                assert "--shm-dir" in argv, line
                where = argv[argv.index("--shm-dir") + 1].rstrip("/")
                assert where not in (DEFAULT_SHM_DIR, "/dev/shm"), line
                # A demo daemon binds loopback like `demo` does (issue #33 item 9).
                if serve:
                    assert "--web.listen-address" in argv, line
                    bound = argv[argv.index("--web.listen-address") + 1]
                    assert bound.startswith(("127.0.0.1:", "[::1]:", "localhost:")), line
    assert checked >= 4


def test_make_run_installs_only_what_run_needs_and_says_so(tmp_path: Path) -> None:
    """`make run` on a fresh clone (no venv): it says what the minutes-long first install
    does, and installs the agent extra (and kvevents: the demo publishes KV events,
    docs/kv-events.md) only, not the test and benchmark tools (#23 item 3)."""
    r = subprocess.run(
        ["make", "-n", "run", f"VENV={tmp_path / 'venv'}"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    install = [i for i, ln in enumerate(lines) if " install " in ln and "pip" in ln]
    assert len(install) == 1, lines
    assert "'.[agent,kvevents]'" in lines[install[0]] and "dev" not in lines[install[0]]
    want = ["'.[agent,kvevents]'", "numpy"]
    assert lines[install[0]].split(" install ", 1)[1].split()[-2:] == want
    assert " -q" not in lines[install[0]], "pip's own progress is what the wait shows"
    said = [ln for ln in lines[: install[0]] if ln.startswith("echo") and "first time" in ln]
    assert said, lines
