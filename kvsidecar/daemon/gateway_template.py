"""The gateway body (`gateway_body.render`) from kept text, only its numbers formatted.

A rank's body changes at each step in its numbers only: the family names and the engine's
labels (its model, ranks, role) are the same from one step to the next. `Templates.render`
keeps, per runtime identity (the fields the labels are made of), each family's ``# TYPE``
line and sample name with its labels, and per (block size, block count) the info gauge's
line, and writes the numbers between them, as `gateway_body.render` formats them (its
helpers: the same usage, counts and age). `gateway_body.render` stays the reference:
tests/daemon/test_fullcheck_work.py checks the two bodies equal on random snapshots.
"""

from __future__ import annotations

import operator

from kvsidecar.daemon import gateway_body as gb
from kvsidecar.protocol.schema import Snapshot

__all__ = ["Templates"]

# What `EngineNames.labels` and `.info_labels` read, and `engine_names`: the identity.
_IDENTITY = operator.attrgetter(
    "engine", "model_name", "role", "dp_rank", "dp_size", "tp_rank", "pp_rank"
)
_KEPT = 256  # identities and sizes kept (a rank's are one or two): never grows without bound
WAITING, RUNNING, USAGE = 0, 1, 2  # the moving numbers' codes in `Templates.parts`


class _Heads:
    """One identity's kept text: each family's TYPE line and sample name, labels included."""

    __slots__ = ("info", "names", "running", "usage", "waiting")

    def __init__(self, snapshot: Snapshot) -> None:
        rt = snapshot.runtime
        names = self.names = gb.engine_names(rt.engine)
        labels = gb._labels_text(names.labels(rt))
        self.waiting = _head(names.waiting, labels)
        self.running = _head(names.running, labels)
        self.usage = _head(names.usage, labels)
        self.info: dict[tuple[str, str], str] = {}  # (block size, count): the whole family


def _head(name: str, labels: str) -> str:
    lines: list[str] = []
    gb._family(lines, name, labels, 0.0)
    return "\n".join(lines)[: -len(gb._number(0.0))]  # "# TYPE n gauge\nn{labels} "


_HELD_BLOCKS = _head(gb.HELD_BLOCKS, "")
_HELD_AGE = _head(gb.HELD_AGE, "")


class Templates:
    """`gateway_body.render`, with each identity's text kept."""

    def __init__(self) -> None:
        self._heads: dict[tuple, _Heads] = {}

    def _kept(self, snapshot: Snapshot) -> _Heads:
        ident = _IDENTITY(snapshot.runtime)
        # Values that compare equal may print differently (1 == 1.0 == True): the types
        # are part of the key, or one's kept text would be served for the other.
        key = (ident, tuple(map(type, ident)))
        heads = self._heads.get(key)
        if heads is None:
            if len(self._heads) >= _KEPT:
                self._heads.clear()
            heads = self._heads[key] = _Heads(snapshot)
        return heads

    def render(self, snapshot: Snapshot, now_mono_ns: int) -> bytes:
        return "".join(self._text(snapshot, now_mono_ns, None)).encode()

    def parts(self, snapshot: Snapshot) -> tuple[bytes | int, ...]:
        """The body of a timeless snapshot (`gateway_body.timeless`) as kept text and the
        codes of its three moving numbers (`WAITING`, `RUNNING`, `USAGE`), for the
        compiled new-step answer (gateway_step): joined with the numbers formatted, it is
        `render`'s body."""
        text = self._text(snapshot, 0, (WAITING, RUNNING, USAGE))
        parts: list[bytes | int] = []
        run: list[str] = []
        for t in text:
            if isinstance(t, int):
                parts += (("".join(run)).encode(), t)
                run = []
            else:
                run.append(t)
        parts.append("".join(run).encode())
        return tuple(p for p in parts if p != b"")

    def _text(
        self, snapshot: Snapshot, now_mono_ns: int, codes: tuple[int, int, int] | None
    ) -> list:
        """The body's pieces; with `codes`, the three moving numbers as those codes."""
        rt = snapshot.runtime
        heads = self._kept(snapshot)
        names = heads.names
        out: list = []
        if rt.requests_waiting is not None:
            out += (heads.waiting, codes[0] if codes else gb._number(rt.requests_waiting), "\n")
        if rt.requests_running is not None:
            out += (heads.running, codes[1] if codes else gb._number(rt.requests_running), "\n")
        pools = snapshot.pools
        sized = gb._sized(pools)
        usage = gb._usage(sized, names)
        if usage is not None:
            out += (heads.usage, codes[2] if codes else gb._number(usage), "\n")
        if sized and sized[0].block_size_tokens:
            # Kept by their printed text, not their value: 120000 == 120000.0 but the
            # label reads differently (and -0.0 == 0.0).
            sizes = (str(sized[0].block_size_tokens), str(gb._num_blocks(sized, names)))
            info = heads.info.get(sizes)
            if info is None:
                if len(heads.info) >= _KEPT:
                    heads.info.clear()
                info = heads.info[sizes] = _info(snapshot, names, sizes)
            out.append(info)
        blocks, age = gb._held(pools, now_mono_ns)
        if blocks is not None:
            out += (_HELD_BLOCKS, gb._number(blocks), "\n")
        if age is not None:
            out += (_HELD_AGE, gb._number(age), "\n")
        return out


def _info(snapshot: Snapshot, names: gb.EngineNames, sizes: tuple[str, str]) -> str:
    labels = [
        *names.info_labels(snapshot.runtime),
        (names.block_size_label, sizes[0]),
        (names.num_blocks_label, sizes[1]),
    ]
    lines: list[str] = []
    gb._family(lines, names.cache_info, gb._labels_text(sorted(labels)), 1.0)
    return "\n".join(lines) + "\n"
