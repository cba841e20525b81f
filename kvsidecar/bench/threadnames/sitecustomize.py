"""Bench-only (``bench kvevents --vllm`` puts this folder on the engine's PYTHONPATH): each
Python thread writes its name to its ``/proc`` ``comm`` as it starts, so the benchmark can
tell vLLM's ``zmq-publisher`` thread from the engine core's other threads (Python 3.11
leaves every thread the process's name)."""

import threading

_bootstrap_inner = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]


def _named(self: threading.Thread) -> None:
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(self.name[:15])
    except OSError:
        pass
    _bootstrap_inner(self)


threading.Thread._bootstrap_inner = _named  # type: ignore[attr-defined]
