"""``kvsidecar events``: watch one DP rank's KV-event stream (vLLM's wire, from
``serve --kv-events.endpoint`` or from vLLM itself) in a terminal.

One line per batch: its sequence, the DP rank, the events it carries by kind and the
blocks a consumer applying the stream holds; ``--verbose`` adds one line per event. With
``--replay-endpoint`` it joins as a router should: a replay from 0 first (the sidecar
answers a start older than its buffer with the full state), then live, asking for a
replay on a gap. Needs pyzmq (``kvsidecar[kvevents]``).
"""

from __future__ import annotations

import time

import click

from kvsidecar.exit_codes import EXIT_USAGE


@click.command()
@click.option(
    "--endpoint",
    default="tcp://127.0.0.1:5557",
    show_default=True,
    help="The PUB to subscribe to (serve's --kv-events.endpoint, with a host).",
)
@click.option("--dp-rank", type=click.IntRange(0), default=0, show_default=True,
              help="Watch this DP rank: the endpoint's port + rank (vLLM's rule).")  # fmt: skip
@click.option("--replay-endpoint", default=None,
              help="Join with a replay from 0 (the full state) and fill gaps from it.")  # fmt: skip
@click.option("--topic", default="", help="Subscribe to this topic prefix (default: all).")
@click.option("--count", type=click.IntRange(0), default=0, help="Stop after N batches (0: never).")
@click.option("--duration", type=click.FloatRange(0), default=0.0,
              help="Stop after this many seconds (0: never).")  # fmt: skip
@click.option("--verbose", "-v", is_flag=True, help="One line per event too.")
def events(
    endpoint: str,
    dp_rank: int,
    replay_endpoint: str | None,
    topic: str,
    count: int,
    duration: float,
    verbose: bool,
) -> None:
    """Watch a KV-event stream: sequence, event counts per batch, the events."""
    try:
        import msgspec
        import zmq

        from kvsidecar.streams.kv_events_wire import (
            END_SEQ,
            KVEventBatch,
            offset_endpoint_port,
        )
    except ImportError as e:
        why = f"kvsidecar events: needs pyzmq ({e}): pip install 'kvsidecar[kvevents]'"
        click.echo(why, err=True)
        raise SystemExit(EXIT_USAGE) from None
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(offset_endpoint_port(endpoint, dp_rank))
    sub.subscribe(topic.encode())
    dealer = None
    if replay_endpoint:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(offset_endpoint_port(replay_endpoint, dp_rank))
    held: set[int] = set()
    totals = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
    last: int | None = None
    shown = 0
    deadline = time.monotonic() + duration if duration else None

    def show(seq: int, payload: bytes, how: str) -> None:
        nonlocal shown
        batch = dec.decode(payload)
        kinds = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        for e in batch.events:
            kind = type(e).__name__
            kinds[kind] += 1
            totals[kind] += 1
            if kind == "BlockStored":
                held.update(e.block_hashes)
            elif kind == "BlockRemoved":
                held.difference_update(e.block_hashes)
            else:
                held.clear()
        click.echo(
            f"seq={seq} dp={batch.data_parallel_rank} {how} stored={kinds['BlockStored']} "
            f"removed={kinds['BlockRemoved']} cleared={kinds['AllBlocksCleared']} "
            f"held={len(held)}"
        )
        if verbose:
            for e in batch.events:
                click.echo(f"  {msgspec.json.encode(e).decode()}")
        shown += 1

    def replay(start: int) -> int | None:
        assert dealer is not None
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        top = None
        while dealer.poll(10_000):
            _, _topic, seq_b, payload = dealer.recv_multipart()
            if seq_b == END_SEQ:
                break
            seq = int.from_bytes(seq_b, "big")
            show(seq, payload, "replay")
            top = seq
        return top

    try:
        if dealer is not None:
            last = replay(0)
        while not (count and shown >= count):
            if deadline is not None and time.monotonic() >= deadline:
                break
            if not sub.poll(100):
                continue
            _topic, seq_b, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if last is not None and dealer is not None:
                if seq < last:  # the publisher restarted
                    held.clear()
                    last = replay(0)
                    continue
                if seq <= last:
                    continue
                if seq > last + 1:
                    click.echo(f"gap: {last + 1}..{seq - 1} missed; replaying")
                    last = replay(last + 1)
                    if last is not None and seq <= last:
                        continue
            show(seq, payload, "live")
            last = seq
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
        if dealer is not None:
            dealer.close()
        ctx.term()
    click.echo(
        f"total: batches={shown} stored={totals['BlockStored']} removed={totals['BlockRemoved']} "
        f"cleared={totals['AllBlocksCleared']} held={len(held)}"
    )
