"""Which checkout an engine environment runs, and the shim that lets every checkout run its
own code in one shared environment (issue 33 item 8).

An engine environment (`.ci/engine-env NAME`) is shared by every clone on the host, keyed by
its lock. It used to hold an editable install of whichever checkout last ran
`.ci/engine-env`: another clone then ran that clone's code (or failed once it was deleted).
Now it holds a *shim*: a metadata-only `kvsidecar` distribution (the engines find our
plugins by its entry points) and an import hook that loads `kvsidecar` from the checkout
whose `.engine-envs/NAME` link started the interpreter (`<checkout>/.engine-envs/NAME/bin/
python`: `sys.executable` keeps that path, and vLLM's and SGLang's worker processes are
started with it), or from `PYTHONPATH` when that names one. Tests and benchmarks still
check which code an environment runs before trusting it (`wrong_checkout`).

``python -m kvsidecar.bench.engine_envs key|wheel DIR`` (standard library only: `.ci/
engine-env` runs it with the host's Python before the environment exists).
"""

from __future__ import annotations

import base64
import configparser
import hashlib
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIM_MODULE = "_kvsidecar_checkout"

# The import hook, installed by a .pth file at every start of the environment's Python.
# After PathFinder: a kvsidecar on PYTHONPATH (or the current directory) wins.
_HOOK = '''"""kvsidecar's checkout shim (kvsidecar/bench/engine_envs.py): imports kvsidecar from
the checkout whose .engine-envs/<name>/bin/python started this interpreter."""
import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def _checkout():
    exe = Path(sys.executable)  # not resolved: <checkout>/.engine-envs/<name>/bin/python
    if len(exe.parents) > 3 and exe.parents[2].name == ".engine-envs":
        return exe.parents[3]
    return None


class _Finder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname == "kvsidecar":
            root = _checkout()
            where = root / "kvsidecar" if root is not None else None
        elif fullname == "kvsidecar.agent" and "kvsidecar" in sys.modules:
            # agent/ is shipped as kvsidecar.agent: beside whichever kvsidecar was imported.
            where = Path(sys.modules["kvsidecar"].__file__).resolve().parents[1] / "agent"
        else:
            return None
        if where is None or not (where / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(
            fullname, where / "__init__.py", submodule_search_locations=[str(where)]
        )


if not any(isinstance(f, type) and f.__name__ == "_Finder" for f in sys.meta_path):
    sys.meta_path.append(_Finder)
'''


# `kvsidecar` in the environment's bin/: a shell script, not pyproject's console script. pip
# would write that one's shebang as the environment's real path, where the hook finds no
# checkout; this one runs the `python` beside it by the path it was called with
# (<checkout>/.engine-envs/<name>/bin/kvsidecar: the link), as the hook needs, and then what
# pip's console script runs. pip copies a wheel's data scripts that do not start with
# `#!python` as they are.
_SCRIPT = """#!/bin/sh
# kvsidecar's checkout shim (kvsidecar/bench/engine_envs.py): the `kvsidecar` command of the
# checkout whose .engine-envs/<name>/bin/kvsidecar this was called as.
bin=${{0%/*}}
envs=${{bin%/*/*}}
if [ "$bin" = "$0" ] ||
  {{ [ "${{envs##*/}}" != .engine-envs ] && [ -z "${{PYTHONPATH:-}}" ]; }}; then
  echo "kvsidecar: $0 runs the kvsidecar of the checkout it is called from:" \\
    "call it as <checkout>/.engine-envs/<name>/bin/kvsidecar" >&2
  exit 2
fi
exec "$bin/python" -c \\
  'import sys; sys.argv[0] = "kvsidecar"; from {module} import {attr}; sys.exit({attr}())' "$@"
"""


def _script(pyproject: Path) -> str:
    """bin/kvsidecar: `_SCRIPT` running pyproject's ``kvsidecar`` console script."""
    import tomllib

    target = tomllib.loads(pyproject.read_text())["project"]["scripts"]["kvsidecar"]
    module, attr = target.split(":")
    return _SCRIPT.format(module=module, attr=attr)


