"""Oracle test: random operation sequences against a reference model of the allocator.

After every step each `KVCachePoolSnapshot` field kept incrementally by `KVBlockPool` is
compared with a brute-force recomputation: holder counts and the deferred-block mask are
built from every block table with torch (as ATOM does, reading array('i') buffers), the
rest from a slow reference model that mirrors the documented allocator semantics (ids the
pool chooses freely are observed and validated, not predicted).
"""

from __future__ import annotations

import os
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvsidecar.agent.pool import KVBlockPool, convert_table, hash_block_tokens
from kvsidecar.protocol.schema import KVCachePoolSnapshot
from tests.agent.test_pool_validation import same, state

MAX_EXAMPLES = int(os.environ.get("KVSIDECAR_ORACLE_EXAMPLES", "2000"))  # >= 2000 in CI
STEPS = 30
SEQUENCES = 0  # sequences run, counted at teardown
STEPS_RUN = 0

KINDS = ("list", "array", "tensor")
CONNECTORS = ("pd", "offload")
PREFIXES = (list(range(100, 132)), list(range(200, 232)), [7] * 32)
ROOT = 0x6B76_7369_6465  # the pool's root parent hash (part of the hashing spec)
ITEMSIZE = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}


def table_tensor(table) -> torch.Tensor:
    """Block ids as a long tensor; array('i') is read through its buffer (no Python set)."""
    if isinstance(table, torch.Tensor):
        return table.to(torch.long)
    if isinstance(table, array):
        if len(table) == 0:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(table, dtype=torch.int32).to(torch.long)
    return torch.tensor(table, dtype=torch.long)


@dataclass
class Req:
    table: list[int]
    ntok: int
    kind: str
    tail: list[int] | None
    hashes: list[int]
    pending: set[str] | None = None
    # CLOCK_MONOTONIC read just before and just after the deferring call: the pool's stamp
    # for this request must lie in between.
    deferred_at: tuple[int, int] | None = None


@dataclass
class Model:
    bs: int
    rows: int
    total: int
    in_shrink: bool = False
    target: int = 0
    refs: dict[int, int] = field(default_factory=dict)  # holders > 0 only
    reserve: list[int] = field(default_factory=list)  # LIFO, like the pool's ledger
    cached: OrderedDict[int, int] = field(default_factory=OrderedDict)  # bid -> hash, LRU first
    h2b: dict[int, int] = field(default_factory=dict)
    bhash: dict[int, int] = field(default_factory=dict)  # registered blocks (held or cached)
    fill: dict[int, int] = field(default_factory=dict)
    reqs: dict[str, Req] = field(default_factory=dict)
    leases: dict[int, list[int]] = field(default_factory=dict)
    raws: list[list[int]] = field(default_factory=list)
    allocs: int = 0
    frees: int = 0
    evictions: int = 0
    failures: int = 0
    queries: int = 0
    hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0

    def allocated(self) -> int:
        return len(self.refs) + len(self.reserve)

    def room(self) -> int:
        cap = self.target if self.in_shrink else self.total
        return max(0, cap - self.allocated())

    def fits(self, need: int, revive: int = 0) -> bool:
        return max(0, need - len(self.reserve)) + revive <= self.room()

    def take_fresh(self, ids: list[int]) -> None:
        """Validate fresh blocks the pool chose: free ones first, then the LRU cached ones."""
        n = len(ids)
        free_room = max(0, self.total - self.allocated() - len(self.cached))
        evict = n - min(n, free_room)
        evicted = list(self.cached)[:evict]
        assert set(evicted) <= set(ids), (evicted, ids)
        for b in ids:
            assert 1 <= b < self.rows
            if b not in evicted:
                assert b not in self.refs and b not in self.cached and b not in self.reserve
        for b in evicted:
            h = self.cached.pop(b)
            del self.h2b[h]
            del self.bhash[b]
        self.evictions += evict
        self.allocs += n
        for b in ids:
            self.fill[b] = 0

    def alloc(self, ids: list[int]) -> None:
        """ids handed to a holder: the ledger drains first (LIFO), then fresh blocks."""
        assert len(set(ids)) == len(ids)
        drained = min(len(ids), len(self.reserve))
        expect = [self.reserve.pop() for _ in range(drained)]
        assert ids[:drained] == expect
        for b in expect:  # still allocated: moves from the ledger to the holder
            self.refs[b] = 1
            self.fill[b] = 0
        self.take_fresh(ids[drained:])
        for b in ids[drained:]:
            self.refs[b] = 1

    def unref(self, blocks) -> None:
        for b in blocks:
            rc = self.refs[b] - 1
            if rc:
                self.refs[b] = rc
                continue
            del self.refs[b]
            self.frees += 1
            if b in self.bhash:
                self.cached[b] = self.bhash[b]
            else:
                self.fill[b] = 0

    def evict_to_capacity(self) -> None:
        excess = self.allocated() + len(self.cached) - self.total
        for _ in range(max(0, excess)):
            b, h = self.cached.popitem(last=False)
            del self.h2b[h]
            del self.bhash[b]
            self.fill[b] = 0
            self.evictions += 1

    def maybe_finish_shrink(self) -> None:
        if self.in_shrink and self.allocated() <= self.target:
            self.total, self.in_shrink, self.target = self.target, False, 0
            self.evict_to_capacity()

    def register(self, table: list[int], hashes: list[int], start: int) -> None:
        for j in range(start, len(hashes)):
            h = hashes[j]
            if h not in self.h2b:
                self.h2b[h] = table[j]
                self.bhash[table[j]] = h

    def set_fill(self, req: Req, first: int) -> None:
        for j in range(first, len(req.table)):
            self.fill[req.table[j]] = min(self.bs, req.ntok - j * self.bs)


class PoolMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(2, 20),
        bs=st.sampled_from([1, 2, 4]),
        mla=st.booleans(),
        layers=st.integers(1, 3),
        dtype=st.sampled_from(list(ITEMSIZE)),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_blocks, bs, mla, layers, dtype, caching):
        self.buffers = 1 if mla else 2
        self.pool = KVBlockPool(
            num_blocks,
            bs,
            num_layers=layers,
            kv_heads=1,
            head_dim=2,
            num_kv_buffers=self.buffers,
            dtype=dtype,
            device="cpu",
            pool_name="mla" if mla else "block_pool",
            enable_prefix_caching=caching,
        )
        self.caching = caching
        self.m = Model(bs=bs, rows=num_blocks + 1, total=num_blocks)
        self.bsb = bs * 1 * 2 * ITEMSIZE[dtype]
        self.layers = layers
        self.next_id = 0
        self.unique = 10_000

    # -------------------------------------------------------------- helpers

    def _pick(self, items, i):
        return items[i % len(items)]

    def _live(self):
        return [r for r, q in self.m.reqs.items() if q.pending is None]

    def _deferred(self):
        return [r for r, q in self.m.reqs.items() if q.pending is not None]

    def _allocate(self, tokens: list[int], kind: str) -> None:
        m, bs = self.m, self.m.bs
        rid = f"r{self.next_id}"
        self.next_id += 1
        result = self.pool.allocate_prompt(rid, convert_table(tokens, kind))
        hashes, parent = [], ROOT
        for i in range(len(tokens) // bs if self.caching else 0):
            parent = hash_block_tokens(parent, tuple(tokens[i * bs : (i + 1) * bs]))
            hashes.append(parent)
        hit_ids = []
        for h in hashes:
            if h not in m.h2b:
                break
            hit_ids.append(m.h2b[h])
        m.queries += len(hit_ids) + (len(hit_ids) < len(hashes))
        m.hits += len(hit_ids)
        if self.caching:
            m.query_tokens += len(tokens)
            m.hit_tokens += len(hit_ids) * bs
        revive = [b for b in hit_ids if b not in m.refs]
        nblocks = -(-len(tokens) // bs)
        need = nblocks - len(hit_ids)
        if not m.fits(need, len(revive)):
            assert result is None
            m.failures += 1
            return
        assert result == len(hit_ids)
        table = list(self.pool.block_table(rid))
        assert table[: len(hit_ids)] == hit_ids
        for b in revive:
            del m.cached[b]
            m.allocs += 1
        for b in hit_ids:
            m.refs[b] = m.refs.get(b, 0) + 1
        m.alloc(table[len(hit_ids) :])
        tail = tokens[len(hashes) * bs :] if self.caching else None
        req = Req(table, len(tokens), kind, tail, hashes)
        m.set_fill(req, len(hit_ids))
        m.register(table, hashes, len(hit_ids))
        m.reqs[rid] = req

    def _free_req(self, rid: str) -> None:
        req = self.m.reqs.pop(rid)
        self.m.unref(reversed(req.table))
        self.m.maybe_finish_shrink()

    # -------------------------------------------------------------- rules

    @rule(
        p=st.integers(0, len(PREFIXES) - 1),
        plen=st.integers(0, 14),
        tail=st.lists(st.integers(0, 3), max_size=5),
        kind=st.sampled_from(KINDS),
    )
    def allocate(self, p, plen, tail, kind):
        self._allocate(PREFIXES[p][:plen] + tail, kind)

    @rule(extra=st.integers(-2, 2), kind=st.sampled_from(KINDS))
    def pressure(self, extra, kind):
        # Unique tokens sized around what is available: forces eviction or a failure.
        n = max(1, self.pool.snapshot().available_blocks + extra) * self.m.bs
        self._allocate(list(range(self.unique, self.unique + n)), kind)
        self.unique += n

    @precondition(lambda self: self._live())
    @rule(i=st.integers(0, 99), n=st.integers(0, 6), with_tokens=st.booleans())
    def append(self, i, n, with_tokens):
        m = self.m
        rid = self._pick(self._live(), i)
        req = m.reqs[rid]
        toks = [self.unique + k for k in range(n)] if with_tokens else None
        self.unique += n
        ok = self.pool.append_slots(rid, n, None if toks is None else convert_table(toks, req.kind))
        new = req.ntok + n
        need = -(-new // m.bs) - len(req.table)
        if need > 0:
            if not m.fits(need):
                assert ok is False
                m.failures += 1
                return
            got = list(self.pool.block_table(rid))[len(req.table) :]
            m.alloc(got)
            req.table.extend(got)
        assert ok is True
        first = req.ntok // m.bs
        req.ntok = new
        m.set_fill(req, first)
        if req.tail is not None:
            if toks is None:
                req.tail = None
            else:
                req.tail.extend(toks)
                start = len(req.hashes)
                parent = req.hashes[-1] if req.hashes else ROOT
                while len(req.tail) >= m.bs:
                    parent = hash_block_tokens(parent, tuple(req.tail[: m.bs]))
                    req.hashes.append(parent)
                    del req.tail[: m.bs]
                m.register(req.table, req.hashes, start)

    @precondition(lambda self: self._live())
    @rule(i=st.integers(0, 99), nconn=st.integers(0, 2), abort=st.booleans(), rev=st.booleans())
    def finish(self, i, nconn, abort, rev):
        rid = self._pick(self._live(), i)
        conns = list(CONNECTORS[:nconn])
        if rev:
            conns.reverse()
        before = time.monotonic_ns()
        deferred = (self.pool.abort if abort else self.pool.finish)(rid, conns)
        after = time.monotonic_ns()
        assert deferred == bool(conns)
        if conns:
            self.m.reqs[rid].pending = set(conns)
            self.m.reqs[rid].deferred_at = (before, after)
        else:
            self._free_req(rid)

    @precondition(lambda self: self._deferred())
    @rule(i=st.integers(0, 99), j=st.integers(0, 1))
    def release(self, i, j):
        rid = self._pick(self._deferred(), i)
        req = self.m.reqs[rid]
        conn = self._pick(sorted(req.pending), j)
        done = self.pool.release(rid, conn)
        req.pending.discard(conn)
        assert done == (not req.pending)
        if done:
            self._free_req(rid)

    @precondition(lambda self: any(q.table for q in self.m.reqs.values()))
    @rule(i=st.integers(0, 99), picks=st.lists(st.integers(0, 99), min_size=1, max_size=3))
    def lease(self, i, picks):
        rid = self._pick([r for r, q in self.m.reqs.items() if q.table], i)
        req = self.m.reqs[rid]
        ids = sorted({self._pick(req.table, k) for k in picks})
        lid = self.pool.lease(rid, convert_table(ids, req.kind))
        assert lid not in self.m.leases
        self.m.leases[lid] = ids
        for b in ids:
            self.m.refs[b] += 1

    @precondition(lambda self: self.m.leases)
    @rule(i=st.integers(0, 99))
    def release_lease(self, i):
        lid = self._pick(sorted(self.m.leases), i)
        self.pool.release_lease(lid)
        self.m.unref(self.m.leases.pop(lid))
        self.m.maybe_finish_shrink()

    @rule(n=st.integers(0, 3))
    def raw_alloc(self, n):
        got = self.pool.alloc_blocks(n)
        if not self.m.fits(n):
            assert got is None
            self.m.failures += 1
            return
        self.m.alloc(got)
        self.m.raws.append(got)

    @precondition(lambda self: self.m.raws)
    @rule(i=st.integers(0, 99))
    def raw_free(self, i):
        ids = self.m.raws.pop(i % len(self.m.raws))
        self.pool.free_blocks(ids)
        self.m.unref(ids)
        self.m.maybe_finish_shrink()

    @rule(n=st.integers(0, 4))
    def reserve(self, n):
        ok = self.pool.try_to_reserve(n)
        m = self.m
        if n > m.room():
            assert ok is False
            m.failures += 1
            return
        assert ok is True
        got = self.pool._reserve[len(self.pool._reserve) - n :] if n else []
        m.take_fresh(got)
        m.reserve.extend(got)

    @rule(n=st.integers(0, 4))
    def release_reserved(self, n):
        k = self.pool.release_reserved(n)
        m = self.m
        assert k == min(n, len(m.reserve))
        for _ in range(k):
            b = m.reserve.pop()
            m.fill[b] = 0
        m.frees += k
        m.maybe_finish_shrink()

    @rule(delta=st.integers(-8, 4))
    def resize(self, delta):
        m = self.m
        new = max(0, m.total + delta)
        done = self.pool.resize(new)
        if new < m.allocated():
            assert done is False
            m.in_shrink, m.target = True, new
        else:
            assert done is True
            m.rows = max(m.rows, new + 1)
            m.total, m.in_shrink, m.target = new, False, 0
            m.evict_to_capacity()

    # -------------------------------------------------------------- invalid input
    # Issue #12 item 16: every refused call leaves the pool exactly as it was (snapshot and
    # allocator state), so the model (untouched) still matches at the next invariant.

    def _refused(self, call) -> None:
        before = state(self.pool)
        try:
            call()
        except (ValueError, TypeError, KeyError):
            pass
        else:
            raise AssertionError("invalid input was accepted")
        assert same(state(self.pool), before), "a refused call changed the pool"

    @rule(
        i=st.integers(0, 99),
        bad=st.sampled_from(["negative", "null", "beyond", "request", "twice", "float"]),
    )
    def invalid_free(self, i, bad):
        m = self.m
        valid = list(m.raws[i % len(m.raws)]) if m.raws else []
        held = [b for q in m.reqs.values() for b in q.table] + [
            b for ids in m.leases.values() for b in ids
        ]
        extra = {
            "negative": [-1 - i % m.rows],  # wrapped to another holder's block before
            "null": [0],
            "beyond": [m.rows + i],
            "request": [held[i % len(held)]] if held else [0],  # not alloc_blocks' to free
            "twice": valid[:1] or [0],  # listed more often than alloc_blocks handed it out
            "float": [1.5],
        }[bad]
        self._refused(lambda: self.pool.free_blocks(valid + extra))

    @rule(which=st.integers(0, 5), x=st.sampled_from([-1, 1.5, "2", None]))
    def invalid_count(self, which, x):
        pool, live = self.pool, self._live()
        if which == 4 and x == -1:
            x = 0.5  # release_reserved(-1) is valid ("up to n"): use a non-integer instead
        calls = [
            lambda: pool.alloc_blocks(x),
            lambda: pool.try_to_reserve(x),
            lambda: pool.resize(x),
            lambda: pool.append_slots(live[0], x) if live else pool.alloc_blocks(x),
            lambda: pool.release_reserved(x),
            lambda: pool.append_slots(live[-1], 2, [1]) if live else pool.resize(x),
        ]
        self._refused(calls[which])

    @rule(p=st.integers(0, len(PREFIXES) - 1), x=st.sampled_from([1.5, "2", None]))
    def invalid_prompt(self, p, x):
        # Token ids are integers, as append_slots' are: a prompt with one that is not is
        # refused unchanged (a pool skipping that check survived this oracle without it).
        self._refused(lambda: self.pool.allocate_prompt("never-added", [*PREFIXES[p][:3], x]))

    @rule(i=st.integers(0, 99), kind=st.sampled_from(["negative", "beyond", "foreign"]))
    def invalid_lease(self, i, kind):
        m = self.m
        tabled = [r for r, q in m.reqs.items() if q.table]
        if not tabled:
            self._refused(lambda: self.pool.lease("no-such-request", [1]))
            return
        rid = tabled[i % len(tabled)]
        mine = m.reqs[rid].table
        others = [b for r, q in m.reqs.items() if r != rid for b in q.table if b not in mine]
        bad = {"negative": -1 - i % m.rows, "beyond": m.rows + i}.get(kind)
        if bad is None:
            bad = others[i % len(others)] if others else 0
        self._refused(lambda: self.pool.lease(rid, [mine[0], bad]))

    @rule(i=st.integers(0, 99))
    def invalid_release(self, i):
        live, deferred = self._live(), self._deferred()
        if deferred and i % 3 == 0:
            self._refused(lambda: self.pool.release(deferred[0], "no-such-connector"))
        elif live and i % 3 == 1:
            self._refused(lambda: self.pool.release(live[0], "pd"))  # not deferred
        else:
            self._refused(lambda: self.pool.finish("no-such-request"))

    # -------------------------------------------------------------- the oracle

    def expected(self) -> KVCachePoolSnapshot:
        """Every snapshot field, recomputed from scratch."""
        m, pool = self.m, self.pool
        holders = torch.zeros(m.rows, dtype=torch.long)
        deferred = torch.zeros(m.rows, dtype=torch.bool)
        fill = torch.zeros(m.rows, dtype=torch.long)
        for rid, req in m.reqs.items():
            table = pool.block_table(rid, req.kind)
            assert type(table) is type(convert_table([], req.kind))
            t = table_tensor(table)
            assert t.tolist() == req.table
            # The per-request queries agree with the model too (a pool whose
            # pending_connectors answered empty for a deferred request survived without it).
            assert pool.is_deferred(rid) == (req.pending is not None), rid
            assert pool.pending_connectors(rid) == frozenset(req.pending or ()), rid
            holders.index_add_(0, t, torch.ones_like(t))
            if req.pending is not None:
                deferred[t] = True
            pos = torch.arange(len(t))
            toks = (req.ntok - pos * m.bs).clamp(max=m.bs)
            fill.scatter_reduce_(0, t, toks, reduce="amax")
        for ids in list(m.leases.values()) + m.raws:
            t = torch.tensor(ids, dtype=torch.long)
            holders.index_add_(0, t, torch.ones_like(t))
            for b in ids:  # blocks a freed request left to a lease keep their tokens
                fill[b] = max(int(fill[b]), m.fill[b])
        held = holders > 0
        assert not bool(held[0]), "null block handed out"
        assert torch.equal(torch.tensor(pool._refcount), holders), "refcounts"
        assert {b for b, c in m.refs.items() if c} == set(held.nonzero().flatten().tolist())
        reserved = len(m.reserve)
        allocated = int(held.sum()) + reserved
        cap = m.target if m.in_shrink else m.total
        available = reserved + max(0, cap - allocated)
        unit = self.bsb * self.layers * self.buffers
        return KVCachePoolSnapshot(
            pool_name=pool.stats.pool_name,
            group_id=0,
            num_layers=self.layers,
            num_kv_buffers=self.buffers,
            block_size_tokens=m.bs,
            block_size_bytes=self.bsb,
            total_blocks=m.total,
            allocated_blocks=allocated,
            reserved_blocks=reserved,
            available_blocks=available,
            cached_blocks=len(m.cached),
            allocated_bytes=allocated * unit,
            reserved_bytes=reserved * unit,
            available_bytes=available * unit,
            # The reservation is the storage rows (null block included), not the capacity.
            virtual_per_layer_bytes=m.rows * self.bsb * self.buffers,
            virtual_total_bytes=m.rows * self.bsb * self.buffers * self.layers,
            mapped_bytes=m.rows * unit,
            virtual_blocks=m.rows,
            in_shrink=m.in_shrink,
            shrink_target_blocks=m.target if m.in_shrink else None,
            # schema.md: only deferred requests holding a block of this pool count.
            deferred_free_requests=sum(bool(m.reqs[r].table) for r in self._deferred()),
            deferred_free_blocks=int(deferred.sum()),
            tokens_used=int(fill[held].sum()),
            allocs_total=m.allocs,
            frees_total=m.frees,
            evictions_total=m.evictions,
            alloc_failures_total=m.failures,
            prefix_queries_total=m.queries,
            prefix_hits_total=m.hits,
            prefix_query_tokens_total=m.query_tokens,
            prefix_hit_tokens_total=m.hit_tokens,
            null_block_reserved=True,
        )

    @invariant()
    def snapshot_matches(self):
        global STEPS_RUN
        STEPS_RUN += 1
        m, pool = self.m, self.pool
        # Raw allocator state the model mirrors exactly.
        assert pool._reserve == m.reserve
        assert list(pool._cached) == list(m.cached), "LRU order"
        assert pool._hash_to_block == m.h2b
        assert pool.kv_cache(0).shape[1] == m.rows == pool.storage_rows
        for b in m.cached:
            assert m.refs.get(b, 0) == 0
        got = pool.snapshot()
        want = self.expected()
        # Issue 30 item 3: a deferred request is not running, whether it holds a block or not.
        assert pool.num_running == len(self._live()), "num_running"
        # The oldest deferral: the earliest-deferred request still deferred (dict order is
        # deferral order in the model), its stamp within that call's clock bracket.
        stamps = [q.deferred_at for q in m.reqs.values() if q.pending is not None and q.table]
        if stamps:
            lo, hi = min(stamps)
            assert lo <= got.oldest_deferred_free_mono_ns <= hi
            want.oldest_deferred_free_mono_ns = got.oldest_deferred_free_mono_ns
        else:
            want.oldest_deferred_free_mono_ns = 0
        for name in KVCachePoolSnapshot.__struct_fields__:
            assert getattr(got, name) == getattr(want, name), (
                name,
                getattr(got, name),
                getattr(want, name),
            )
        assert got.available_blocks >= got.reserved_blocks >= 0
        assert got.allocs_total - got.frees_total == got.allocated_blocks
        assert got.deferred_free_blocks <= got.allocated_blocks
        assert got.tokens_used <= (got.allocated_blocks - got.reserved_blocks) * m.bs

    def teardown(self):
        global SEQUENCES
        SEQUENCES += 1


SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


# Fixed work (MAX_EXAMPLES sequences, derandomized), so the timeout is a hang guard only:
# beside two CPU burners at load average ~30 it ran past the suite's default 300 s.
@pytest.mark.timeout(900)
def test_pool_oracle():
    before_seq, before_steps = SEQUENCES, STEPS_RUN
    t0 = time.perf_counter()
    run_state_machine_as_test(PoolMachine, settings=SETTINGS)
    ran = SEQUENCES - before_seq
    print(
        f"oracle: {ran} sequences, {STEPS_RUN - before_steps} checked steps, "
        f"{time.perf_counter() - t0:.1f} s"
    )
    assert ran >= MAX_EXAMPLES
