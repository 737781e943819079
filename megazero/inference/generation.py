"""Autoregressive generation with a tensor-parallel :class:`GPTModel` and a KV cache.

Per step every TP rank computes its vocabulary shard of the last position's logits
``[b, V'/p]``; an all-gather over the TP group gives the full ``[b, V']`` (identical bytes on every
rank), of which the ``V`` real columns are kept. The next token then follows from the same
computation everywhere:

* greedy: ``argmax_v z_v``;
* sampling: ``z / T`` (temperature ``T``); top-k keeps the ``k`` largest logits (the rest
  ``-inf``); top-p keeps the smallest set of most probable tokens whose probability sums to at
  least ``p`` (the most probable token always); then one draw from ``softmax`` over what is
  kept, from a ``torch.Generator`` seeded with ``seed`` (same seed, same logits -> same draw).

With TP > 1 the chosen tokens are also broadcast from TP rank 0 (or from the first rank of
``group``: an MoE model's expert-parallel ranks run collectives together, so every rank holding
the model's pieces must agree), so ranks can never diverge even if a sampler were not
bit-deterministic. Rows stop independently at ``eod`` (later positions
hold ``eod`` and are not counted); the loop ends when every row has stopped or after
``max_new_tokens`` steps. The decision depends only on the (shared) tokens, so all TP ranks run
the same number of steps and collectives, whatever the rows do: no rank can deadlock.

Prompts of different lengths are left-padded; the cache (:class:`InferenceCache`; a
multi-latent-attention model's :class:`~megazero.inference.latent_cache.LatentCache` holds the
compressed latent instead of K/V) gives each row positions
counted from its first real token and hides the padding from attention, so a row's tokens equal
those it gets alone (up to floating-point rounding of the batched kernels).
``use_cache=False`` recomputes the whole sequence every step (the reference, and a benchmark).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megazero.tensor_parallel.mappings import group_size

from .latent_cache import new_cache


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # per row: the generated ids (up to and including eod)
    steps: int  # model calls after the prefill
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stopped_at_eod: list[bool] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total > 0 else float("inf")


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``logits [b, V]`` (fp32) scaled by ``1/T`` with everything outside top-k / top-p set to ``-inf``.
    ``T`` must be finite and > 0 (``T = inf`` would make every logit 0: uniform noise)."""
    if not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be finite and > 0 (use greedy decoding for T -> 0), got {temperature}")
    z = logits / temperature
    if top_k and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop_sorted = before >= top_p  # the first token has 0 before it: always kept
        z = z.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    return z


