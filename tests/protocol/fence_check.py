"""Check the seqlock's fences (W1, W2, the acquire load, R1) in what GCC makes of _seqlock.c.

Two checkers, both over the two functions that carry the protocol (``latch_publish``
and ``latch_read``, noinline so they stay functions of their own):

* ``check_aarch64_asm``: the aarch64 assembly. A release fence is ``dmb ish``, an
  acquire fence ``dmb ishld`` (or ``dmb ish``), an acquire load ``ldar``/``ldapr``.
  On x86-64 (TSO) all of these compile to nothing, so there is no x86 assembly to check.
* ``check_ir``: GCC's optimized GIMPLE (``-fdump-tree-optimized``), on any target:
  the fences and atomic loads with their C memory orders, in program order, after
  every optimization that could have moved or merged them. This is the check that
  means something on x86-64 (the fences are compiler barriers there), and the only
  one that sees an acquire fence turned into a release fence (both ``dmb ish`` on
  aarch64).

Each checker returns a list of problems (empty: the fences are all there). The
mutations below weaken, drop or move one fence in a copy of the source; the tests
show each checker rejects each of them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig

SOURCE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "kvsidecar",
    "protocol",
    "_seqlock.c",
)
AARCH64_CC = "aarch64-linux-gnu-gcc"
CFLAGS = ["-O2", "-std=c11", "-fPIC"]  # as setup.py builds it

W1 = "    __atomic_thread_fence(__ATOMIC_RELEASE); /* W1: see the header comment */\n"
W2 = "    __atomic_thread_fence(__ATOMIC_RELEASE); /* W2: slot before sequence */\n"
SEQ_STORE = "    __atomic_store_n(seqp, k, __ATOMIC_RELAXED);\n"
ACQ_LOAD = "        s = __atomic_load_n(seqp, __ATOMIC_ACQUIRE);\n"
R1 = "        __atomic_thread_fence(__ATOMIC_ACQUIRE); /* R1: copy before the re-check */\n"
SLOT_LEN = "        n = ld32(scratch + 8);\n"


def _weaken(line: str, order: str) -> tuple[str, str]:
    return line, re.sub(r"__ATOMIC_(RELEASE|ACQUIRE)", order, line, count=1)


# name -> (old text, new text): one fence dropped, weakened or moved per mutation.
MUTATIONS: dict[str, tuple[str, str]] = {
    "W1 dropped": (W1, ""),
    "W1 relaxed": _weaken(W1, "__ATOMIC_RELAXED"),
    "W1 acquire": _weaken(W1, "__ATOMIC_ACQUIRE"),
    "W2 dropped": (W2, ""),
    "W2 relaxed": _weaken(W2, "__ATOMIC_RELAXED"),
    "W2 acquire": _weaken(W2, "__ATOMIC_ACQUIRE"),
    "W2 after the sequence store": (W2 + SEQ_STORE, SEQ_STORE + W2),
    "acquire load relaxed": _weaken(ACQ_LOAD, "__ATOMIC_RELAXED"),
    "R1 dropped": (R1, ""),
    "R1 relaxed": _weaken(R1, "__ATOMIC_RELAXED"),
    "R1 release": _weaken(R1, "__ATOMIC_RELEASE"),
    "R1 before the payload copy": (SLOT_LEN, SLOT_LEN + R1),
}
# "R1 before the payload copy" also keeps the original R1 out of the way:
MOVES_ALSO_DROP = {"R1 before the payload copy": R1}

# On aarch64 a release fence is a full `dmb ish`, which also orders loads: the
# hardware is fine, only the C program is wrong. The IR check catches it.
AARCH64_BLIND = {"R1 release"}


def mutate(source: str, name: str) -> str:
    old, new = MUTATIONS[name]
    if source.count(old) != 1:
        raise AssertionError(f"mutation {name!r}: its target text is not in _seqlock.c once")
    drop = MOVES_ALSO_DROP.get(name)
    if drop is not None:
        source = source.replace(drop, "", 1)
    return source.replace(old, new, 1)


def python_include() -> str | None:
    inc = sysconfig.get_paths().get("include")
    return inc if inc and os.path.exists(os.path.join(inc, "Python.h")) else None


def have_aarch64_cc() -> bool:
    return shutil.which(AARCH64_CC) is not None


def _compile(cc: str, src: str, out_dir: str, extra: list[str]) -> None:
    if cc == AARCH64_CC:
        # No aarch64 Python headers here: the latch alone, which needs none (the
        # Python wrappers around it are the same on every architecture).
        extra = ["-DKVSIDECAR_LATCH_ONLY", *extra]
    else:
        inc = python_include()
        if inc is None:
            raise FileNotFoundError("Python.h not found (python3-dev)")
        # The module as setup.py builds it: its C API header is beside the original.
        extra = [f"-I{inc}", f"-I{os.path.dirname(SOURCE)}", *extra]
    cmd = [cc, *CFLAGS, *extra, src]
    proc = subprocess.run(cmd, cwd=out_dir, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")


def aarch64_asm(src: str, out_dir: str) -> str:
    out = os.path.join(out_dir, "seqlock.s")
    _compile(AARCH64_CC, src, out_dir, ["-S", "-o", out])
    with open(out) as f:
        return f.read()


def gimple(cc: str, src: str, out_dir: str) -> str:
    out = os.path.join(out_dir, "seqlock.optimized")
    _compile(cc, src, out_dir, ["-S", "-o", os.devnull, f"-fdump-tree-optimized={out}"])
    with open(out) as f:
        return f.read()


# ------------------------------ aarch64 assembly ------------------------------


def asm_function(asm: str, name: str) -> list[str]:
    """The instructions of one function (no directives, no labels)."""
    m = re.search(rf"^{re.escape(name)}:\n(.*?)^\t\.size\t{re.escape(name)}, ", asm, re.M | re.S)
    if m is None:
        return []
    return [
        " ".join(line.split())
        for line in m.group(1).splitlines()
        if line.startswith("\t") and not line.startswith("\t.")
    ]


_DMB = re.compile(r"^dmb (\w+)$")
_STORE = re.compile(r"^(str|stp|stlr)\w* [^\[]*\[(x\d+)")  # base register not sp
_SEQ_LOAD = re.compile(r"^ldr x\d+, \[x\d+(, 64)?\]$")  # published_seq (base+64 or its pointer)
_ACQ_LOAD = re.compile(r"^(ldar|ldapr) x\d+, \[x\d+")


def _index(ins: list[str], pred, start: int = 0, stop: int | None = None) -> int:
    for i in range(start, len(ins) if stop is None else stop):
        if pred(ins[i]):
            return i
    return -1


def _call(target: str):
    return lambda s: s == f"bl {target}"


def check_aarch64_publish(ins: list[str]) -> list[str]:
    if not ins:
        return ["latch_publish not found in the assembly"]
    dmbs = [(i, _DMB.match(s).group(1)) for i, s in enumerate(ins) if _DMB.match(s)]
    full = [i for i, kind in dmbs if kind == "ish"]
    problems = [
        f"publish: `dmb {k}` cannot order stores (release needs `dmb ish`)"
        for _, k in dmbs
        if k != "ish"
    ]
    if len(full) != 2:
        return [*problems, f"publish: {len(full)} `dmb ish`, expected 2 (W1, W2)"]
    w1, w2 = full
    crc = _index(ins, _call("crc32_ieee"))
    copy = _index(ins, _call("memcpy"), w1, w2)
    after = _index(ins, lambda s: s.startswith("bl "), w2)  # clock_gettime (or now_ns at -Os)
    if copy < 0:
        problems.append("publish: the payload memcpy is not between W1 and W2")
    if crc < 0 or _index(ins, lambda s: bool(_STORE.match(s)), crc, w1) >= 0:
        problems.append("publish: a slot store comes before W1")
    if copy >= 0 and _index(ins, lambda s: bool(_STORE.match(s)), copy, w2) >= 0:
        problems.append("publish: a store between the payload copy and W2 (sequence before W2?)")
    if after < 0 or _index(ins, lambda s: bool(_STORE.match(s)), w2, after) < 0:
        problems.append("publish: no store of published_seq right after W2")
    return problems


def check_aarch64_read(ins: list[str]) -> list[str]:
    if not ins:
        return ["latch_read not found in the assembly"]
    problems = []
    acq = _index(ins, lambda s: bool(_ACQ_LOAD.match(s)))
    if acq < 0:
        problems.append("read: no acquire load (ldar/ldapr) of published_seq")
    elif _index(ins, _call("guarded_copy"), acq) < 0:
        problems.append("read: the acquire load does not come before the slot copy")
    barriers = [i for i, s in enumerate(ins) if s in ("dmb ishld", "dmb ish")]
    if not barriers:
        problems.append("read: no acquire barrier (dmb ishld) before the re-check (R1)")
    for b in barriers:
        load = _index(ins, lambda s: bool(_SEQ_LOAD.match(s)), b + 1)
        call = _index(ins, lambda s: s.startswith("bl "), b + 1)
        if load < 0 or 0 <= call < load:
            problems.append("read: R1 is not directly before the re-load of published_seq")
    return problems


def check_aarch64_asm(asm: str) -> list[str]:
    return check_aarch64_publish(asm_function(asm, "latch_publish")) + check_aarch64_read(
        asm_function(asm, "latch_read")
    )


# ------------------------------- GIMPLE (any target) -------------------------------

# C11 memory orders as GCC's GIMPLE prints them.
RELAXED, ACQUIRE, RELEASE, ACQ_REL, SEQ_CST = 0, 2, 3, 4, 5
_FENCE = re.compile(r"__atomic_thread_fence \((\d+)\);")
_LOAD = re.compile(r"__atomic_load_8 \((seqp_\d+)(?:\(ab\))?, (\d+)\);")
_STORE_SEQ = re.compile(r"__atomic_store_8 \((seqp_\d+)(?:\(ab\))?, ")


def ir_function(dump: str, name: str) -> list[str]:
    m = re.search(
        rf"^;; Function {re.escape(name)} \(.*?\n(.*?)(?=^;; Function |\Z)", dump, re.M | re.S
    )
    if m is None:
        return []
    return [s.strip() for s in m.group(1).splitlines() if s.strip()]


def check_ir_publish(stmts: list[str]) -> list[str]:
    if not stmts:
        return ["latch_publish not found in the GIMPLE dump"]
    fences = [(i, int(_FENCE.search(s).group(1))) for i, s in enumerate(stmts) if _FENCE.search(s)]
    rel = [i for i, order in fences if order in (RELEASE, ACQ_REL, SEQ_CST)]
    problems = [
        f"publish: a fence of order {order} is not a release fence"
        for _, order in fences
        if order not in (RELEASE, ACQ_REL, SEQ_CST)
    ]
    if len(rel) != 2:
        return [*problems, f"publish: {len(rel)} release fences, expected 2 (W1, W2)"]
    w1, w2 = rel
    slot_store = _index(stmts, lambda s: s.startswith("MEM") and "slot_" in s and "] = " in s)
    copy = _index(stmts, lambda s: s.startswith("memcpy ("))
    seq_store = _index(stmts, lambda s: bool(_STORE_SEQ.search(s)))
    if slot_store < 0 or copy < 0 or seq_store < 0:
        return [*problems, "publish: slot stores, payload memcpy or sequence store not found"]
    if not w1 < slot_store < copy < w2:
        problems.append("publish: W1 is not before the slot stores, or W2 not after the copy")
    if seq_store != w2 + 1:
        problems.append("publish: the store of published_seq does not directly follow W2")
    return problems


def check_ir_read(stmts: list[str]) -> list[str]:
    if not stmts:
        return ["latch_read not found in the GIMPLE dump"]
    loads = [(i, int(_LOAD.search(s).group(2))) for i, s in enumerate(stmts) if _LOAD.search(s)]
    if not loads:
        return ["read: no load of published_seq (seqp) found"]
    problems = []
    if loads[0][1] not in (ACQUIRE, SEQ_CST):
        problems.append(
            f"read: the first load of published_seq has order {loads[0][1]}, not acquire"
        )
    rechecks = loads[1:]
    if not rechecks:
        problems.append("read: no re-check load of published_seq")
    for i, _ in rechecks:
        m = _FENCE.search(stmts[i - 1])
        if m is None or int(m.group(1)) not in (ACQUIRE, ACQ_REL, SEQ_CST):
            problems.append(
                "read: the re-check of published_seq is not directly after an acquire fence (R1)"
            )
    return problems


def check_ir(dump: str) -> list[str]:
    return check_ir_publish(ir_function(dump, "latch_publish")) + check_ir_read(
        ir_function(dump, "latch_read")
    )
