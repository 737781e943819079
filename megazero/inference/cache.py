"""Incremental decoding: a per-layer key/value cache for :class:`GPTModel`.

Autoregressive generation calls the model once on the prompt (the *prefill*, ``s`` tokens) and
then once per new token (``s = 1``). Each attention layer's keys and values of earlier positions
do not change, so instead of recomputing them every step they are kept in
:class:`InferenceCache`: per layer a pair of preallocated ``[b, G/p, max_len, d]`` tensors (this
TP rank's ``G/p`` key/value groups, after RoPE) filled up to ``offset``. A step that feeds
``s`` tokens writes its ``k, v`` at ``offset .. offset+s-1`` and attends with its queries over
cache positions ``0 .. offset+s-1``; :meth:`InferenceCache.advance` then moves ``offset``.

Rows of different lengths are *left-padded*: ``valid[b, j]`` says whether cache slot ``j`` of row
``b`` holds a real token. A row's positions (RoPE angle or learned-position index) count only its
real tokens, ``pos[b, j] = (sum_{i <= j} valid[b, i]) - 1`` (clamped at 0 on padding), so a padded
row sees exactly the positions it would see alone. Query slot ``i`` may attend key slot ``j`` iff

    j <= i  and  (valid[b, j]  or  j == i)

(causal, padding keys hidden; a padding query sees itself only, so its softmax never has an
empty support and no NaN can reach the cache). Without padding the mask is SDPA's
``is_causal`` on the prefill (``offset == 0``) and nothing at all for later steps, where every
cached key precedes the query.

**Sliding window** (``window``: the model's ``--window-size`` left, a query at slot ``i`` sees key
slots ``i - window .. i``): no later query can see a slot more than ``window`` back, so the cache
keeps only the last ``window`` slots of each layer (at most ``W - 1`` for HF's ``sliding_window``
``W``): a step attends over those plus its own ``s`` new keys with the mask above intersected with
``i - j <= window``, then drops what falls out. Generation is exact: every key a query may see is
still there. Memory per layer: ``2 b (G/p) window d`` instead of ``2 b (G/p) max_len d``.

Usage (``megazero.inference.generation`` drives this)::

    cache = InferenceCache(batch, max_len)
    pos = cache.prepare(valid)            # valid [b, s] bool for the tokens about to be fed
    logits = model(tokens, pos, inference_cache=cache)
    cache.advance()
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class InferenceCache:
    """Keys and values of every layer so far, the padding mask, and each row's next position."""

    def __init__(self, batch_size: int, max_len: int, device=None, window: int | None = None):
        self.batch_size, self.max_len, self.window = batch_size, max_len, window
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.offset = 0  # cache slots filled before the current step
        self.base = 0  # the first slot still held (0 without a window)
        self.step_len = 0  # tokens in the step being run (set by prepare)
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)  # slots base .. offset(+s)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)  # real tokens per row
        self.padded = False  # any padding slot so far
        self.position_ids = None  # [b, s] of the step being run
        self.mask = None  # [b, 1, s, offset+s] bool for this step, or None (see module doc)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    # ---- per step ----------------------------------------------------------------------
    def prepare(self, valid: torch.Tensor | None = None, step_len: int | None = None) -> torch.Tensor:
        """Register the next ``s`` tokens (``valid [b, s]``; None = all real) and return their
        position ids ``[b, s]``; builds this step's attention mask."""
        s = valid.shape[1] if valid is not None else int(step_len)
        start, end = self.offset, self.offset + s
        if end > self.max_len:
            raise ValueError(f"inference cache holds {self.max_len} positions; step would reach {end}")
        if valid is None:
            valid = torch.ones(self.batch_size, s, dtype=torch.bool, device=self.device)
        valid = valid.to(device=self.device, dtype=torch.bool)
        self.valid = torch.cat([self.valid[:, :start - self.base], valid], 1)
        counts = self.lengths.unsqueeze(1) + valid.long().cumsum(1)  # real tokens up to and incl. each slot
        positions = (counts - 1).clamp(min=0)
        self.lengths = counts[:, -1].clone()
        self.padded = self.padded or not bool(valid.all())
        self.step_len, self.position_ids = s, positions
        if not self.padded and self.window is None:
            self.mask = None
        else:
            q_idx = torch.arange(start, end, device=self.device).unsqueeze(1)  # [s, 1]
            k_idx = torch.arange(self.base, end, device=self.device).unsqueeze(0)  # [1, end - base]
            allowed = (k_idx <= q_idx) if self.window is None else (k_idx <= q_idx) & (k_idx >= q_idx - self.window)
            keep = self.valid.unsqueeze(1) | (k_idx == q_idx).unsqueeze(0)  # [b, s, end - base]
            self.mask = (allowed.unsqueeze(0) & keep).unsqueeze(1)  # [b, 1, s, end - base]
        return positions

    def advance(self) -> None:
        """The step's keys and values are in every layer: move past them (with a window, forget
        the slots no later query can see)."""
        self.offset += self.step_len
        self.step_len = 0
        if self.window is not None:
            base = max(self.base, self.offset - self.window)
            self.valid, self.base = self.valid[:, base - self.base:], base

    # ---- called by each attention layer -----------------------------------------------------
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [b, G/p, s, d]`` at this step's slots; return keys/values of slots
        ``base .. offset+s-1`` (with a window, the layer then keeps the last ``window`` of them)."""
        if self.window is not None:
            held = [t for t in (self.keys.get(layer), self.values.get(layer)) if t is not None]
            k_all, v_all = (torch.cat([h, t], 2) for h, t in zip(held, (k, v))) if held else (k, v)
            first = max(0, k_all.shape[2] - self.window)
            self.keys[layer], self.values[layer] = k_all[:, :, first:].clone(), v_all[:, :, first:].clone()
            return k_all, v_all
        if layer not in self.keys:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.keys[layer] = torch.empty(shape, dtype=k.dtype, device=k.device)
            self.values[layer] = torch.empty(shape, dtype=v.dtype, device=v.device)
        end = self.offset + k.shape[2]
        self.keys[layer][:, :, self.offset:end] = k
        self.values[layer][:, :, self.offset:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``softmax(q k^T / sqrt(d) + mask) v`` for ``q [b, H/p, s, d]`` over cached ``k, v``."""
        gqa = q.shape[1] != k.shape[1]
        if self.mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=gqa)
        if self.offset == 0 and q.shape[2] > 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if q.shape[2] == 1:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        # several new tokens after a prefix (chunked prefill): causal with the diagonal shifted
        s, end = q.shape[2], k.shape[2]
        q_idx = torch.arange(end - s, end, device=q.device).unsqueeze(1)
        mask = torch.arange(end, device=q.device).unsqueeze(0) <= q_idx
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
