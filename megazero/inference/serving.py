"""Serving Megatron-LM's text-generation REST API: request validation, dynamic batching, and the
batch every TP rank runs (``tools/run_text_generation_server.py`` holds the HTTP side).

Requests are validated in the order and with the messages of Megatron-LM core 0.20.0's
``megatron/core/inference/text_generation_server/text_generation_server.py``
(``MegatronGenerate.put``); every failure is a :class:`RequestError` (HTTP 400).

Batching: a :class:`Batcher` holds at most ``max_queue`` requests. The first request waits at
most ``wait_s`` for company; requests with the same decoding key (:func:`decode_key`: all greedy
requests share one; sampling requests without ``random_seed`` share one per (temperature, top_k,
top_p); a sampling request with a ``random_seed`` runs alone, so its draws do not depend on other
traffic) are run as one ``generate()`` batch of at most ``max_rows`` prompts, generating the
longest ``tokens_to_generate`` of the batch; each request's rows are cut to its own length.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megazero.tensor_parallel.mappings import group_size

from .generation import generate


class RequestError(ValueError):
    """A request Megatron's server answers with 400 and this message."""


@dataclass
class Request:
    prompts: list[str]
    tokens_to_generate: int = 64
    logprobs: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    add_BOS: bool = False
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False
    random_seed: int = -1
    ids: list[list[int]] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.top_k == 1  # Megatron: top_k 1 is argmax; top_k 0 and top_p 0 sample the full softmax


def _typed(body: dict, key: str, default, ok, message: str):
    if key not in body:
        return default
    value = body[key]
    if isinstance(value, bool) != (default.__class__ is bool) or not ok(value):
        raise RequestError(message)
    return value


_LEGACY = (("max_len", "max_len is no longer used.  Replace with tokens_to_generate"),
           ("sentences", "sentences is no longer used.  Replace with prompts"),
           ("beam_width", "Beam search is no longer supported."))


def _prompts(body) -> list[str]:
    if not isinstance(body, dict) or "prompts" not in body:
        raise RequestError("prompts argument required")
    for key, message in _LEGACY:
        if key in body:
            raise RequestError(message)
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompts is not a list of strings")
    if len(prompts) == 0:
        raise RequestError("prompts is empty")
    if len(prompts) > 128:
        raise RequestError("Maximum number of prompts is 128")
    return prompts


def parse_request(body, tokenize, eod: int, max_positions: int) -> Request:
    """A :class:`Request` from a decoded JSON ``body``, its prompts tokenized (``add_BOS``
    prepends ``eod``, as Megatron does); raises :class:`RequestError` with Megatron's message."""
    r = Request(_prompts(body))
    r.tokens_to_generate = _typed(body, "tokens_to_generate", 64, lambda v: isinstance(v, int),
                                  "tokens_to_generate must be an integer greater than 0")
    if r.tokens_to_generate < 0:
        raise RequestError("tokens_to_generate must be an integer greater than or equal to 0")
    r.logprobs = _typed(body, "logprobs", False, lambda v: isinstance(v, bool), "logprobs must be a boolean value")
    if r.tokens_to_generate == 0 and not r.logprobs:
        raise RequestError("tokens_to_generate=0 implies logprobs should be True")
    r.temperature = float(_typed(body, "temperature", 1.0,
                                 lambda v: isinstance(v, (int, float)) and 0.0 < v <= 100.0,
                                 "temperature must be a positive number less than or equal to 100.0"))
    r.top_k = _typed(body, "top_k", 0, lambda v: isinstance(v, int),
                     "top_k must be an integer equal to or greater than 0 and less than or equal to 1000")
    if not 0 <= r.top_k <= 1000:
        raise RequestError("top_k must be equal to or greater than 0 and less than or equal to 1000")
    r.top_p = _typed(body, "top_p", 0.0, lambda v: isinstance(v, float),
                     "top_p must be a positive float less than or equal to 1.0")
    if r.top_p > 0.0 and r.top_k > 0:
        raise RequestError("cannot set both top-k and top-p samplings.")
    if not 0 <= r.top_p <= 1.0:
        raise RequestError("top_p must be less than or equal to 1.0")
    r.add_BOS = _typed(body, "add_BOS", False, lambda v: isinstance(v, bool), "add_BOS must be a boolean value")
    if any(len(p) == 0 for p in r.prompts) and not r.add_BOS:
        raise RequestError("Empty prompts require add_BOS=true")
    for key in ("stop_on_double_eol", "stop_on_eol"):
        setattr(r, key, _typed(body, key, False, lambda v: isinstance(v, bool), f"{key} must be a boolean value"))
    r.random_seed = _typed(body, "random_seed", -1, lambda v: isinstance(v, int), "random_seed must be integer")
    if "random_seed" in body and r.random_seed < 0:
        raise RequestError("random_seed must be a positive integer")
    try:
        r.ids = [([eod] if r.add_BOS else []) + tokenize(p) for p in r.prompts]
    except ValueError as e:
        raise RequestError(f"cannot tokenize the prompts: {e}") from None
    if any(not row for row in r.ids):
        raise RequestError("Empty prompts require add_BOS=true")
    longest = max(len(row) for row in r.ids) + r.tokens_to_generate
    if longest > max_positions:  # Megatron's MaxSequenceLengthOverflowError (text_generation_controller.py)
        raise RequestError(f"Maximum allowed sequence length was set to {max_positions} tokens but requested "
                           f"generation of {longest} tokens")
    return r


def decode_key(r: Request, serial: int) -> tuple:
    """Requests with equal keys may share a batch (see the module docstring)."""
    if r.greedy:
        return ("greedy",)
    if r.random_seed >= 0:
        return ("seeded", serial)
    return ("sample", r.temperature, r.top_k, r.top_p)


