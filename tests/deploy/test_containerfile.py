"""deploy/Containerfile (daemon-only image) and deploy/Containerfile.vllm (vLLM's image with
the plugin). No container engine is needed: the structure is checked statically, and each
builder's and runtime's pip lines are replayed into a fresh venv.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .support import DEPLOY, REPO, run

CONTAINERFILE = DEPLOY / "Containerfile"
CONTAINERFILES = [CONTAINERFILE, DEPLOY / "Containerfile.vllm"]
DOCKERIGNORE = DEPLOY / "Containerfile.dockerignore"


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages) of a Containerfile."""
    logical: list[str] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # comment inside a continuation
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        op, _, rest = line.strip().partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif op == "FROM":
            m = re.match(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?$", rest, re.I)
            assert m, line
            stages.append(Stage(base=m.group(1), name=m.group(2)))
        else:
            assert stages, f"{op} before FROM"
            stages[-1].instructions.append((op, rest))
    return args, stages


def expand(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), value)


def pip_commands(run_arg: str) -> list[list[str]]:
    """The `python -m pip ...` / `pip ...` commands of one RUN instruction."""
    out = []
    for part in re.split(r"&&|;", run_arg):
        words = shlex.split(part)
        if words[:3] in (["python", "-m", "pip"], ["python3", "-m", "pip"]):
            out.append(words[3:])
        elif words[:1] in (["pip"], ["pip3"]):
            out.append(words[1:])
    return out


@pytest.fixture(scope="module")
def parsed():
    return parse(CONTAINERFILE.read_text())


@pytest.fixture(scope="module", params=CONTAINERFILES, ids=lambda p: p.name)
def each(request):
    return parse(request.param.read_text())


