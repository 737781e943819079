"""A model as the generic packages see it: this rank's pipeline chunks and the plain objects
that pipeline/, zero/, checkpoint/ and training/ need, so none of them knows which model it is.

:class:`ModelStages` is what a ``model_provider(model_config, topo)`` returns; :func:`gpt_stages`
builds it for the GPT (Megatron's interleaved layer assignment, tied word embeddings synced over
the embedding group). A model that is not a GPT builds its own (tests/test_non_gpt_model.py).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from megazero.parallel.layout import chunk_layer_ranges, chunk_placement, chunk_roles, pipeline_tensor_shape
from megazero.tensor_parallel.layers import param_initializer
from megazero.tensor_parallel.spec import tp_duplicated_params
from megazero.tensor_parallel.weight_grad_store import weight_grad_stores

from megazero.context_parallel.chunks import slice_for_rank
from .gpt import WORD_EMBEDDING
from .mtp import MTP_EMBEDDING


@dataclass(frozen=True)
class ModelStages:
    """This rank's share of a model split over pipeline stages.

    * ``chunks``: the VP model chunks of this pipeline rank, in virtual-stage order; chunk ``c``
      of pipeline rank ``r`` is virtual stage ``c * PP + r``.
    * ``activation_shape`` / ``activation_dtype``: the tensor one stage sends the next (and the
      gradient sent back), the same for every micro-batch, e.g. ``(s, b, h)`` (``s / TP`` with
      sequence parallelism).
    * ``shared_params``: ``[(param, process_group)]``, copies of one weight held on several stages
      (tied embeddings): their gradients are summed over the group before the DP reduction, so
      the copies take the same step; ``[]`` when nothing is shared. A weight that several chunks
      of one rank use (the V's tied embedding) is listed once, over a one-rank group: ZeRO then
      reduces it once the step's gradients are all in.
    * ``tp_duplicated_params``: parameters replicated over TP, counted once in the gradient norm.
    * ``rng_states``: objects with ``state_dict()``/``load_state_dict()`` (one per chunk, e.g. the
      dropout RNG trackers) that a checkpoint saves and an exact resume restores.
    * ``aliases``: ``{copy name: canonical name}`` of the shared parameters, so a checkpoint reader
      can read a copy from its canonical parameter (and writers may skip it).
    * ``param_init``: None when the chunks hold real parameters; for chunks built on the meta
      device (a ZeRO-3 run, :func:`provider_options`), ``param_init(param)`` is the parameter's
      initial value (fp32, CPU, its TP-local shape), which ZeRO materializes region by region
      (stage 3: unit by unit, straight into this rank's shard).

    The model's glue with the training loop (none of it needed by a model that has no use for it):

    * ``forward_step(chunk, micro_batch, input_tensor)``: the model's own forward step (the
      output for the next stage; on the last a scalar loss); None: the caller gives one.
    * ``input_keys(per_document)``: the micro-batch entries this rank's chunks read when run by
      ``forward_step``, given the entries the data makes per document (``attention_mask`` with
      ``--reset-attention-mask``, ``position_ids`` with ``--reset-position-ids``); None: every entry.
    * ``decoupled_lr_params``: the parameters on ``--decoupled-lr`` (Megatron's embedding and
      output layer).
    * ``fuse_vocab_grads(add_weight_grad, add_embedding_grad)``: makes the vocabulary matrices
      accumulate their weight gradients through the optimizer's two callbacks (straight into its
      fp32 flat gradient); None: nothing to fuse.
    * ``weight_grad_stores``: one :class:`~megazero.tensor_parallel.weight_grad_store.WeightGradStore`
      per chunk, attached to its layers: a zero-bubble schedule's ``W`` computes the weight
      gradients there (``PipelineRunner.run(..., weight_grad_stores=...)``); None: every ``B``
      computes them all.

    Mixture of Experts (empty/None for a dense model):

    * ``expert_params``: this EP rank's routed-expert parameters; ZeRO reduces and shards them
      over the expert-data-parallel group instead of DP.
    * ``moe``: the :class:`~megazero.moe.layer.MoEState` the chunks' routers share: the training
      loop sets its aux-loss scale each step (``set_aux_scale(grad_scale / M)``), takes its
      metrics (``take()``) and runs ``update_expert_bias`` after the backward.
    """

    chunks: list[nn.Module]
    activation_shape: tuple[int, ...]
    activation_dtype: torch.dtype
    shared_params: list[tuple[nn.Parameter, Any]] = field(default_factory=list)
    tp_duplicated_params: list[nn.Parameter] = field(default_factory=list)
    rng_states: list = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    param_init: Callable[[nn.Parameter], torch.Tensor] | None = None
    forward_step: "ForwardStep | None" = None
    input_keys: Callable[[frozenset], frozenset] | None = None
    decoupled_lr_params: list[nn.Parameter] = field(default_factory=list)
    fuse_vocab_grads: Callable[[Callable, Callable], None] | None = None
    weight_grad_stores: list | None = None
    expert_params: list[nn.Parameter] = field(default_factory=list)
    moe: Any = None


ForwardStep = Callable[[nn.Module, dict, "torch.Tensor | None"], torch.Tensor]


def provider_options(provider) -> dict:
    """``{"device": "meta"}`` for a ``model_provider`` that takes a ``device`` keyword (it then
    builds on the meta device and returns ``param_init``); ``{}`` otherwise, so a provider
    without the keyword builds as before. Optional provider arguments are detected by
    signature, as Megatron does for its ``vp_stage``. Every ZeRO stage builds on the meta device:
    the optimizer's regions materialize the parameters one at a time, bit-equal to an eager
    build (``tests/zero/test_meta_build.py``), so no rank holds a second copy of its model while
    building; the layers compute their TP-local shapes by arithmetic (``TPSplit.local_shape``)."""
    if "device" in inspect.signature(provider).parameters:
        return {"device": "meta"}
    return {}


def build_model_chunks(config, topo, meta_init: bool = False) -> list[nn.Module]:
    """This rank's VP ``GPTModel`` slices, in virtual-stage order: chunk ``c`` holds the global
    layers of virtual stage ``c * PP + pp_rank`` (:func:`~megazero.pipeline.chunk_layer_ranges`),
    or with the V of ``topo.pipeline_schedule`` zbv/dualpipev stage ``pp_rank`` (chunk 0) and
    ``2 PP - 1 - pp_rank`` (chunk 1); the embedding on virtual stage 0, the final norm, output
    layer and loss on the last (both on pipeline rank 0 with the V, where a tied output layer
    multiplies by chunk 0's word embedding itself: :func:`shared_embedding_params`)."""
    from .gpt import GPTModel
    where = chunk_placement(getattr(topo, "pipeline_schedule", None))  # zbv/dualpipev: the V
    ranges = chunk_layer_ranges(config.num_layers, topo.pp, topo.vp, topo.pp_rank, where)
    roles = chunk_roles(topo.pp, topo.vp, topo.pp_rank, where)
    chunks, state, embedding = [], None, None
    for (start, end), (pre, post) in zip(ranges, roles):  # one MoEState shared by the chunks
        chunks.append(GPTModel(config, topo, layer_start=start, layer_end=end, pre_process=pre, post_process=post,
                               meta_init=meta_init, moe_state=state, tied_embedding=embedding))
        state = chunks[-1].moe_state
        if pre and config.tied_embeddings:  # this rank's word embedding, for its last chunk's output layer
            embedding = chunks[-1].embedding.word_embeddings
    return chunks


def shared_embedding_params(chunks, topo) -> list:
    """The GPT's tied-embedding rule: ``[(weight, topo.embedding_group)]`` for this rank's copy of
    the tied word embedding, or ``[]``.

    Only with PP > 1 on the first stage (the embedding) or the last (its copy, the output layer's
    weight, initialized equal) of a model with tied embeddings; the gradient sum over the
    embedding group (first + last stage of each pipeline) keeps the copies equal.

    The V (``zbv``, ``dualpipev``): the first and the last stage are chunks 0 and 1 of pipeline
    rank 0, and there the tie is *one parameter*: chunk 1's output layer multiplies by chunk 0's
    word-embedding weight itself (:func:`build_model_chunks`), so ``dL/dW = dL/dW|_embedding +
    dL/dW|_output`` is summed by accumulation into the one gradient, the one master takes one
    step, and the norm sees the weight once -- no copy, no second optimizer state of the largest
    matrix, nothing to sync. It is still listed here, over ``topo.embedding_group`` (with the V:
    pipeline rank 0 alone, a one-rank group whose sum is skipped), because a weight that two
    chunks use gets two gradient deliveries per micro-batch (two backward calls, or two ``W``
    actions of the split backward: one store per chunk, each delivering through the weight's
    ``AccumulateGrad``), and a tie region is what ZeRO reduces only once the whole step's
    gradient is in (``finish_grad_sync``): an ordinary region would reduce after the first
    delivery (stage 2), and at stage 3 it stays whole instead of in chunk 0's gathered unit,
    which chunk 1 does not gather. The rejected alternative, a second copy in chunk 1 summed
    locally, would double that matrix's weights, master and Adam moments on rank 0, the rank the V
    already loads with both vocabulary ends.
    """
    if topo.pp == 1 or not (topo.is_first_stage or topo.is_last_stage):
        return []
    owners = list(dict.fromkeys(([chunks[0]] if topo.is_first_stage else []) +
                                ([chunks[-1]] if topo.is_last_stage else [])))
    weights = [chunk.shared_embedding_weight() for chunk in owners]
    if chunk_placement(getattr(topo, "pipeline_schedule", None)) == "v" and chunks[0].config.mtp_num_layers:
        raise ValueError("multi-token prediction with the V placement (zbv, dualpipev): the last stage's MTP "
                         "embedding would be a second copy on pipeline rank 0; use another --pipeline-schedule")
    return [(w, topo.embedding_group) for w in weights if w is not None]


def gpt_stages(config, topo, micro_batch_size: int, device=None) -> ModelStages:
    """The GPT as :class:`ModelStages`: Megatron's interleaved layer assignment
    (:func:`build_model_chunks`), activations ``[s, b, h]`` (``[s / TP, b, h]`` with sequence
    parallelism) in ``config.params_dtype``, the tied embedding's copies shared over the embedding
    group (:func:`shared_embedding_params`; alias ``output_layer.weight`` ->
    ``embedding.word_embeddings.weight``), each chunk's dropout RNG tracker to checkpoint.
    ``device="meta"``: parameters on the meta device, values from ``param_init``."""
    meta = device is not None and torch.device(device).type == "meta"
    chunks = build_model_chunks(config, topo, meta_init=meta)
    shape = pipeline_tensor_shape(config.seq_length // topo.cp, micro_batch_size, config.hidden_size, topo.tp,
                                  config.sequence_parallel)  # a CP rank's chunks of the sequence
    aliases = {"output_layer.weight": WORD_EMBEDDING} if config.tied_embeddings else {}
    if config.mtp_num_layers:  # the last stage's copy of the embedding for multi-token prediction
        aliases[MTP_EMBEDDING] = WORD_EMBEDDING
    return ModelStages(chunks=chunks, activation_shape=shape, activation_dtype=config.params_dtype,
                       shared_params=shared_embedding_params(chunks, topo),
                       tp_duplicated_params=tp_duplicated_params(chunks, topo.tp),
                       rng_states=[chunk.rng for chunk in chunks], aliases=aliases,
                       param_init=param_initializer(chunks) if meta else None,
                       forward_step=gpt_forward_step,
                       input_keys=GPTInputKeys(topo.is_first_stage, topo.is_last_stage, not config.learned_positions,
                                               bool(config.mtp_num_layers)),
                       decoupled_lr_params=embedding_and_output_params(chunks),
                       fuse_vocab_grads=VocabGradFusion(chunks), weight_grad_stores=weight_grad_stores(chunks),
                       expert_params=expert_parallel_params(chunks), moe=chunks[0].moe_state)


def expert_parallel_params(chunks) -> list:
    """The routed experts' parameters of the chunks (modules marked ``expert_parallel``)."""
    return [p for chunk in chunks for m in chunk.modules() if getattr(m, "expert_parallel", False)
            for p in m.parameters(recurse=False)]


@dataclass(frozen=True)
class GPTInputKeys:
    """The micro-batch entries a GPT pipeline rank reads (``gpt_forward_step``):

    * the first stage (virtual stage 0, the embedding): ``tokens``, ``position_ids``;
    * the last stage (the loss): ``labels``, ``loss_mask``;
    * every stage, middle ones included, the per-document entries every layer uses: the
      ``attention_mask`` when it is made per document, and per-document ``position_ids`` when
      the layers apply RoPE (otherwise positions are ``arange(s)``, which a chunk builds itself
      when none is given).

    A rank with both the first and the last virtual stage (PP = 1, or any VP on one rank) gets
    the union. Megatron-LM core_v0.19.0 ``pretrain_gpt.py: get_batch`` returns nothing on a rank
    that is neither first nor last (``is_first_or_last_pipeline_stage``) unless the layers need
    per-document metadata (``has_cu_seqlens``), and ``megatron/core/utils.py:
    get_batch_on_this_tp_rank`` gives the first stage ``tokens``, ``position_ids``, the last
    ``labels``, ``loss_mask`` (both the attention mask when it is made in the data loader)."""

    first_stage: bool
    last_stage: bool
    rope: bool
    mtp: bool = False  # multi-token prediction: the last stage embeds the tokens too


    def __call__(self, per_document: frozenset) -> frozenset:
        keys = {"attention_mask"} & per_document
        if self.rope:
            keys |= {"position_ids"} & per_document
        if self.first_stage:
            keys |= {"tokens", "position_ids"}
        if self.last_stage:
            keys |= {"labels", "loss_mask"} | ({"tokens"} if self.mtp else set())
        return frozenset(keys)


@dataclass(frozen=True)
class VocabGradFusion:
    """Gradient accumulation fusion of the GPT's vocabulary matrices (Megatron's
    ``--gradient-accumulation-fusion``, on by default there): each chunk's output layer adds its
    weight gradient ``G^T X``, and the word embedding its rows ``dW[ids] += G``, in fp32 straight
    into the optimizer's flat gradient (:mod:`megazero.tensor_parallel.wgrad_fusion`), so the
    vocabulary matrix (V x h, the largest weight, tied or not) never has a gradient of its size
    outside that buffer (docs/benchmarks.md, "Memory")."""

    chunks: list

    def __call__(self, add_weight_grad: Callable, add_embedding_grad: Callable) -> None:
        for chunk in self.chunks:
            if chunk.post_process:
                chunk.output_layer.accumulate_weight_grad_into(add_weight_grad)
            if chunk.pre_process:
                chunk.embedding.word_embeddings.accumulate_weight_grad_into(add_embedding_grad)


def embedding_and_output_params(chunks) -> list:
    """Megatron's ``is_embedding_or_output_parameter`` (``--decoupled-lr``): the word embedding of
    a chunk with the first stage, the output layer's own weight on the last (untied, or the
    tied copy of a multi-stage model), the last stage's MTP copy of the embedding; not the
    position embeddings."""
    out = []
    for chunk in chunks:
        if chunk.pre_process:
            out.append(chunk.embedding.word_embeddings.weight)
        if chunk.post_process and chunk.output_layer.weight is not None:
            out.append(chunk.output_layer.weight)
        if getattr(chunk, "mtp", None) is not None and chunk.mtp.embedding is not None:
            out.append(chunk.mtp.embedding.word_embeddings.weight)  # MTP's copy steps as the embedding does
    return out


def gpt_forward_step(chunk, micro_batch: dict, input_tensor):
    """The GPT's forward step (``forward_step`` of :class:`~megazero.pipeline.PipelineRunner`):
    hidden states for the next stage, or on the last stage the micro-batch's mean loss over its
    unmasked tokens ``sum(loss * loss_mask) / sum(loss_mask)`` (plain mean without a mask).
    An ``attention_mask`` in the micro-batch (``--reset-attention-mask``) reaches every layer.

    Context parallelism (``chunk.topo.cp > 1``): the rank keeps its load-balanced chunks of
    whole-sequence entries (:func:`~megazero.context_parallel.chunks.slice_for_rank`; the training
    data source delivers them sliced already) and its loss is
    ``CP * sum_local(loss * mask) / sum_all(mask)`` (the mask count summed over the CP group, no
    gradient): the mean over the CP ranks -- which the DP x CP gradient average and the logged
    DP x CP mean take -- is the one-process token mean (Megatron's ``loss_func`` with CP)."""
    topo = getattr(chunk, "topo", None)
    cp = topo.cp if topo is not None else 1
    if cp > 1:  # whole sequences (a caller's own batches): keep this rank's chunks; the training data
        full = chunk.config.seq_length  # source hands over the chunks already ([b, s / CP])
        micro_batch = {k: (slice_for_rank(v, 1, cp, topo.cp_rank) if v.dim() == 2 and v.shape[1] == full else v)
                       for k, v in micro_batch.items()}
    x = micro_batch["tokens"] if input_tensor is None else input_tensor
    extra = {"attention_mask": micro_batch["attention_mask"]} if "attention_mask" in micro_batch else {}
    if not getattr(chunk, "post_process", False):
        return chunk(x, position_ids=micro_batch.get("position_ids"), **extra)
    if getattr(chunk, "mtp", None) is not None:  # multi-token prediction reads the tokens and the mask
        extra.update(tokens=micro_batch["tokens"], loss_mask=micro_batch.get("loss_mask"))
    losses = chunk(x, position_ids=micro_batch.get("position_ids"), labels=micro_batch["labels"], **extra)
    mask = micro_batch.get("loss_mask")
    if cp == 1:
        if mask is None:
            return losses.float().mean()
        mask = mask.to(losses.dtype)
        return (losses * mask).sum() / mask.sum()
    mask = torch.ones_like(losses) if mask is None else mask.to(losses.dtype)
    count = mask.sum().detach().reshape(1).float()
    dist.all_reduce(count, group=topo.group("cp"))
    return (losses * mask).sum() * cp / count[0]