def _entry_points(pyproject: Path) -> str:
    """entry_points.txt of the shim: the plugin groups of pyproject.toml. Not the console
    script (see _SCRIPT)."""
    import tomllib

    groups = tomllib.loads(pyproject.read_text())["project"].get("entry-points", {})
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keep case
    for group in sorted(groups):
        parser[group] = dict(sorted(groups[group].items()))
    out = io.StringIO()
    parser.write(out)
    return out.getvalue()


def _version() -> str:
    init = (ROOT / "kvsidecar" / "__init__.py").read_text()
    return init.split('__version__ = "', 1)[1].split('"', 1)[0]


def shim_files(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """The shim's files, path in the wheel -> text."""
    version = _version()
    info = f"kvsidecar-{version}.dist-info"
    return {
        f"{SHIM_MODULE}.py": _HOOK,
        f"{SHIM_MODULE}.pth": f"import {SHIM_MODULE}\n",
        f"{info}/METADATA": (
            f"Metadata-Version: 2.1\nName: kvsidecar\nVersion: {version}\n"
            "Summary: kvsidecar's checkout shim for a shared engine environment "
            "(the code comes from the checkout that runs it)\n"
        ),
        f"{info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: kvsidecar.bench.engine_envs\n"
            "Root-Is-Purelib: true\nTag: py3-none-any\n"
        ),
        f"{info}/entry_points.txt": _entry_points(pyproject),
        f"{info}/top_level.txt": f"{SHIM_MODULE}\n",
        f"{info.removesuffix('.dist-info')}.data/scripts/kvsidecar": _script(pyproject),
    }


def shim_key() -> str:
    """Digest of everything the shim installs: part of the environment's directory name,
    so a changed shim builds a new environment rather than changing a shared one."""
    h = hashlib.sha256(b"install: shim 1\n")
    for name, text in sorted(shim_files().items()):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:16]


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def write_wheel(directory: Path) -> Path:
    """The shim as a wheel in `directory` (fixed timestamps: the same bytes every time)."""
    files = {name: text.encode() for name, text in shim_files().items()}
    info = next(n.split("/")[0] for n in files if n.endswith("/METADATA"))
    record = f"{info}/RECORD"
    lines = [f"{n},{_record_hash(d)},{len(d)}" for n, d in sorted(files.items())]
    files[record] = ("\n".join([*lines, f"{record},,"]) + "\n").encode()
    path = directory / f"{info.removesuffix('.dist-info')}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as whl:
        for name, data in files.items():
            entry = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            entry.external_attr = (0o100755 if "/scripts/" in name else 0o100644) << 16
            whl.writestr(entry, data)
    return path


def running_checkout(python: Path) -> Path | str:
    """The checkout `python` imports kvsidecar from, as it would run for a test (the
    environment as is, no virtualenv of ours); or why it cannot import it."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    probe = "import kvsidecar, os; print(os.path.realpath(kvsidecar.__file__))"
    try:
        r = subprocess.run(
            [str(python), "-c", probe], capture_output=True, text=True, timeout=120,
            cwd="/", env=env,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    if r.returncode != 0:
        return (r.stderr.strip().splitlines() or ["no output"])[-1]
    return Path(r.stdout.strip()).parents[1]


def wrong_checkout(name: str, python: Path, checkout: Path) -> str | None:
    """A one-line problem-and-fix message when `name`'s environment does not run `checkout`."""
    found = running_checkout(python)
    if isinstance(found, Path) and found.resolve() == checkout.resolve():
        return None
    where = f"from {found}" if isinstance(found, Path) else f"nothing ({found})"
    return (
        f"the {name} environment ({python}) runs kvsidecar {where}, not this checkout "
        f"({checkout}): run `bash .ci/engine-env {name}` here"
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["key"]:
        print(shim_key())
    elif argv[:1] == ["wheel"] and len(argv) == 2:
        print(write_wheel(Path(argv[1])))
    else:
        print("usage: python -m kvsidecar.bench.engine_envs key | wheel DIR", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