def test_stages(parsed) -> None:
    args, stages = parsed
    assert len(stages) == 2, "builder + runtime"
    builder, final = stages
    assert builder.name and final.name is None
    for stage in stages:
        # An exact patch release and Debian release, never a moving tag like 3.11-slim.
        assert re.fullmatch(
            r"python:3\.\d+\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", expand(stage.base, args)
        )
    builder_runs = " ".join(builder.all("RUN"))
    assert "gcc" in builder_runs and "pip wheel" in builder_runs
    final_runs = " ".join(final.all("RUN"))
    assert "gcc" not in final_runs and "apt-get install" not in final_runs, (
        "no compiler in the runtime image"
    )
    assert any(c.startswith(f"--from={builder.name} ") for c in final.all("COPY")), (
        "wheels copied from builder"
    )
    # Non-root, numerically (runAsNonRoot can only verify a numeric UID).
    (user,) = final.all("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    assert final.all("ENTRYPOINT") == ['["kvsidecar"]']
    assert final.all("CMD") == ['["serve"]']
    assert "19440" in final.all("EXPOSE")


def test_no_agent_extra(parsed) -> None:
    _, stages = parsed
    cmds = [c for s in stages for r in s.all("RUN") for c in pip_commands(r)]
    assert cmds, "no pip commands found"
    for cmd in cmds:
        joined = " ".join(cmd)
        assert "torch" not in joined and "[agent]" not in joined and "[" not in joined, joined


def _ignored(rel: str, patterns: list[str]) -> bool:
    parts = rel.split("/")
    for pat in patterns:
        bare = pat[3:] if pat.startswith("**/") else pat
        if fnmatch.fnmatch(rel, pat) or any(fnmatch.fnmatch(p, bare) for p in parts):
            return True
    return False


def stage_build_context(stage: Stage, dest_root: Path) -> Path:
    """Replay the stage's COPY instructions from the repo into dest_root.

    Returns the directory standing in for the stage's WORKDIR.
    """
    patterns = [
        ln.strip()
        for ln in DOCKERIGNORE.read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    workdir = "/"
    for op, arg in stage.instructions:
        if op == "WORKDIR":
            workdir = arg
        if op != "COPY" or arg.startswith("--from"):
            continue
        *srcs, dst = shlex.split(arg)
        target = dest_root / (dst if dst.startswith("/") else os.path.join(workdir, dst)).lstrip(
            "/"
        )
        matched = [m for s in srcs for m in glob.glob(str(REPO / s))]
        assert matched, f"COPY {arg}: nothing matches in the build context"
        into_dir = dst.endswith("/") or len(srcs) > 1
        for m in map(Path, matched):
            rel = m.relative_to(REPO).as_posix()
            if _ignored(rel, patterns):
                continue
            if m.is_dir():  # COPY copies a directory's contents, not the directory
                shutil.copytree(
                    m,
                    target,
                    dirs_exist_ok=True,
                    ignore=lambda d, names: [
                        n
                        for n in names
                        if _ignored((Path(d) / n).relative_to(REPO).as_posix(), patterns)
                    ],
                )
            elif into_dir:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(m, target / m.name)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(m, target)
    return dest_root / workdir.lstrip("/")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_runtime_install_in_fresh_venv(each, tmp_path: Path) -> None:
    """Builder `pip wheel` + runtime `pip install`, replayed in a fresh venv."""
    _, (builder, final) = each
    venv = tmp_path / "venv"
    proc = run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    py = str(venv / "bin" / "python")
    wheels = tmp_path / "wheels"

    def localise(cmd: list[str], cwd: Path) -> list[str]:
        out = []
        for word in cmd:
            word = word.replace("/wheels", str(wheels))
            out.append(str(cwd) if word == "." else word)
        return out

    src = stage_build_context(builder, tmp_path / "builder")
    builder_cmds = [c for r in builder.all("RUN") for c in pip_commands(r)]
    assert builder_cmds[-1][0] == "wheel"
    for cmd in builder_cmds:
        proc = run([py, "-m", "pip", *localise(cmd, src)], timeout=600, cwd=src)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(wheels.glob("kvsidecar-*.whl")), "builder produced no kvsidecar wheel"

    final_cmds = [c for r in final.all("RUN") for c in pip_commands(r)]
    assert [c[0] for c in final_cmds] == ["install"]
    for cmd in final_cmds:
        proc = run([py, "-m", "pip", *localise(cmd, tmp_path)], timeout=600, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # Import from outside the repository so the checkout cannot shadow the
    # installed package.
    env = {
        k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}
    }
    # The plugin image installs --no-deps: vLLM's image brings msgspec, torch and the rest.
    plugin = "--no-deps" in final_cmds[-1]
    imports = "kvsidecar.protocol._seqlock" if plugin else "kvsidecar.cli.main"
    proc = run(
        [py, "-c", f"import kvsidecar, {imports}; print(kvsidecar.__file__)"],
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert str(venv) in proc.stdout, f"imported the wrong kvsidecar: {proc.stdout}"
    if plugin:
        return
    proc = run([py, "-c", "import torch"], cwd=tmp_path, env=env)
    assert proc.returncode != 0 and "No module named 'torch'" in proc.stderr, (
        "torch must not be installed"
    )
    proc = run([str(venv / "bin" / "kvsidecar"), "--help"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr


def _requirements(path: Path) -> dict[str, list[str]]:
    """name -> [specifier and hashes] of a pip requirements file (continuations joined)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            words = line.split()
            out[re.split(r"[=<>!~\[]", words[0], maxsplit=1)[0].lower()] = words
    return out


def test_every_fetch_is_pinned_by_hash(each) -> None:
    """Each pip command fetches only hash-pinned requirements, or nothing (--no-index, or a
    local build with --no-deps --no-build-isolation): no name resolved from an index."""
    _, stages = each
    for cmd in (c for s in stages for r in s.all("RUN") for c in pip_commands(r)):
        if "--no-index" in cmd:
            continue
        if "." in cmd:
            assert "--no-deps" in cmd and "--no-build-isolation" in cmd, cmd
            continue
        assert "--require-hashes" in cmd and "-r" in cmd, f"unpinned: pip {' '.join(cmd)}"
        reqs = _requirements(REPO / cmd[cmd.index("-r") + 1])
        assert reqs
        for name, words in reqs.items():
            assert re.fullmatch(rf"{re.escape(name)}==[\w.]+", words[0], re.I), words
            assert any(re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", w) for w in words), words


def test_pinned_dependencies_are_the_declared_ones() -> None:
    """deploy/requirements.txt pins exactly pyproject's runtime dependencies, within range."""
    import tomllib
    from packaging.requirements import Requirement

    declared = {
        Requirement(d).name.lower(): Requirement(d)
        for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    }
    pinned = _requirements(DEPLOY / "requirements.txt")
    assert pinned.keys() == declared.keys()
    for name, words in pinned.items():
        version = words[0].split("==", 1)[1]
        assert declared[name].specifier.contains(version), (name, version)


def test_oci_labels(each) -> None:
    args, stages = each
    labels = " ".join(stages[-1].all("LABEL"))
    for key in ("title", "version", "revision", "licenses", "base.name", "description"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in labels
    assert args.get("REVISION") is not None, "REVISION is a build argument"
