"""One demo engine rank: TinyLM + KVBlockPool + a small continuous-batching scheduler.

Admission is conservative so decode never runs out of blocks (no preemption): a request is
admitted only if the pool's available blocks (free + evictable cached), minus the growth
already promised to running requests, cover its whole final length. Prefix-cached blocks
count as available, so admissions evict them (LRU) under pressure.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from kvsidecar.agent.agent import KVSidecarAgent
from kvsidecar.agent.demo.model import Seq, TinyLM
from kvsidecar.agent.demo.options import Options
from kvsidecar.agent.demo.procutil import Recorder, StopFlag, Ticker, log
from kvsidecar.agent.demo.workload import Request, Workload
from kvsidecar.agent.pool import KVBlockPool, default_device


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class Engine:
    """Pool, model and running set of one rank. Not thread-safe (one engine thread)."""

    def __init__(self, opts: Options) -> None:
        torch.set_num_threads(max(1, opts.threads))
        self.opts = opts
        self.device = torch.device(opts.device) if opts.device else default_device()
        dtype = getattr(torch, opts.dtype)
        mc = opts.model
        self.model = TinyLM(mc, self.device, dtype)
        self.pool = KVBlockPool(
            opts.num_blocks,
            opts.block_size,
            num_layers=mc.n_layers,
            kv_heads=mc.n_heads,
            head_dim=mc.head_dim,
            dtype=dtype,
            device=self.device,
        )
        wl = opts.workload
        longest = wl.prefix_len[1] + wl.suffix_len[1] + wl.max_new[1]
        if blocks_for(longest, opts.block_size) > opts.num_blocks:
            raise ValueError(
                f"--num-blocks {opts.num_blocks} cannot hold a {longest}-token request"
            )
        if longest > mc.max_pos:
            raise ValueError(f"requests up to {longest} tokens exceed max_pos {mc.max_pos}")
        self.running: list[Request] = []
        self.steps = 0
        self.finished = 0

    def blocks(self, tokens: int) -> int:
        return blocks_for(tokens, self.pool.block_size)

    def committed(self) -> int:
        """Blocks that running requests will still allocate before they finish."""
        pool = self.pool
        return sum(
            self.blocks(r.final_tokens) - self.blocks(pool.num_tokens(r.req_id))
            for r in self.running
        )

    def has_room(self, req: Request, decode: bool = True, promised: int = 0) -> bool:
        """Room for the prompt (prefill only) or the whole request (it will decode here).

        ``promised``: growth of requests admitted but not yet in the running set.
        """
        need = self.blocks(req.final_tokens if decode else len(req.prompt))
        return self.pool.stats.available_blocks - self.committed() - promised >= need

    def prefill(self, queue: deque[Request], decode: bool = True) -> list[Request]:
        """Admit queued requests (FIFO) while there is room; compute their prompt K/V into
        the pool and their first token. Returns the admitted requests."""
        pool, bs = self.pool, self.pool.block_size
        admitted: list[Request] = []
        seqs: list[Seq] = []
        budget = self.opts.prefill_tokens
        promised = 0
        while queue and len(self.running) + len(admitted) < self.opts.max_batch:
            req = queue[0]
            if admitted and len(req.prompt) > budget:
                break
            if not self.has_room(req, decode, promised):
                break
            hits = pool.allocate_prompt(req.req_id, req.prompt)
            if hits is None:
                break
            queue.popleft()
            n = len(req.prompt)
            req.cached_tokens = hits * bs
            # A fully cached prompt still runs its last token, for the logits only.
            start = min(req.cached_tokens, n - 1)
            seqs.append(
                Seq(pool.block_table(req.req_id), req.prompt[start:], start, req.cached_tokens)
            )
            admitted.append(req)
            budget -= n - start
            if decode:
                promised += self.blocks(req.final_tokens) - self.blocks(n)
        if seqs:
            first = self.model.forward_paged(pool, seqs).argmax(-1).tolist()
            now = time.monotonic()
            for req, tok in zip(admitted, first):
                req.output = [tok]
                req.first_token_at = now
        return admitted

    def decode_step(self) -> list[Request]:
        """One token for every running request; returns (and frees) the finished ones."""
        if not self.running:
            return []
        pool = self.pool
        seqs = []
        for r in self.running:
            n = pool.num_tokens(r.req_id)
            # Cannot fail: admission kept room for every running request's final length.
            if not pool.append_slots(r.req_id, 1, [r.output[-1]]):
                raise RuntimeError(f"no block for {r.req_id}: admission accounting is wrong")
            seqs.append(Seq(pool.block_table(r.req_id), [r.output[-1]], n, n))
        nxt = self.model.forward_paged(pool, seqs).argmax(-1).tolist()
        done, still = [], []
        for r, tok in zip(self.running, nxt):
            r.output.append(tok)
            (done if len(r.output) >= r.max_new else still).append(r)
        self.running = still
        for r in done:
            pool.finish(r.req_id)
        self.finished += len(done)
        return done

    def start_decoding(self, reqs: list[Request]) -> list[Request]:
        """Move prefilled requests to the running set; returns those already complete."""
        done = [r for r in reqs if len(r.output) >= r.max_new]
        for r in done:
            self.pool.finish(r.req_id)
        self.finished += len(done)
        self.running.extend(r for r in reqs if len(r.output) < r.max_new)
        return done

    def pad_left(self, t0: float) -> float:
        """Seconds to wait so a busy step started at `t0` lasts ``step_ms``."""
        return max(0.0, self.opts.step_ms / 1000 - (time.monotonic() - t0))

    def status(self) -> str:
        s = self.pool.stats
        return (
            f"running={len(self.running)} alloc={s.allocated_blocks}/{s.total_blocks} "
            f"cached={s.cached_blocks} deferred={s.deferred_free_requests}req/"
            f"{s.deferred_free_blocks}blk evictions={s.evictions_total} "
            f"prefix_hits={s.prefix_hits_total}/{s.prefix_queries_total} done={self.finished}"
        )


def make_agent(engine: Engine, role: str) -> KVSidecarAgent:
    opts = engine.opts
    agent = KVSidecarAgent(
        opts.engine_name,
        opts.model.name,
        role=role,
        engine_version="demo",
        device=str(engine.device),
        shm_dir=opts.shm_dir,
        # KV events from the prefill rank (or the one engine), whose prefix cache a router
        # indexes (one publisher per DP rank: both engines here are rank 0). kv-events.md
        kv_events=role in ("prefill", "both"),
    )
    agent.register_pool(engine.pool)
    log(role, f"pid {agent.runtime.pid} device {engine.device} segment {agent.segment_path}")
    return agent


def record_done(rec: Recorder, reqs: list[Request]) -> None:
    for r in reqs:
        rec.write(req=r.req_id, prompt_len=len(r.prompt), cached=r.cached_tokens, tokens=r.output)


def run_single(opts: Options, stop: StopFlag) -> int:
    """A prefill+decode engine ("both") serving the workload until `stop` is set."""
    engine = Engine(opts)
    agent = make_agent(engine, "both")
    rec = Recorder(opts.out, "both")
    workload = Workload(opts.workload)
    waiting: deque[Request] = deque()
    ticker = Ticker(opts.report_interval)
    last_beat = time.monotonic()
    try:
        while not stop.is_set():
            now = time.monotonic()
            waiting.extend(workload.poll(now))
            done = engine.decode_step()
            done += engine.start_decoding(engine.prefill(waiting))
            record_done(rec, done)
            if engine.running or done:
                engine.steps += 1
                agent.step(len(engine.running), len(waiting))
                stop.wait(engine.pad_left(now))
            else:
                if waiting:  # queued but nothing can run: publish the queue anyway
                    agent.step(0, len(waiting))
                elif now - last_beat > 0.5:
                    agent.heartbeat()
                    last_beat = now
                if opts.exit_when_done and workload.exhausted and not waiting:
                    break
                stop.wait(min(0.02, max(0.0, workload.next_arrival() - now)))
            if tick := ticker.due(engine.steps):
                log(
                    "both",
                    f"t={tick[0]:.0f}s steps/s={tick[1]:.0f} waiting={len(waiting)} "
                    + engine.status(),
                )
    finally:
        log("both", f"stopping: {engine.status()}")
        agent.close()
        rec.close()
    return 0
