"""Drive vLLM's real ``Scheduler`` / ``AsyncScheduler`` directly, the way vLLM's own scheduler
unit tests do (a KV-cache config planned by vLLM's own planner, model-runner outputs built by
hand, no model, no GPU), with the kvsidecar plugin applied through ``register()`` and
``SchedulerConfig.get_scheduler_cls()`` (the engine core's path). After every step and every
abort, every field the plugin published (read back from the shared-memory segment) is compared
with a brute-force recount over ``BlockPool.blocks`` and ``Scheduler.requests``, and the prefix
counters with vLLM's own ``PrefixCacheStats``.

Version independent: it runs in the vLLM 0.32.0 env (``vllm``) and the 0.33.0 scheduler env
(``vllm033``). Run by tests/engines/test_vllm_scheduler.py:

    python scheduler_driver.py SHM_DIR [--steps N] [--only NAME] [--sabotage HOOK ...]

Prints one ``RESULT {json}`` line per run (a config and a seed, or a sabotaged run).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import shutil
import sys
import tempfile
import time
import types
from collections import deque
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import plan_kv_cache, plugin_scheduler, recount_pool, write_model

BLOCK = 16


@dataclass(frozen=True)
class Config:
    name: str
    seed: int
    async_sched: bool = False  # AsyncScheduler, fed with a batch queue of 2 like a GPU engine
    prefix_caching: bool = True
    num_blocks: int = 48  # tiny: preemption and eviction under pressure
    connector: str | None = "kv_producer"  # hold frees (producer), fenced frees (consumer)
    hybrid: bool = False  # full attention + sliding window: two KV-cache groups, one pool


CONFIGS = (
    Config("sync", 1),
    Config("sync", 2),
    Config("async", 1, async_sched=True),
    Config("async", 2, async_sched=True),
    Config("no-prefix-cache", 1, prefix_caching=False),
    Config("consumer-async", 1, async_sched=True, connector="kv_consumer"),
    Config("hybrid", 1, hybrid=True),
    Config("hybrid-async", 2, async_sched=True, hybrid=True),
)

# A sabotaged hook: the plugin's wrapper replaced by vLLM's own method (or a no-op), as a
# plugin that lost that hook would be. Each must produce mismatches.
SABOTAGE = ("touch", "free_blocks", "remove_hash", "defer", "release")


def build(cfg: Config, model_dir: str):
    import torch
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        SlidingWindowSpec,
    )

    max_len = 1024
    sched_cfg = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=96,  # < long prompts: chunked prefill
        max_model_len=max_len,
        enable_chunked_prefill=True,
        async_scheduling=cfg.async_sched,
        is_encoder_decoder=False,
    )
    model = ModelConfig(model=model_dir, dtype="float32", seed=cfg.seed, skip_tokenizer_init=True)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=cfg.prefix_caching)
    kv = None
    if cfg.connector:
        kv = KVTransferConfig(
            kv_connector="HoldConnectorHMA" if cfg.hybrid else "HoldConnector",
            kv_connector_module_path="kvsidecar_hold_connector",
            kv_role=cfg.connector,
            kv_connector_extra_config={"hold": cfg.connector == "kv_producer"},
        )
    events = None
    if os.environ.get("KVSIDECAR_KV_EVENTS") == "1":  # vLLM's own publisher, the reference
        from vllm.config import KVEventsConfig

        wire = tempfile.mkdtemp(prefix="kvsidecar-kvev-")  # its sockets (KVEventsCheck.wire)
        atexit.register(shutil.rmtree, wire, True)
        events = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"ipc://{wire}/pub",
            replay_endpoint=f"ipc://{wire}/replay",
            topic="vllm",
        )
    vllm_config = VllmConfig(
        scheduler_config=sched_cfg,
        model_config=model,
        cache_config=cache,
        kv_transfer_config=kv,
        kv_events_config=events,
    )
    # VllmConfig may switch these for the CPU platform; the driver decides.
    vllm_config.scheduler_config.async_scheduling = cfg.async_sched
    if cfg.hybrid:
        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float32)
    specs = {"layers.0": full, "layers.2": full}
    if cfg.hybrid:
        swa = SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float32, sliding_window=64
        )
        specs.update({"layers.1": swa, "layers.3": swa})
    # vLLM's own plan (its real layout: the groups overlay one backing allocation).
    vllm_config.cache_config.kv_cache_layout = "LBHNC"
    kv_cache_config = plan_kv_cache(vllm_config, specs, cfg.num_blocks * 2 * full.page_size_bytes)
    assert kv_cache_config.num_blocks == cfg.num_blocks
    assert len(kv_cache_config.kv_cache_groups) == (2 if cfg.hybrid else 1)
    cache.num_gpu_blocks = cfg.num_blocks
    sched = plugin_scheduler(vllm_config, kv_cache_config, BLOCK)
    # A block holds one group's layers (2), in one backing allocation.
    return sched, kv_cache_config, full.page_size_bytes, 2


def sabotage(sched, hook: str) -> None:
    """Undo one of the plugin's hooks on this scheduler (the mutation under test)."""
    from vllm.v1.core.block_pool import BlockPool

    pool = sched.kv_cache_manager.block_pool
    sidecar = sched._kvsidecar
    if hook == "touch":
        pool.touch = types.MethodType(BlockPool.touch, pool)
    elif hook == "free_blocks":
        pool.free_blocks = types.MethodType(BlockPool.free_blocks, pool)
    elif hook == "remove_hash":
        pool._remove_cached_block_hashes = types.MethodType(
            BlockPool._remove_cached_block_hashes, pool
        )
    elif hook == "defer":
        sidecar.after_free_request = lambda *a, **k: None
    elif hook == "release":
        sidecar.before_free_blocks = lambda *a, **k: None
    else:
        raise SystemExit(f"unknown sabotage {hook!r}: one of {', '.join(SABOTAGE)}")