@dataclass
class Job:
    request: Request
    serial: int
    arrived: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    response: dict | None = None
    error: str | None = None

    @property
    def key(self) -> tuple:
        return decode_key(self.request, self.serial)


class Batcher:
    """A bounded queue of :class:`Job` s handing out batches of equal decoding keys."""

    def __init__(self, max_queue: int = 64, max_rows: int = 16, wait_s: float = 0.01):
        self.max_queue, self.max_rows, self.wait_s = max_queue, max_rows, wait_s
        self._jobs: list[Job] = []
        self._cv = threading.Condition()
        self._serial = 0

    def __len__(self) -> int:
        with self._cv:
            return len(self._jobs)

    def submit(self, request: Request) -> Job | None:
        """Queue ``request``; None when the queue is full (HTTP 503)."""
        with self._cv:
            self._jobs = [j for j in self._jobs if not j.cancelled]
            if len(self._jobs) >= self.max_queue:
                return None
            self._serial += 1
            job = Job(request, self._serial)
            self._jobs.append(job)
            self._cv.notify_all()
            return job

    def _same(self, first: Job) -> list[Job]:
        batch, rows = [], 0
        for job in self._jobs:
            n = len(job.request.ids)
            if job.key == first.key and (not batch or rows + n <= self.max_rows):
                batch.append(job)
                rows += n
        return batch

    def next_batch(self, idle_s: float) -> list[Job]:
        """The next batch (empty after ``idle_s`` without a request): the oldest job and those of
        its key, gathered until ``max_rows`` prompts or ``wait_s`` after the oldest arrived."""
        with self._cv:
            self._jobs = [j for j in self._jobs if not j.cancelled]
            if not self._jobs:
                self._cv.wait(idle_s)
                self._jobs = [j for j in self._jobs if not j.cancelled]
                if not self._jobs:
                    return []
            first = self._jobs[0]
            while (sum(len(j.request.ids) for j in self._same(first)) < self.max_rows
                   and (left := first.arrived + self.wait_s - time.monotonic()) > 0):
                self._cv.wait(left)
            batch = [j for j in self._same(first) if not j.cancelled] or [first]
            self._jobs = [j for j in self._jobs if j not in batch]
            return batch


    def close(self, message: str) -> None:
        """Fail every job still queued with ``message`` (at shutdown, so no handler waits forever)."""
        with self._cv:
            jobs, self._jobs = self._jobs, []
        for job in jobs:
            job.error = message
            job.done.set()


def batch_work(jobs: list[Job]) -> dict:
    """What every rank needs to run ``jobs`` as one batch (a picklable dict, broadcast from rank 0)."""
    r = jobs[0].request
    prompts = [row for job in jobs for row in job.request.ids]
    want_lp = [job.request.logprobs for job in jobs for _ in job.request.ids]
    seed = r.random_seed if r.random_seed >= 0 else jobs[0].serial
    return dict(op="generate", prompts=prompts, logprobs=want_lp, seed=seed, greedy=r.greedy,
                max_new=max(job.request.tokens_to_generate for job in jobs), temperature=r.temperature,
                top_k=r.top_k, top_p=r.top_p if r.top_p > 0 else 1.0)


def run_work(model, work: dict, eod, group=None, stop_rows=None) -> tuple[list[list[int]], list[list[float] | None]]:
    """Collective on every rank: (generated ids per prompt, their log-probabilities or None).
    ``stop_rows`` (rank 0): the rows whose client has gone, ended at the next step (``generate``)."""
    rows = generate(model, work["prompts"], work["max_new"], eod=eod, greedy=work["greedy"],
                    temperature=work["temperature"], top_k=work["top_k"], top_p=work["top_p"],
                    seed=work["seed"], group=group, stop_rows=stop_rows).tokens \
        if work["max_new"] > 0 else [[] for _ in work["prompts"]]
    lps = [token_logprobs(model, p + row) if want else None
           for p, row, want in zip(work["prompts"], rows, work["logprobs"])]
    return rows, lps


@torch.inference_mode()
def token_logprobs(model, seq: list[int]) -> list[float]:
    """log p(seq[i+1] | seq[:i+1]) for every position: Megatron's ``logprobs`` (prompt and
    generated tokens, ``len(seq) - 1`` values). Collective over the model's TP group."""
    logits = model(torch.tensor([seq], device=model.device))[0].float().contiguous()  # [s, V'/p]
    p = group_size(model.tp_group)
    if p > 1:
        pieces = [torch.empty_like(logits) for _ in range(p)]
        dist.all_gather(pieces, logits, group=model.tp_group)
        logits = torch.cat(pieces, dim=-1)
    logp = torch.log_softmax(logits[:, :model.config.vocab_size], dim=-1)
    nxt = torch.tensor(seq[1:], dtype=torch.long, device=logp.device)
    return logp[:-1].gather(1, nxt.view(-1, 1)).squeeze(1).tolist()


def cut_row(row: list[int], r: Request, piece) -> list[int]:
    """A generated row cut to ``r.tokens_to_generate`` and, with ``stop_on_eol`` /
    ``stop_on_double_eol``, after the token that ends a line / completes a blank line
    (``piece(ids)`` detokenizes); the tokens after it were generated but are dropped."""
    row = row[:r.tokens_to_generate]
    if r.stop_on_eol or r.stop_on_double_eol:
        for i in range(len(row)):
            text = piece(row[:i + 1])
            if (r.stop_on_eol and "\n" in piece(row[i:i + 1])) or (r.stop_on_double_eol and "\n\n" in text):
                return row[:i + 1]
    return row
