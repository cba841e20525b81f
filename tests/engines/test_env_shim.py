"""One shared engine environment, each clone its own code (issue 33 item 8).

The environment `.ci/engine-env` builds holds the shim of kvsidecar/bench/engine_envs.py
instead of an editable install of one clone. Here a bare venv gets the shim and two
stand-in clones link it as `.engine-envs/x`: each link runs its own clone's code (the
plugin entry point included, and in a spawned worker process, as vLLM's engine core is),
PYTHONPATH overrides the link, and `wrong_checkout` tells them apart.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from kvsidecar.bench import engine_envs
from tests.conftest import REPO

PROBE = textwrap.dedent(
    """
    import importlib.metadata as md, multiprocessing as mp, sys
    import kvsidecar, kvsidecar.agent

    def who():
        (ep,) = md.entry_points(group="vllm.general_plugins", name="kvsidecar")
        return ep.load()()

    if __name__ == "__main__":
        child = mp.get_context("spawn").Pool(1).apply(who)
        print(kvsidecar.WHO, kvsidecar.agent.WHO, who(), child)
    """
)


def clone(root: Path, who: str) -> Path:
    """A stand-in clone: kvsidecar/ and agent/ (kvsidecar.agent) that say who they are."""
    (root / "kvsidecar").mkdir(parents=True)
    (root / "kvsidecar" / "__init__.py").write_text(f'__version__ = "0.1.0"\nWHO = "{who}"\n')
    engines = root / "agent" / "engines"
    engines.mkdir(parents=True)
    (root / "agent" / "__init__.py").write_text(f'WHO = "{who}"\n')
    (engines / "__init__.py").write_text("")
    (engines / "vllm.py").write_text(f'def register():\n    return "plugin {who}"\n')
    return root


@pytest.fixture(scope="module")
def shared_env(tmp_path_factory) -> Path:
    """A bare venv with the shim unpacked into it, as pip installs a pure wheel."""
    env = tmp_path_factory.mktemp("env") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    (site,) = env.glob("lib/python*/site-packages")
    wheel = engine_envs.write_wheel(tmp_path_factory.mktemp("wheel"))
    with zipfile.ZipFile(wheel) as whl:
        whl.extractall(site)
    return env


def linked(checkout: Path, env: Path) -> Path:
    (checkout / ".engine-envs").mkdir(exist_ok=True)
    link = checkout / ".engine-envs" / "x"
    link.symlink_to(env)
    return link / "bin" / "python"


def run(python: Path, tmp: Path, **env: str) -> str:
    script = tmp / "probe.py"
    script.write_text(PROBE)
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run(
        [str(python), str(script)], capture_output=True, text=True, timeout=120,
        cwd=tmp, env={**base, **env},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


def test_each_clone_runs_its_own_code_in_one_environment(shared_env: Path, tmp_path: Path):
    a, b = clone(tmp_path / "a", "a"), clone(tmp_path / "b", "b")
    python_a, python_b = linked(a, shared_env), linked(b, shared_env)
    assert run(python_a, tmp_path) == "a a plugin a plugin a"
    assert run(python_b, tmp_path) == "b b plugin b plugin b"
    # PYTHONPATH names a clone explicitly: it wins over the link.
    assert run(python_a, tmp_path, PYTHONPATH=str(b)) == "b b plugin b plugin b"
    # wrong_checkout asks the interpreter, so it is right whatever the mechanism.
    assert engine_envs.wrong_checkout("x", python_a, a) is None
    problem = engine_envs.wrong_checkout("x", python_a, b)
    assert problem and f"from {a.resolve()}" in problem and "bash .ci/engine-env x" in problem
    # The environment's own path names no clone: nothing to import, and it says so.
    problem = engine_envs.wrong_checkout("x", shared_env / "bin" / "python", a)
    assert problem and "No module named 'kvsidecar'" in problem


def test_the_shim_is_metadata_and_a_hook_only():
    files = engine_envs.shim_files()
    packages = {n.split("/")[0] for n in files if "/" in n and ".dist-info/" not in n}
    assert packages == {"kvsidecar-0.1.0.data"}, f"the shim ships code of a clone: {packages}"
    scripts = [n for n in files if ".data/" in n]
    assert scripts == ["kvsidecar-0.1.0.data/scripts/kvsidecar"], scripts
    assert files[scripts[0]].startswith("#!/bin/sh\n")  # pip rewrites only `#!python`
    entry_points = next(t for n, t in files.items() if n.endswith("entry_points.txt"))
    assert "kvsidecar = kvsidecar.agent.engines.vllm:register" in entry_points
    assert "kvsidecar = kvsidecar.agent.engines.sglang_plugin:register" in entry_points
    # No console script: its shebang would name the environment's real path (no clone);
    # bin/kvsidecar is a shell script instead (test_bin_kvsidecar_runs_the_linking_clone).
    assert "console_scripts" not in entry_points
    # The same bytes every time, so the key (part of the environment's name) is stable.
    assert engine_envs.shim_key() == engine_envs.shim_key()


def test_bin_kvsidecar_runs_the_linking_clone(tmp_path: Path):
    """The environment's `kvsidecar` command (issue 45 item 3: the docs' commands assumed
    one, and there was none) runs `python -m kvsidecar` of the clone whose link it is called
    through; called by the environment's own path it names the fix. Installed by pip, as
    .ci/engine-env does, so pip's handling of the wheel's scripts is what is tested."""
    env = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    wheel = engine_envs.write_wheel(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install",
         "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    main = "import sys, kvsidecar\ndef main():\n    print(kvsidecar.WHO, sys.argv)\n"
    for who in ("a", "b"):
        cli = clone(tmp_path / who, who) / "kvsidecar" / "cli"  # pyproject's console script
        cli.mkdir()
        (cli / "__init__.py").write_text("")
        (cli / "main.py").write_text(main)
        linked(tmp_path / who, env)
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def kvsidecar(path: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [path, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=base
        )

    for who in ("a", "b"):
        path = tmp_path / who / ".engine-envs" / "x" / "bin" / "kvsidecar"
        r = kvsidecar(str(path), tmp_path, "dump", "-x y")
        assert (r.returncode, r.stdout) == (0, f"{who} ['kvsidecar', 'dump', '-x y']\n"), r
    # Relative, from the clone's root, as the docs print it.
    r = kvsidecar(".engine-envs/x/bin/kvsidecar", tmp_path / "b", "ls")
    assert (r.returncode, r.stdout) == (0, "b ['kvsidecar', 'ls']\n"), r
    # The environment's own path names no clone: exit 2 and the fix, not an ImportError.
    r = kvsidecar(str(env / "bin" / "kvsidecar"), tmp_path, "ls")
    assert r.returncode == 2 and "<checkout>/.engine-envs/<name>/bin/kvsidecar" in r.stderr, r


def test_engine_env_never_touches_environments_of_other_clones():
    """Environments with an editable install (<name>-<key>) belong to clones that have not
    updated; the new ones are <name>-shim-<key> and only those are pruned."""
    script = (Path(REPO) / ".ci" / "engine-env").read_text()
    assert "env=$root/$name-shim-$key" in script
    assert 'for old in "$root/$name"-shim-*; do' in script
    assert " -e ." not in script, "an editable install binds the shared env to one clone"


def standin_checkout(root: Path) -> Path:
    """The parts of a checkout `.ci/engine-env` uses, with an empty lock `t`."""
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(Path(REPO) / "kvsidecar", root / "kvsidecar", ignore=ignore)
    shutil.copytree(Path(REPO) / "agent", root / "agent", ignore=ignore)
    (root / ".ci" / "locks").mkdir(parents=True)
    shutil.copy(Path(REPO) / ".ci" / "engine-env", root / ".ci" / "engine-env")
    for name in ("pyproject.toml", "setup.py"):
        shutil.copy(Path(REPO) / name, root / name)
    (root / ".ci" / "locks" / "t.txt").write_text("# nothing beyond the shim\n")
    return root


def test_two_clones_building_one_environment_at_once_both_get_it_whole(tmp_path: Path):
    """Two CI runs (or a developer and CI) on one host build the same environment at once:
    the later one waits for the first and reuses it. Before the build lock, the second
    build's `rm -rf` removed the first one's half-built tree (seen: bin/pip missing)."""
    envs = tmp_path / "envs"
    clones = [standin_checkout(tmp_path / f"clone{i}") for i in range(2)]
    env = {**os.environ, "KVSIDECAR_ENGINE_ENVS": str(envs), "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)
    command = ["bash", ".ci/engine-env", "t"]
    procs = [
        subprocess.Popen(
            command, cwd=c, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for c in clones
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum("building t environment" in o for o in outs) == 1, outs
    (built,) = [d for d in envs.iterdir() if d.is_dir()]
    assert (built / ".complete").is_file() and (built / "bin" / "pip").exists()
    for c in clones:
        r = subprocess.run(
            [str(c / ".engine-envs" / "t" / "bin" / "python"), "-c",
             "import kvsidecar, sys; print(kvsidecar.__file__)"],
            capture_output=True, text=True, timeout=60, cwd=tmp_path,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip().startswith(str(c)), r.stdout