def _pools(sched) -> list:
    """Distinct BlockPools in the plugin's order (the manager's own first)."""
    manager = sched.kv_cache_manager
    pools = [manager.block_pool]
    for m in manager.coordinator.single_type_managers:
        if all(m.block_pool is not p for p in pools):
            pools.append(m.block_pool)
    return pools


def recount(sched, pool) -> dict:
    """Every published pool field that is a state, recounted from vLLM's own objects."""
    return recount_pool(sched, pool)[0]


class Run:
    """One randomized workload through one scheduler, checked after every step."""

    def __init__(self, cfg: Config, steps: int, model_dir: str, hook: str | None) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
        from vllm.v1.request import Request, RequestStatus

        from kvsidecar.protocol.reader import SegmentReader

        self.cfg, self.steps_wanted, self.hook = cfg, steps, hook
        self.rng = random.Random(cfg.seed)
        self.sched, self.kv_config, self.page, self.layers = build(cfg, model_dir)
        self.sidecar = getattr(self.sched, "_kvsidecar", None)
        if self.sidecar is None:
            raise SystemExit(f"plugin not active: scheduler is {type(self.sched).__name__}")
        if hook:
            sabotage(self.sched, hook)
        self.reader = SegmentReader(path=self.sidecar.agent.segment_path)
        err = self.reader.attach()
        if err is not None:
            raise SystemExit(f"attach: {err}")
        self.kv_events = KVEventsCheck(self.sched, self.sidecar, by_block=cfg.hybrid)
        init_none_hash(sha256)  # what the engine core does (vLLM's default hash)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.Request, self.Params, self.Status = Request, SamplingParams, RequestStatus
        self.MRO, self.KVOut = ModelRunnerOutput, KVConnectorOutput
        self.mismatches: list[str] = []
        self.checks = self.steps = 0
        self.last_step = -1
        self.vllm_queries = self.vllm_hits = 0  # flushed from vLLM's PrefixCacheStats
        self.window: dict[str, tuple[int, int]] = {}  # deferred id -> (before, after)
        self.known_finished: set[str] = set()  # finished ids the "worker" was told about
        self.seen = dict.fromkeys(
            (
                "added",
                "n_gt_1",
                "aborts",
                "releases",
                "preemptions",
                "chunked",
                "max_deferred",
                "shared_deferred",
                "fenced",
            ),
            0,
        )
        self.prefixes = [
            [self.rng.randrange(3, 1000) for _ in range(n)] for n in (48, 80, 20, 130, 64)
        ]
        self.next_id = 0

    # -- the workload -----------------------------------------------------------------

    def add_requests(self) -> None:
        rng = self.rng
        prompt = list(rng.choice(self.prefixes)) if rng.random() < 0.8 else []
        if rng.random() < 0.7 or not prompt:  # else a full-prefix repeat (a complete hit)
            prompt += [rng.randrange(3, 1000) for _ in range(rng.randint(1, 150))]
        n = rng.choice((1, 1, 1, 2, 3))  # n>1: the engine fans out identical children
        parent = f"p{self.next_id}"
        self.next_id += 1
        params = self.Params(max_tokens=rng.randint(1, 40), ignore_eos=True)
        for i in range(n):
            rid = f"{i}_{parent}" if n > 1 else parent
            req = self.Request(
                request_id=rid,
                prompt_token_ids=list(prompt),
                sampling_params=params,
                pooling_params=None,
                block_hasher=self.hasher,
            )
            self.sched.add_request(req)
            self.seen["added"] += 1
        self.seen["n_gt_1"] += n > 1

    def output_for(self, out, prefill_chunks: set[str]):
        """What a model runner returns for ``out``: a token per request past its prompt,
        and the connector's ``finished_sending`` for some of the held requests."""
        sched = self.sched
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            partial = rid in prefill_chunks
            self.seen["chunked"] += partial
            sampled.append([] if partial else [self.rng.randrange(3, 1000)])
        self.known_finished |= set(out.finished_req_ids)
        held = [  # sorted: a set's order varies with the hash seed, the run must not
            rid
            for rid in sorted(self.known_finished)
            if rid in sched.requests and sched.requests[rid].is_finished()
        ]
        self.known_finished &= set(held) | set(out.finished_req_ids)
        release: set[str] = set()
        if held and (self.draining or self.rng.random() < 0.3):
            self.rng.shuffle(held)
            release = set(held if self.draining else held[: self.rng.randint(1, len(held))])
            self.seen["releases"] += len(release)
            self.known_finished -= release
        kv = self.KVOut(finished_sending=release) if release else None
        return self.MRO(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=kv,
        )

    def update(self, out, prefill_chunks: set[str]) -> None:
        sched = self.sched
        result = sched.update_from_output(out, self.output_for(out, prefill_chunks))
        for eco in (result or {}).values():
            stats = getattr(eco, "scheduler_stats", None)
            pcs = getattr(stats, "prefix_cache_stats", None) if stats else None
            if pcs is not None:
                self.vllm_queries += pcs.queries
                self.vllm_hits += pcs.hits
        self.steps += 1

    def run(self) -> dict:
        rng, sched = self.rng, self.sched
        self.draining = False
        queue: deque = deque()
        preempted: dict[str, int] = {}  # request id -> times preempted (vLLM's own count)
        depth = 2 if self.cfg.async_sched else 1
        t_start = time.monotonic()
        self.check("start", time.monotonic_ns(), time.monotonic_ns(), step=False)
        while True:
            self.draining = self.steps >= self.steps_wanted
            if not self.draining and rng.random() < 0.45 and len(sched.requests) < 14:
                self.add_requests()
            live = [r for r in sched.requests.values() if not r.is_finished()]
            if not self.draining and live and rng.random() < 0.06:
                victims = [r.request_id for r in rng.sample(live, k=min(len(live), 2))]
                t0 = time.monotonic_ns()
                sched.finish_requests(victims, self.Status.FINISHED_ABORTED)
                self.seen["aborts"] += len(victims)
                self.check(f"abort {victims}", t0, time.monotonic_ns(), step=False)
            if self.draining and not sched.requests and not queue:
                break
            t0 = time.monotonic_ns()
            # A GPU engine core with a batch queue: schedule ahead while a step is in
            # flight, then complete the oldest (vLLM's step_with_batch_queue).
            scheduled = False
            if len(queue) < depth and sched.has_requests():
                out = sched.schedule()
                # Decided when scheduled (as the model runner sees the batch): a chunk
                # that does not finish the prompt samples no token.
                chunks = {
                    rid
                    for rid in out.num_scheduled_tokens
                    if getattr(sched.requests[rid], "is_prefill_chunk", False)
                }
                queue.append((out, chunks))
                scheduled = True
            if queue and (len(queue) >= depth or not scheduled):
                self.update(*queue.popleft())
                self.check(f"step {self.steps}", t0, time.monotonic_ns(), step=True)
            for r in sched.requests.values():
                preempted[r.request_id] = r.num_preemptions
            self.seen["preemptions"] = sum(preempted.values())
            fenced = len(getattr(sched, "deferred_frees", ()))  # frees vLLM holds back
            self.seen["fenced"] = max(self.seen["fenced"], fenced)
            if self.steps > self.steps_wanted * 5:
                self.mismatches.append("workload did not drain")
                break
        self.kv_events.compare("end", self.mismatches, final=True)
        final = self.reader.read()
        pools = final.snapshot.pools
        result = {
            "config": self.cfg.name,
            "seed": self.cfg.seed,
            "sabotage": self.hook,
            "vllm": final.snapshot.runtime.engine_version,
            "scheduler_class": type(sched).__name__,
            "kv_cache_groups": len(self.kv_config.kv_cache_groups),
            "fencing": bool(getattr(sched, "defer_block_free", False)),  # vLLM fences frees
            "pool_records": len(pools),
            "distinct_pools": len(_pools(sched)),
            "steps": self.steps,
            "checks": self.checks,
            "mismatches": len(self.mismatches),
            "first_mismatches": self.mismatches[:10],
            "run_s": round(time.monotonic() - t_start, 2),
            "evictions_total": pools[0].evictions_total,
            "alloc_failures_total": pools[0].alloc_failures_total,
            "prefix_hit_tokens_total": pools[0].prefix_hit_tokens_total,
            **self.seen,
            **self.kv_events.counts(),
        }
        self.sched.shutdown()
        self.reader.close()
        return result

    # -- the check ----------------------------------------------------------------------

    def check(self, where: str, t0: int, t1: int, *, step: bool) -> None:
        from kvsidecar.protocol.reader import ReadError

        sched, bad = self.sched, self.mismatches
        self.kv_events.compare(where, bad)
        r = self.reader.read()
        if isinstance(r, ReadError):
            bad.append(f"{where}: read failed: {r}")
            return
        snap = r.snapshot
        rt = snap.runtime
        pools = _pools(sched)
        if len(snap.pools) != len(pools):
            bad.append(f"{where}: {len(snap.pools)} pool records for {len(pools)} pools")
            return
        deferred = [rid for rid, q in sched.requests.items() if q.is_finished()]
        for rid in deferred:
            self.window.setdefault(rid, (t0, t1))
        for rid in list(self.window):
            if rid not in deferred:
                del self.window[rid]
        for i, (pool, p) in enumerate(zip(pools, snap.pools)):
            want = recount(sched, pool)
            got = {k: getattr(p, k) for k in want}
            unit = self.page * self.layers if i == 0 else None
            total = want["total_blocks"]
            want.update(
                pool_name="block_pool" if i == 0 else f"block_pool_{i}",
                group_id=0 if i == 0 else p.group_id,
                num_layers=self.layers if len(pools) == 1 else p.num_layers,
                num_kv_buffers=2,
                block_size_tokens=BLOCK,
                block_size_bytes=self.page // 2,
                # The storage (schema 1.4, #22): num_gpu_blocks blocks, the null one included.
                virtual_blocks=total + 1,
                virtual_per_layer_bytes=(total + 1) * self.page,
                # The one backing allocation (each group's tensor repeats its size).
                mapped_bytes=self.kv_config.kv_cache_tensors[0].size if i == 0 else 0,
                tokens_used=None,
                reserved_blocks=0,
            )
            if unit is not None:
                want["virtual_total_bytes"] = (total + 1) * unit
                want["allocated_bytes"] = want["allocated_blocks"] * unit
                want["available_bytes"] = want["available_blocks"] * unit
            for k in list(want)[len(got) :]:
                got[k] = getattr(p, k)
            # Counters: allocs - frees is exactly the allocated set.
            want["allocs-frees"] = want["allocated_blocks"]
            got["allocs-frees"] = p.allocs_total - p.frees_total
            if i == 0:
                manager = sched.kv_cache_manager
                pending = getattr(manager, "prefix_cache_stats", None)
                want["prefix_query_tokens_total"] = self.vllm_queries + (
                    pending.queries if pending is not None else 0
                )
                want["prefix_hit_tokens_total"] = self.vllm_hits + (
                    pending.hits if pending is not None else 0
                )
                got["prefix_query_tokens_total"] = p.prefix_query_tokens_total
                got["prefix_hit_tokens_total"] = p.prefix_hit_tokens_total
                want["usage"] = round(manager.usage, 12)
                got["usage"] = round(p.allocated_blocks / p.total_blocks, 12)
            for k, v in want.items():
                if got.get(k) != v:
                    bad.append(f"{where}: pool {i} {k} published {got.get(k)!r}, recount {v!r}")
            # The oldest deferral: 0 when none, else within the oldest holder's window.
            holding = [self.window[d] for d in deferred if self._holds(d, pool)]
            oldest = p.oldest_deferred_free_mono_ns
            if not holding and oldest != 0:
                bad.append(f"{where}: pool {i} oldest_deferred {oldest} with none deferred")
            if holding:
                lo, hi = min(w[0] for w in holding), min(w[1] for w in holding)
                if not lo <= oldest <= hi:
                    bad.append(f"{where}: pool {i} oldest_deferred {oldest} not in [{lo}, {hi}]")
        running, waiting = sched.get_request_counts()
        for k, v in (
            ("requests_running", running),
            ("requests_waiting", waiting),
            # A deferred request counts only while it holds a block (issue 30 item 3).
            (
                "requests_deferred_free",
                sum(any(self._holds(d, q) for q in pools) for d in deferred),
            ),
        ):
            if getattr(rt, k) != v:
                bad.append(f"{where}: runtime {k} published {getattr(rt, k)!r}, recount {v!r}")
        expect = self.last_step + (1 if step else 0)
        if self.last_step >= 0 and rt.step != expect:
            bad.append(f"{where}: step {rt.step}, expected {expect}")
        self.last_step = rt.step
        self.seen["max_deferred"] = max(self.seen["max_deferred"], len(deferred))
        live_ids = {
            b.block_id
            for rid, q in sched.requests.items()
            if not q.is_finished()
            for b in self._blocks(rid, pools[0])
        }
        shared = {b.block_id for d in deferred for b in self._blocks(d, pools[0])} & live_ids
        self.seen["shared_deferred"] = max(self.seen["shared_deferred"], len(shared))
        self.checks += 1

    def _blocks(self, rid: str, pool) -> list:
        managers = self.sched.kv_cache_manager.coordinator.single_type_managers
        return [
            b
            for m in managers
            if m.block_pool is pool
            for b in m.req_to_blocks.get(rid, ())
            if not b.is_null
        ]

    def _holds(self, rid: str, pool) -> bool:
        return bool(self._blocks(rid, pool))