def sample(logits: torch.Tensor, greedy: bool, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row, ``[b]`` int64, from full-vocabulary ``logits [b, V]``."""
    logits = logits.float()
    if greedy:
        return logits.argmax(-1)
    probs = torch.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def last_logits(model, logits: torch.Tensor) -> torch.Tensor:
    """This rank's ``[b, s, V'/p]`` logits -> full real-vocabulary fp32 logits of the last position ``[b, V]``."""
    local = logits[:, -1, :].float().contiguous()
    group = model.tp_group
    p = group_size(group)
    if p > 1:
        pieces = [torch.empty_like(local) for _ in range(p)]
        dist.all_gather(pieces, local, group=group)
        local = torch.cat(pieces, dim=-1)
    return local[:, :model.config.vocab_size]


def _agree(tokens: torch.Tensor, group) -> torch.Tensor:
    """Broadcast ``tokens`` from rank 0 of ``group`` (no-op for one rank)."""
    if group_size(group) > 1:
        dist.broadcast(tokens, dist.get_global_rank(group, 0), group=group)
    return tokens


def left_pad(prompts: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [b, L], valid [b, L])`` with each prompt right-aligned (L = longest prompt)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    length = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), length), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros(len(prompts), length, dtype=torch.bool, device=device)
    for row, p in enumerate(prompts):
        tokens[row, length - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[row, length - len(p):] = True
    return tokens, valid


@torch.inference_mode()
def _step_logits(model, step_input: torch.Tensor, step_valid: torch.Tensor, cache) -> torch.Tensor:
    """One decoding step's logits: with a KV cache only the new tokens run; without one
    (``cache`` None) the whole sequence is recomputed, a fresh cache supplying only the
    positions and the attention mask."""
    if cache is None:
        cache = new_cache(model.config, step_input.shape[0], step_input.shape[1], step_input.device,
                          window=model.config.window_left)
        cache.prepare(step_valid)
        return model(step_input, inference_cache=cache)
    cache.prepare(step_valid)
    logits = model(step_input, inference_cache=cache)
    cache.advance()
    return logits


def _fitting_new_tokens(config, prompts: list[list[int]], max_new_tokens: int) -> int:
    """``max_new_tokens`` cut so the longest prompt plus its continuation fits
    ``max_position_embeddings``; a prompt already longer is refused."""
    longest = max(len(p) for p in prompts)
    room = config.max_position_embeddings - longest
    if room < 0:
        raise ValueError(f"a prompt of {longest} tokens exceeds max_position_embeddings "
                         f"{config.max_position_embeddings}")
    return max(0, min(max_new_tokens, room))


def generate(model, prompts: list[list[int]], max_new_tokens: int, eod: int | None = None, greedy: bool = True,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             use_cache: bool = True, group=None, stop_rows=None) -> GenerationResult:
    """Continue each prompt (token ids) by up to ``max_new_tokens``; see the module docstring.

    Collective over the model's TP group (or ``group``, which must contain it: all ranks of an
    expert-parallel MoE model): every rank calls it with the same arguments. ``stop_rows`` (on the
    group's first rank only, with ``eod``): a callable giving each row's "stop now" flag every step
    (a server's departed clients); those rows take ``eod``, which the step's token broadcast
    carries to every rank, so all ranks finish together once every row is done.
    ``max_new_tokens`` is cut so the longest row fits ``max_position_embeddings`` (learned
    positions; RoPE too, as the model was trained no further).
    """
    was_training = model.training
    model.eval()
    device = model.device
    b = len(prompts)
    tokens, valid = left_pad(prompts, eod if eod is not None else 0, device)
    max_new_tokens = _fitting_new_tokens(model.config, prompts, max_new_tokens)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = torch.full((b, max_new_tokens), eod if eod is not None else 0, dtype=torch.long)
    done = torch.zeros(b, dtype=torch.bool)
    lengths = torch.zeros(b, dtype=torch.long)
    window = model.config.window_left  # --window-size: the cache keeps only the window (cache.py)
    cache = new_cache(model.config, b, tokens.shape[1] + max_new_tokens, device, window=window) if use_cache else None
    step_input, step_valid = tokens, valid
    t0 = time.perf_counter()
    prefill_s, steps = 0.0, 0
    for step in range(max_new_tokens):
        logits = _step_logits(model, step_input, step_valid, cache)
        nxt = sample(last_logits(model, logits), greedy, temperature, top_k, top_p, gen).cpu()
        if stop_rows is not None and eod is not None:
            nxt = torch.where(torch.tensor(stop_rows(), dtype=torch.bool), torch.full_like(nxt, eod), nxt)
        nxt = _agree(nxt.to(device), group if group is not None else model.tp_group).cpu()
        nxt = torch.where(done, out[:, step], nxt)  # stopped rows keep their filler
        out[:, step] = nxt
        lengths += (~done).long()
        if eod is not None:
            done |= nxt == eod
        if step == 0:
            prefill_s = time.perf_counter() - t0
        steps = step
        if bool(done.all()):
            break
        new = nxt.view(b, 1).to(device)
        new_valid = torch.ones(b, 1, dtype=torch.bool, device=device)
        if use_cache:
            step_input, step_valid = new, new_valid
        else:
            step_input, step_valid = torch.cat([step_input, new], 1), torch.cat([step_valid, new_valid], 1)
    total = time.perf_counter() - t0
    if was_training:
        model.train()
    rows = [out[r, :int(lengths[r])].tolist() for r in range(b)]
    stopped = [eod is not None and len(r) > 0 and r[-1] == eod for r in rows]
    return GenerationResult(rows, steps, prefill_s, total - prefill_s, stopped)
