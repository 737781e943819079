"""A tiny chunkable language model for schedule tests (no TP): embedding, residual tanh-Linear
layers, tied or untied output matrix, per-token cross-entropy.  Layout-independent init: every
parameter is drawn from a generator seeded by its global name."""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn


def _init(shape, seed, name, scale=0.3):
    g = torch.Generator().manual_seed(seed * 100003 + zlib.crc32(name.encode()))
    return nn.Parameter(torch.randn(shape, generator=g) * scale)


class ToyChunk(nn.Module):
    def __init__(self, vocab, hidden, layer_start, layer_end, pre_process, post_process, tied, seed=0):
        super().__init__()
        self.pre_process, self.post_process, self.tied = pre_process, post_process, tied
        if pre_process:
            self.embed = _init((vocab, hidden), seed, "embed")
        self.layer_ids = list(range(layer_start, layer_end))
        self.layers = nn.ParameterList([_init((hidden, hidden), seed, f"layers.{n}", 0.5 / hidden ** 0.5)
                                        for n in self.layer_ids])
        self.out = None
        if post_process and not (tied and pre_process):
            self.out = _init((vocab, hidden), seed, "embed" if tied else "out")

    def shared_embedding_weight(self):
        if not self.tied or (self.pre_process and self.post_process):
            return None
        return self.embed if self.pre_process else self.out

    def forward(self, x, labels=None):
        h = self.embed[x.t()] if self.pre_process else x  # [s, b, h]
        for w in self.layers:
            h = h + torch.tanh(h @ w.t())
        if not self.post_process:
            return h
        logits = h @ (self.out if self.out is not None else self.embed).t()
        s, b = h.shape[:2]
        return F.cross_entropy(logits.flatten(0, 1), labels.t().flatten(), reduction="none").view(s, b).t()

    def named_grads(self):
        """Global name -> grad; a tied copy is reported under ``embed``."""
        out = {}
        for name, p in self.named_parameters():
            if name.startswith("layers."):
                name = f"layers.{self.layer_ids[int(name.split('.')[1])]}"
            if name == "out" and self.tied:
                name = "embed"
            out[name] = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        return out


def toy_step(chunk, mb, x):
    if x is None:
        x = mb["tokens"]
    if not chunk.post_process:
        return chunk(x)
    loss = chunk(x, mb["labels"])
    return (loss * mb["loss_mask"]).sum() / mb["loss_mask"].sum()


def toy_batches(m, b, s, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
        mask = (torch.rand(b, s, generator=g) > 0.2).float()
        mask[:, 0] = 1.0
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask})
    return out


def toy_chunks(vocab, hidden, layers, pp, vp, pp_rank, tied, seed=0, placement="loop"):
    from megazero.pipeline import chunk_layer_ranges, chunk_roles
    ranges, roles = chunk_layer_ranges(layers, pp, vp, pp_rank, placement), chunk_roles(pp, vp, pp_rank, placement)
    return [ToyChunk(vocab, hidden, a, b, pre, post, tied, seed) for (a, b), (pre, post) in zip(ranges, roles)]


def toy_shared(chunks, topo) -> list:
    """The toy's tied-matrix rule: ``[(copy, topo.embedding_group)]`` on the first and last stage
    (PP > 1, tied), else ``[]`` -- the ``shared_params`` of ``allreduce_shared_grads``."""
    if topo.pp == 1 or not (topo.is_first_stage or topo.is_last_stage):
        return []
    owners = ([chunks[0]] if topo.is_first_stage else []) + ([chunks[-1]] if topo.is_last_stage else [])
    return [(w, topo.embedding_group) for w in (c.shared_embedding_weight() for c in owners) if w is not None]


def reference(vocab, hidden, layers, tied, batches, seed=0):
    """Single-process model: per-micro-batch losses and grads of the mean loss."""
    model = ToyChunk(vocab, hidden, 0, layers, True, True, tied, seed)
    losses = []
    for mb in batches:
        loss = toy_step(model, mb, None)
        (loss / len(batches)).backward()
        losses.append(loss.detach())
    return torch.stack(losses), model.named_grads()


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def launch(fn, world_size, *args, **kwargs):
    """run_distributed with a 20 s collective timeout (a stuck collective fails fast)."""
    from megazero.testing import run_distributed
    kwargs.setdefault("collective_timeout_s", 20)
    return run_distributed(fn, world_size, *args, **kwargs)