class KVEventsCheck:
    """With KVSIDECAR_KV_EVENTS=1: the events the daemon's publisher builds from the
    plugin's KV-event segment (RankPublisher.events_for, the real code) against the events
    vLLM's own KVCacheManager.take_events hands its publisher, as msgspec builtins. vLLM
    queues a step's events until update_from_output takes them, so at every check vLLM's
    list so far is a prefix of ours; drained at the end, they are equal.

    ``by_block``: compare per block (kind, hash, group), in order, not whole events: for
    hybrid models, where vLLM's one BlockStored spans the null and masked blocks of a
    sliding-window group (their token ids, the parent before them) and the sidecar splits it
    at each gap (docs/kv-events.md, Limits)."""

    def __init__(self, sched, sidecar, by_block: bool = False) -> None:
        self.by_block = by_block
        self.on = os.environ.get("KVSIDECAR_KV_EVENTS") == "1" and bool(
            sched.kv_cache_manager.enable_caching
        )
        self.theirs: list = []
        self.ours: list = []
        if not self.on:
            return
        import msgspec

        from kvsidecar.daemon.config import KVEventsOptions
        from kvsidecar.protocol.kv_events_reader import KVEventsReader
        from kvsidecar.streams.kv_events_zmq import RankPublisher, _State

        self.builtins = msgspec.to_builtins
        self.sched = sched
        mgr = self.mgr = sched.kv_cache_manager
        take = mgr.take_events

        def take_events():
            events = take()
            self.theirs.extend(self._view(events))
            return events

        mgr.take_events = take_events
        recorder = sidecar.agent.kv_events
        if recorder is None:
            raise SystemExit("KV events on, but the plugin recorded none")
        self.reader = KVEventsReader(path=recorder.path)
        err = self.reader.attach()
        if err is not None:
            raise SystemExit(f"attach: {err}")
        self.pub = RankPublisher("check", "", KVEventsOptions(endpoint="tcp://*:0"), None)
        self.pub._state = _State(self.reader.header.n_slots)
        self.next = 1

    def compare(self, where: str, bad: list[str], final: bool = False) -> None:
        if not self.on:
            return
        if final:  # what is still queued, published as update_from_output publishes it
            from vllm.distributed.kv_events import KVEventBatch

            events = self.mgr.take_events()
            if events:
                self.sched.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))
            self.wire(bad)
        records = self.reader.records(self.next, 1 << 20)
        if records:
            self.next = records[-1].seq + 1
            self.ours.extend(self._view(self.pub.events_for(self.reader, records)))
        n = len(self.theirs)
        if self.ours[:n] != self.theirs or (final and len(self.ours) != n):
            i = next(
                (i for i, (a, b) in enumerate(zip(self.ours, self.theirs)) if a != b),
                min(len(self.ours), n),
            )
            ours = self.ours[i] if i < len(self.ours) else None
            theirs = self.theirs[i] if i < n else None
            bad.append(f"{where}: KV event {i}: ours {ours} != vLLM's {theirs}")
            self.on = False  # one report: the lists diverged

    def wire(self, bad: list[str]) -> None:
        """What vLLM's own ZMQ publisher sent (its replay from 0, the whole run: fewer
        batches than its buffer), decoded with vLLM's own classes: exactly the events
        take_events handed it (``self.theirs``), in order."""
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        from kvsidecar.streams.kv_events_wire import END_SEQ

        endpoint = self.sched.kv_event_publisher.get_publisher_config().replay_endpoint
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        ctx = zmq.Context.instance()
        sent: list = []
        for _ in range(100):  # its thread may still be sending the last batches
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(endpoint)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            sent = []
            try:
                while dealer.poll(10_000):
                    _, _topic, seq, payload = dealer.recv_multipart()
                    if seq == END_SEQ:
                        break
                    sent.extend(self._view(decoder.decode(payload).events))
            finally:
                dealer.close()
            if len(sent) >= len(self.theirs):
                break
            time.sleep(0.1)
        self.wire_events = len(sent)
        if sent != self.theirs:
            i = next((i for i, (a, b) in enumerate(zip(sent, self.theirs)) if a != b), None)
            bad.append(
                f"vLLM's publisher sent {len(sent)} events, take_events {len(self.theirs)};"
                f" first difference at {i}"
            )

    def _view(self, events) -> list:
        out = [self.builtins(e) for e in events]
        if not self.by_block:
            return out
        return [
            (e["type"], h, e.get("group_idx"))
            for e in out
            for h in (e.get("block_hashes") or [None] * (e["type"] == "AllBlocksCleared"))
        ]

    def counts(self) -> dict:
        out: dict = {
            "kv_events_compared": len(self.theirs),
            "kv_events_by_block": self.by_block,
            "kv_events_on_vllms_wire": getattr(self, "wire_events", None),
        }
        groups: set = set()
        for e in self.ours:  # the sidecar's events: the KV-cache groups its BlockStored name
            kind = e[0] if self.by_block else e["type"]
            if kind == "BlockStored":
                groups.add(e[2] if self.by_block else e["group_idx"])
        for e in self.theirs:
            kind = e[0] if self.by_block else e["type"]
            out[kind] = out.get(kind, 0) + 1
        out["stored_group_idx"] = sorted(groups, key=str)
        return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("shm_dir")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--only", help="run only the configs with this name")
    ap.add_argument("--sabotage", nargs="*", default=[], help=f"hooks to break: {SABOTAGE}")
    ap.add_argument("--sabotage-steps", type=int, default=200)
    ap.add_argument("--kv-events", action="store_true", help="also check the KV events")
    args = ap.parse_args()
    if args.kv_events:
        os.environ["KVSIDECAR_KV_EVENTS"] = "1"
    os.environ["KVSIDECAR_SHM_DIR"] = args.shm_dir
    # The CPU platform (a GPU wheel cannot infer a device here); scheduling mode is set per run.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    model_dir = write_model(tempfile.mkdtemp(prefix="kvsidecar-sched-model-"))
    runs = [(c, args.steps, None) for c in CONFIGS if args.only in (None, c.name)]
    runs += [(CONFIGS[0], args.sabotage_steps, h) for h in args.sabotage]
    for cfg, steps, hook in runs:
        print("RESULT " + json.dumps(Run(cfg, steps, model_dir, hook).run()), flush=True)
    print(json.dumps({"runs": len(runs)}), flush=True)  # the last line, for run_json_helper
    return 0


if __name__ == "__main__":
    sys.exit(main())
