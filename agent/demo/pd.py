"""The prefill and decode engine processes of a P/D pair; K/V pulled over a pipe.

Protocol on one duplex `multiprocessing` pipe (pickled headers, raw K/V bytes):

* prefill -> decode ``("ready", meta)``: the prompt is prefilled; its blocks are *deferred*
  in the prefill pool (``finish(req, connectors=("pd",))``) until decode pulls them.
* decode -> prefill ``("pull", req_id, start)``: decode has allocated the request in its own
  pool (reusing its own prefix cache: only positions >= start are needed) and waits.
* prefill -> decode ``("kv", req_id, shape, dtype)`` then the bytes of K/V
  ``[layers, 2, tokens, kv_heads, head_dim]`` read from the prefill pool's blocks; prefill then
  calls ``release(req_id, "pd")`` and the blocks return to its free list / prefix cache.

Decode writes the bytes into its own blocks and decodes from there, starting with the first
token prefill sampled: the prompt is never recomputed on the decode side. ``transfer_delay``
makes decode wait that long after "ready" before pulling, so the deferred window shows.
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from collections import deque
from multiprocessing.connection import Connection

import torch

from kvsidecar.agent.demo.engine import Engine, make_agent, record_done
from kvsidecar.agent.demo.options import Options
from kvsidecar.agent.demo.procutil import Recorder, StopFlag, Ticker, log
from kvsidecar.agent.demo.workload import Request, Workload
from kvsidecar.agent.pool import KVBlockPool

CONNECTOR = "pd"
IDLE_WAIT = 0.02  # seconds an idle loop sleeps (in poll(), so a message wakes it at once)


class PeerGone(Exception):
    """The other process closed the pipe."""


def gather_kv(pool: KVBlockPool, req_id: str, start: int) -> torch.Tensor:
    """K/V of positions [start, num_tokens) from the request's blocks, contiguous on cpu."""
    table = pool.block_table(req_id)
    n = pool.num_tokens(req_id) - start
    layers = []
    for layer in range(pool.num_layers):
        k, v = pool.read_kv(layer, table, n, start)
        layers.append(torch.stack((k, v)))
    return torch.stack(layers).cpu().contiguous()


def raw_bytes(t: torch.Tensor) -> bytes:
    """A CPU tensor's bytes, without numpy: `make run` installs only the agent extra
    (torch's CPU wheel does not bring numpy, and `.numpy()` then raises)."""
    t = t.detach().cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def kv_digest(kv: torch.Tensor) -> str:
    return hashlib.sha256(raw_bytes(kv)).hexdigest()[:16]


# --------------------------------------------------------------------------- prefill


class PrefillServer:
    """Prefill side of the pipe: announces prefilled requests, serves pulls, releases."""

    def __init__(self, conn: Connection, pool: KVBlockPool, rec: Recorder) -> None:
        self.conn = conn
        self.pool = pool
        self.rec = rec
        self.pending: dict[str, Request] = {}  # deferred here until decode pulls
        self.moved = 0

    def announce(self, req: Request) -> None:
        self.pool.finish(req.req_id, connectors=(CONNECTOR,))  # deferred, not freed
        self.pending[req.req_id] = req
        meta = {
            "req_id": req.req_id,
            "prompt": req.prompt,
            "max_new": req.max_new,
            "first": req.output[0],
            "arrival": req.arrival,
        }
        self.conn.send(("ready", meta))

    def serve(self, timeout: float = 0.0) -> int:
        """Answer every pull waiting (the first wait up to `timeout`); returns how many."""
        served = 0
        while self.conn.poll(timeout):
            timeout = 0.0
            msg = self.conn.recv()
            if msg[0] != "pull":
                raise ValueError(f"unexpected message {msg[0]!r}")
            _, rid, start = msg
            kv = gather_kv(self.pool, rid, start)
            self.conn.send(("kv", rid, tuple(kv.shape), str(kv.dtype).removeprefix("torch.")))
            self.conn.send_bytes(raw_bytes(kv))  # the whole buffer
            self.moved += kv.numel() * kv.element_size()
            self.pool.release(rid, CONNECTOR)  # the K/V has left: the blocks may go
            del self.pending[rid]
            if self.rec.enabled:
                self.rec.write(req=rid, pulled_from=start, kv_sha=kv_digest(kv))
            served += 1
        return served


def prefill_main(opts: Options, conn: Connection, stop: StopFlag) -> None:
    engine = Engine(opts)
    agent = make_agent(engine, "prefill")
    rec = Recorder(opts.out, "prefill")
    server = PrefillServer(conn, engine.pool, rec)
    workload = Workload(opts.workload)
    waiting: deque[Request] = deque()
    ticker = Ticker(opts.report_interval)
    last_beat = time.monotonic()
    try:
        while not stop.is_set():
            now = time.monotonic()
            served = server.serve()
            waiting.extend(workload.poll(now))
            admitted = engine.prefill(waiting, decode=False)
            for r in admitted:
                server.announce(r)
            engine.finished += len(admitted)
            if admitted or served:
                engine.steps += 1
                agent.step(len(admitted), len(waiting))
                if server.serve(engine.pad_left(now)):  # pulls still answered at once
                    agent.step(0, len(waiting))
            else:
                if waiting:  # blocked on blocks that only a pull frees: show the queue
                    agent.step(0, len(waiting))
                elif now - last_beat > 0.5:
                    agent.heartbeat()
                    last_beat = now
                if (
                    opts.exit_when_done
                    and workload.exhausted
                    and not waiting
                    and not server.pending
                ):
                    break
                wait = min(IDLE_WAIT, max(0.0, workload.next_arrival() - now))
                if server.serve(wait):
                    agent.step(0, len(waiting))
            if tick := ticker.due(engine.steps):
                log(
                    "prefill",
                    f"t={tick[0]:.0f}s steps/s={tick[1]:.0f} waiting={len(waiting)} "
                    f"{engine.status()} kv_sent={server.moved / 2**20:.1f}MiB",
                )
    except (EOFError, OSError):
        if not stop.is_set():
            log("prefill", "decode process is gone; stopping")
    finally:
        log("prefill", f"stopping: {engine.status()} kv_sent={server.moved / 2**20:.1f}MiB")
        agent.close()
        rec.close()
        conn.close()


