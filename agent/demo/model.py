"""A tiny decoder-only transformer whose attention reads and writes K/V through a KVBlockPool.

Paged attention in plain torch: each forward writes the new tokens' K/V into the request's
blocks (``pool.slot_indices`` of its block table), then gathers the request's whole context
back from the pool by block table and attends causally. Nothing else keeps K/V, so whatever
sits in the pool's blocks (computed here, revived from the prefix cache, or pulled from a
prefill process) is exactly what the next token sees.

Weights are random from a fixed seed: no download, same model in every process. The default
dtype is float64 so greedy decoding does not depend on how requests happen to be batched or
which prefix blocks happened to be cached (float32 rounding differences could flip a near-tie
argmax and make the P/D vs single-process comparison flaky).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvsidecar.agent.demo.options import ModelConfig
from kvsidecar.agent.pool import KVBlockPool


@dataclass
class Seq:
    """One request's slice of a forward: new ``tokens`` at positions [start, start+len).

    ``write_from`` (>= start): positions below it already hold their K/V in the pool (a fully
    cached prompt whose last token is recomputed only for its logits), so they are not
    rewritten: that block may be shared with other requests.
    """

    table: list[int]
    tokens: list[int]
    start: int
    write_from: int


def causal_mask(start: int, end: int, device: torch.device) -> torch.Tensor:
    """``[end - start, end]`` bool: query at position p (start <= p < end) sees keys <= p."""
    keys = torch.arange(end, device=device)
    return keys[None, :] <= torch.arange(start, end, device=device)[:, None]


class TinyLM(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError("d_model must be a multiple of n_heads")
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)

        def w(*shape: int, fan_in: int) -> nn.Parameter:
            # 1/sqrt(fan_in) (not GPT's 0.02): a random model whose outputs depend on the
            # context, so corrupted K/V shows up as different tokens.
            t = torch.randn(*shape, generator=g) / math.sqrt(fan_in)
            return nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)

        d = cfg.d_model
        self.tok_emb = w(cfg.vocab, d, fan_in=1)
        self.pos_emb = w(cfg.max_pos, d, fan_in=4)
        self.layers = nn.ModuleList()
        for _ in range(cfg.n_layers):
            layer = nn.Module()
            layer.w_qkv = w(d, 3 * d, fan_in=d)
            layer.w_o = w(d, d, fan_in=d)
            layer.w_up = w(d, cfg.d_mlp, fan_in=d)
            layer.w_down = w(cfg.d_mlp, d, fan_in=cfg.d_mlp)
            self.layers.append(layer)
        # Untied head: with logits = x @ tok_emb.T a random model just repeats its input token.
        self.w_head = w(d, cfg.vocab, fan_in=d)
        self.eval()

    @torch.no_grad()
    def forward_paged(self, pool: KVBlockPool, seqs: list[Seq]) -> torch.Tensor:
        """Logits ``[len(seqs), vocab]`` at each sequence's last new token."""
        cfg = self.cfg
        dev = self.tok_emb.device
        h, hd = cfg.n_heads, cfg.head_dim
        lengths = [len(s.tokens) for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s.tokens], device=dev)
        pos = torch.cat(
            [torch.arange(s.start, s.start + n, device=dev) for s, n in zip(seqs, lengths)]
        )
        x = self.tok_emb[ids] + self.pos_emb[pos]

        # Slots once per forward (they are the same in every layer): the context to gather,
        # and the subset of new positions to write.
        ctx_slots, write_slots, write_rows, masks = [], [], [], []
        row = 0
        for s, n in zip(seqs, lengths):
            end = s.start + n
            slots = pool.slot_indices(s.table, 0, end)
            ctx_slots.append(slots)
            first = max(s.write_from, s.start)
            write_slots.append(slots[first:end])
            write_rows.append(torch.arange(row + first - s.start, row + n, device=dev))
            # Causal: the query at position p sees keys 0..p. None for one query (decode).
            masks.append(None if n == 1 else causal_mask(s.start, end, dev))
            row += n
        w_slots = torch.cat(write_slots)
        w_rows = torch.cat(write_rows)

        for li, layer in enumerate(self.layers):
            a = F.layer_norm(x, (cfg.d_model,))
            q, k, v = (a @ layer.w_qkv).view(-1, 3, h, hd).unbind(1)
            store = pool.kv_cache(li)
            flat = store.view(store.shape[0], -1, h, hd)
            flat[0].index_copy_(0, w_slots, k[w_rows].to(flat.dtype))
            flat[1].index_copy_(0, w_slots, v[w_rows].to(flat.dtype))
            outs = []
            row = 0
            for n, slots, mask in zip(lengths, ctx_slots, masks):
                kc = flat[0].index_select(0, slots).to(x.dtype).transpose(0, 1)  # [h, L, hd]
                vc = flat[1].index_select(0, slots).to(x.dtype).transpose(0, 1)
                qi = q[row : row + n].transpose(0, 1)  # [h, n, hd]
                o = F.scaled_dot_product_attention(qi, kc, vc, attn_mask=mask)
                outs.append(o.transpose(0, 1).reshape(n, cfg.d_model))
                row += n
            x = x + torch.cat(outs) @ layer.w_o
            x = x + F.gelu(F.layer_norm(x, (cfg.d_model,)) @ layer.w_up) @ layer.w_down

        last = torch.tensor(lengths, device=dev).cumsum(0) - 1
        return F.layer_norm(x[last], (cfg.d_model,)) @ self.w_head


def dense_generate(model: TinyLM, prompt: list[int], max_new: int) -> list[int]:
    """Greedy generation without any cache: the whole sequence through plain causal
    attention for every token. The ground truth that paged attention must reproduce."""
    cfg = model.cfg
    h, hd = cfg.n_heads, cfg.head_dim
    seq = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_new:
            ids = torch.tensor(seq, device=model.tok_emb.device)
            x = model.tok_emb[ids] + model.pos_emb[: len(seq)]
            for layer in model.layers:
                a = F.layer_norm(x, (cfg.d_model,))
                q, k, v = (a @ layer.w_qkv).view(-1, 3, h, hd).permute(1, 2, 0, 3).unbind(0)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + o.transpose(0, 1).reshape(len(seq), cfg.d_model) @ layer.w_o
                x = x + F.gelu(F.layer_norm(x, (cfg.d_model,)) @ layer.w_up) @ layer.w_down
            tok = int((F.layer_norm(x[-1], (cfg.d_model,)) @ model.w_head).argmax())
            out.append(tok)
            seq.append(tok)
    return out
