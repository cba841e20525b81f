"""The start-up hook that puts the kvsidecar agent into ATOM's engine core.

Why a ``.pth`` start-up hook: ATOM has no plugin loader and no scheduler-class option
(``engine_core.py`` builds ``Scheduler(config, ...)`` itself), and it runs the engine core in a
*spawned* child, so nothing done in the launching process reaches it. The one thing every
interpreter of an environment runs, spawned children included, is ``site``'s ``.pth`` lines.
``python -m kvsidecar.agent.engines.atom_hook install`` writes one line (`PTH_LINE`) into
the environment's site-packages; with ``KVSIDECAR_ATOM`` unset it costs one environment
lookup per interpreter start and does nothing else. With ``KVSIDECAR_ATOM=1`` it calls
`install()`, which adds an import hook for ``atom.model_engine.scheduler`` only: ATOM's
module is loaded by its own loader, then `patch_scheduler_module` wraps three methods of its
``Scheduler`` class (``__init__``, ``postprocess``, ``_update_from_kv_xfer_finished``).
No file of ATOM is changed, and nothing happens in a process that never imports ATOM.

Every wrapper calls ATOM's method first and lets its exceptions through unchanged; what
kvsidecar does afterwards is caught and logged once, never raised into ATOM.
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

from kvsidecar import settings
from kvsidecar.agent.engines._patching import disabled, is_patched, mark_patched

log = logging.getLogger("atom.kvsidecar")

TARGET = "atom.model_engine.scheduler"
HOOKS = ("__init__", "postprocess", "_update_from_kv_xfer_finished", "get_request_counts")
PTH_NAME = "kvsidecar-atom.pth"
# One line, run by `site` at every interpreter start (a .pth line that starts with "import").
# The same test as `active()` (settings' flag rule), without importing anything.
PTH_LINE = (
    "import os; os.environ.get('KVSIDECAR_ATOM', '') not in ('', '0', 'false') and "
    "os.environ.get('KVSIDECAR_DISABLE', '') in ('', '0', 'false') and "
    "__import__('kvsidecar.agent.engines.atom_hook', fromlist=['install']).install()\n"
)


def active(env: Any = None) -> bool:
    """``KVSIDECAR_ATOM`` set (and ``KVSIDECAR_DISABLE`` not)."""
    env = os.environ if env is None else env
    return settings.ATOM.enabled(env) and not disabled(env)


class _PatchingLoader(importlib.abc.Loader):
    """ATOM's own loader, then our patch of the module it executed."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        patch_scheduler_module(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ...: ATOM's loader
        return getattr(self._loader, name)


class AtomImportHook(importlib.abc.MetaPathFinder):
    """A meta-path finder that answers for `TARGET` only (None for every other name)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TARGET:
            return None
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _PatchingLoader(spec.loader)
                    return spec
        except Exception as e:  # let the normal import machinery decide
            log.warning("kvsidecar ATOM hook skipped (engine unaffected): %r", e)
        return None


def install() -> bool:
    """Arrange for ATOM's Scheduler to be patched when it is imported. Never raises.

    Returns True if the hook is in place (or the module, already imported, was patched).
    """
    try:
        if not active():
            return False
        module = sys.modules.get(TARGET)
        if module is not None:
            return patch_scheduler_module(module)
        if not any(isinstance(f, AtomImportHook) for f in sys.meta_path):
            sys.meta_path.insert(0, AtomImportHook())
        return True
    except Exception as e:
        log.warning("kvsidecar ATOM hook not installed (engine unaffected): %r", e)
        return False


def patch_scheduler_module(module: Any) -> bool:
    """Wrap ``module.Scheduler``'s hook methods (idempotent). False, logged, if one is missing."""
    try:
        cls = getattr(module, "Scheduler", None)
        missing = (
            "Scheduler"
            if cls is None
            else next((f"Scheduler.{h}" for h in HOOKS if not hasattr(cls, h)), None)
        )
        if missing is not None:
            log.warning(
                "kvsidecar disabled for this ATOM: hook point %s is missing (checked: %s)",
                missing,
                _checked_commit(),
            )
            return False
        if is_patched(cls):
            return True
        _wrap(cls)
        mark_patched(cls)
        return True
    except Exception as e:
        log.warning("kvsidecar ATOM patch failed (engine unaffected): %r", e)
        return False


def _checked_commit() -> str:
    from kvsidecar.agent.engines.atom import CHECKED_COMMIT

    return CHECKED_COMMIT


def _sidecar(scheduler: Any) -> Any:
    return scheduler.__dict__.get("_kvsidecar")


def _wrap(cls: type) -> None:
    init = cls.__init__
    postprocess = cls.postprocess
    xfer = cls._update_from_kv_xfer_finished

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if "_kvsidecar" in self.__dict__:  # a subclass's __init__ ran ours already
            return
        self.__dict__["_kvsidecar"] = None
        if not active():  # checked per scheduler: KVSIDECAR_DISABLE=1 leaves ATOM alone
            return
        try:
            from kvsidecar.agent.engines.atom import AtomSidecar

            self.__dict__["_kvsidecar"] = AtomSidecar.attach(self)
        except Exception as e:
            log.warning("kvsidecar not attached to this ATOM scheduler (engine unaffected): %r", e)

    def postprocess_(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = postprocess(self, *args, **kwargs)
        sidecar = _sidecar(self)
        if sidecar is not None:
            sidecar.publish(self)  # one engine step: after its postprocess
        return result

    def update_from_kv_xfer_finished(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = xfer(self, *args, **kwargs)
        sidecar = _sidecar(self)
        if sidecar is not None:
            sidecar.publish(self, engine_step=False)  # sends/saves done: blocks released
        return result

    for name, wrapper, orig in (
        ("__init__", __init__, init),
        ("postprocess", postprocess_, postprocess),
        ("_update_from_kv_xfer_finished", update_from_kv_xfer_finished, xfer),
    ):
        wrapper.__name__ = orig.__name__
        wrapper.__qualname__ = orig.__qualname__
        wrapper.__doc__ = orig.__doc__
        wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
        setattr(cls, name, wrapper)


# -- installing the .pth line ------------------------------------------------------------


def site_dir() -> Path:
    """This interpreter's site-packages (``purelib``), where ATOM's environment reads .pth."""
    return Path(sysconfig.get_paths()["purelib"])


def install_pth(directory: Path | None = None) -> Path:
    path = (directory or site_dir()) / PTH_NAME
    path.write_text(PTH_LINE)
    return path


def uninstall_pth(directory: Path | None = None) -> Path:
    path = (directory or site_dir()) / PTH_NAME
    path.unlink(missing_ok=True)
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m kvsidecar.agent.engines.atom_hook",
        description="Add (or remove) the start-up line that lets KVSIDECAR_ATOM=1 put the "
        "kvsidecar agent into ATOM's engine core. Run it with the Python ATOM runs with.",
    )
    p.add_argument("action", choices=("install", "uninstall", "status"))
    p.add_argument("--site-dir", type=Path, default=None, help="default: this Python's purelib")
    a = p.parse_args(argv)
    directory = a.site_dir or site_dir()
    if a.action == "install":
        print(f"wrote {install_pth(directory)}; start ATOM with KVSIDECAR_ATOM=1")
    elif a.action == "uninstall":
        print(f"removed {uninstall_pth(directory)}")
    else:
        path = directory / PTH_NAME
        state = "installed" if path.exists() and path.read_text() == PTH_LINE else "not installed"
        print(f"{path}: {state}; KVSIDECAR_ATOM is {'set' if active() else 'unset'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