# --------------------------------------------------------------------------- decode


class PullClient:
    """Decode side of the pipe: queues "ready" notices, pulls K/V synchronously."""

    def __init__(self, conn: Connection, delay: float) -> None:
        self.conn = conn
        self.delay = delay
        self.notices: deque[tuple[float, Request]] = deque()  # (due time, request)
        self.peer_open = True
        self.moved = 0

    def drain(self, timeout: float = 0.0) -> None:
        """Queue every notice waiting (the first wait up to `timeout`)."""
        while self.peer_open:
            try:
                if not self.conn.poll(timeout):
                    return
                timeout = 0.0
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.peer_open = False
                return
            self._notice(msg)

    def _notice(self, msg: tuple) -> None:
        if msg[0] != "ready":
            raise ValueError(f"unexpected message {msg[0]!r}")
        m = msg[1]
        req = Request(m["req_id"], m["prompt"], m["max_new"], m["arrival"], output=[m["first"]])
        self.notices.append((time.monotonic() + self.delay, req))

    def pull(self, req_id: str, start: int) -> torch.Tensor:
        """Positions >= start of req_id as ``[layers, 2, tokens, kv_heads, head_dim]``."""
        try:
            self.conn.send(("pull", req_id, start))
            while True:
                msg = self.conn.recv()
                if msg[0] == "kv":
                    break
                self._notice(msg)  # announced before our pull reached prefill
            _, rid, shape, dtype = msg
            data = self.conn.recv_bytes()
        except (EOFError, OSError) as e:
            self.peer_open = False
            raise PeerGone from e
        if rid != req_id:
            raise ValueError(f"pulled {rid!r}, expected {req_id!r}")
        self.moved += len(data)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return raw.view(getattr(torch, dtype)).view(shape)


def admit_pulled(engine: Engine, client: PullClient, req: Request, rec: Recorder) -> None:
    """Allocate req in the decode pool, pull the K/V it lacks, write it into its blocks."""
    pool = engine.pool
    hits = pool.allocate_prompt(req.req_id, req.prompt)
    if hits is None:  # has_room() said yes: cannot happen
        raise RuntimeError(f"no room for {req.req_id}")
    start = min(hits * pool.block_size, len(req.prompt))
    req.cached_tokens = start
    try:
        kv = client.pull(req.req_id, start)
    except PeerGone:
        pool.abort(req.req_id)
        raise
    if engine.opts.corrupt_transfer:
        kv.zero_()
    table = pool.block_table(req.req_id)
    for layer in range(pool.num_layers):
        pool.write_kv(layer, table, kv[layer, 0], kv[layer, 1], start)
    if rec.enabled:  # what now sits in our blocks, to compare with what prefill sent
        landed = gather_kv(pool, req.req_id, start)
        rec.write(req=req.req_id, pulled_from=start, kv_sha=kv_digest(landed))
    req.first_token_at = time.monotonic()


def decode_main(opts: Options, conn: Connection, stop: StopFlag) -> None:
    engine = Engine(opts)
    agent = make_agent(engine, "decode")
    rec = Recorder(opts.out, "decode")
    client = PullClient(conn, opts.transfer_delay)
    notices = client.notices
    ticker = Ticker(opts.report_interval)
    last_beat = time.monotonic()
    try:
        while not stop.is_set():
            client.drain()
            now = time.monotonic()
            if notices and not client.peer_open:
                log("decode", f"prefill is gone: dropping {len(notices)} unpulled requests")
                notices.clear()
            done: list[Request] = []
            pulled = 0
            while (
                notices
                and notices[0][0] <= now
                and len(engine.running) < opts.max_batch
                and engine.has_room(notices[0][1])
            ):
                req = notices.popleft()[1]
                admit_pulled(engine, client, req, rec)
                done += engine.start_decoding([req])  # running now, so has_room counts it
                pulled += 1
            done += engine.decode_step()
            record_done(rec, done)
            if engine.running or done or pulled:
                engine.steps += 1
                agent.step(len(engine.running), len(notices))
                client.drain(engine.pad_left(now))
            else:
                if now - last_beat > 0.5:
                    agent.heartbeat()
                    last_beat = now
                if not client.peer_open:
                    if opts.exit_when_done:
                        break
                    stop.wait(IDLE_WAIT)
                else:  # sleep in poll() until a notice arrives or the next one is due
                    due = notices[0][0] - now if notices else IDLE_WAIT
                    client.drain(max(0.0, min(IDLE_WAIT, due)))
            if tick := ticker.due(engine.steps):
                log(
                    "decode",
                    f"t={tick[0]:.0f}s steps/s={tick[1]:.0f} pending={len(notices)} "
                    f"{engine.status()} kv_pulled={client.moved / 2**20:.1f}MiB",
                )
    except PeerGone:
        if not stop.is_set():
            log("decode", "prefill process is gone; stopping")
    finally:
        log("decode", f"stopping: {engine.status()} kv_pulled={client.moved / 2**20:.1f}MiB")
        agent.close()
        rec.close()
        conn.close()
