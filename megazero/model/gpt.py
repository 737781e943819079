"""The GPT model, or a pipeline slice of it, built from tensor-parallel layers.

``GPTModel(config, topo, layer_start=0, layer_end=None, pre_process=True, post_process=True)``
holds global layers ``layer_start..layer_end-1``; ``pre_process`` adds the embedding (word +
learned positions, or RoPE), ``post_process`` the final norm and the output layer. It knows
nothing of pipelines: a stage is just a slice, and a chunk with both ends is the whole model.

Parameter names use *global* layer numbers (``layers.5.mlp.fc1.weight`` on whichever stage
holds layer 5), and each parameter is drawn whole from a generator seeded by (seed, that name),
then sliced for TP, so every (TP, PP, VP, DP) layout starts from the same model. With
``meta_init=True`` nothing is drawn: parameters are meta tensors of their local shapes and
:func:`~megazero.tensor_parallel.layers.param_initializer` gives each one's value on demand
(ZeRO-3 materializes them unit by unit into its shards, bit-equal to the eager build).

Tied embeddings (``untie_embeddings_and_output_weights=False``): a slice holding both ends
(the only stage) multiplies by the word-embedding weight itself. A slice with ``post_process``
but not ``pre_process`` (the last of several stages) owns ``output_layer.weight``, drawn from
the word embedding's seed so it starts equal; :meth:`shared_embedding_weight` returns the weight
to keep in sync over ``topo.embedding_group`` (first stage: the embedding; last: its copy; a
single-stage model or a middle stage: None). Whether a slice is the only stage is thus derived
from ``pre_process and post_process``; no extra flag. The exception is a last slice given
``tied_embedding``, the word embedding of another slice on the *same rank* (the V placement of
``zbv``/``dualpipev``: virtual stages 0 and ``2 PP - 1`` are both chunks of pipeline rank 0): it
owns no output weight and multiplies by that very parameter, held unregistered (one parameter,
one master, one optimizer state; see ``megazero.model.stages.shared_embedding_params``).

Sequence parallelism: hidden states between stages are ``[s/p, b, h]``; the embedding
reduce-scatters into that layout and the output layer all-gathers out of it. Replicated
parameters used on split activations (norms, row-parallel biases) get TP-summed gradients
inside autograd, so optimizers need not know about SP.
"""

from __future__ import annotations

import torch
from torch import nn

from megazero.tensor_parallel import (ColumnParallelLinear, RNGTracker, VocabParallelEmbedding, checkpoint,
                                      default_device, dropout, scatter_to_sequence_parallel_region, seeded_normal,
                                      named_tp_params, to_full, to_local, tp_duplicated_params,
                                      vocab_parallel_cross_entropy)
from megazero.tensor_parallel.mappings import group_rank, group_size
from megazero.tensor_parallel.random import REPLICATED, TENSOR_PARALLEL

from .config import GPTConfig
from megazero.context_parallel.chunks import positions_for_rank
from .attention import rope_cos_sin
from .mtp import MTP_EMBEDDING, MultiTokenPrediction
from .yarn import mla_rope_cos_sin
from .transformer import Norm, TransformerLayer

WORD_EMBEDDING = "embedding.word_embeddings.weight"


class Embedding(nn.Module):
    """Token ids ``[b, s]`` -> ``[s, b, h]`` (``[s/p, b, h]`` with SP), then embedding dropout."""

    def __init__(self, config: GPTConfig, padded_vocab: int, tp_group, tracker, device):
        super().__init__()
        self.config, self.tp_group, self.tracker = config, tp_group, tracker
        self.sp = config.sequence_parallel and group_size(tp_group) > 1
        std, seed = config.init_method_std, config.seed
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab, config.hidden_size, tp_group, vocab_size=config.vocab_size, sequence_parallel=self.sp,
            init_method=seeded_normal(std, seed, WORD_EMBEDDING), params_dtype=config.params_dtype, device=device)
        if config.position_embedding_type == "learned_absolute":
            shape = (config.max_position_embeddings, config.hidden_size)

            def init() -> torch.Tensor:
                weight = torch.empty(shape)
                seeded_normal(std, seed, "embedding.position_embeddings.weight")(weight)
                return weight
            self.param_inits = {"position_embeddings.weight": init}  # the meta-device build's values
            weight = torch.empty(shape, device="meta") if torch.device(device).type == "meta" else init()
            self.position_embeddings = nn.Embedding.from_pretrained(
                weight.to(device=device, dtype=config.params_dtype), freeze=False)
        else:
            self.position_embeddings = None

    def forward(self, ids, position_ids):
        x = self.word_embeddings(ids.t())  # [s(/p), b, h]
        if self.position_embeddings is not None:
            pos = self.position_embeddings(position_ids.t())  # [s, b, h], replicated
            if self.sp:
                pos = scatter_to_sequence_parallel_region(pos, self.tp_group)
            x = x + pos
        rng = TENSOR_PARALLEL if self.sp else REPLICATED
        return dropout(x, self.config.hidden_dropout, self.training, self.tracker, rng)


class GPTModel(nn.Module):
    """See the module docstring and docs/INTERFACES.md (Model)."""

    def __init__(self, config: GPTConfig, topo=None, layer_start: int = 0, layer_end: int | None = None,
                 pre_process: bool = True, post_process: bool = True, device=None, meta_init: bool = False,
                 moe_state=None, tied_embedding: nn.Module | None = None):
        super().__init__()
        self.config, self.topo = config, topo
        self.tp_group = topo.tp_group if topo is not None else None
        self.tp = group_size(self.tp_group)
        config.check_tp(self.tp, topo.etp if topo is not None else 1)
        self.cp, self.cp_rank = (topo.cp, topo.cp_rank) if topo is not None else (1, 0)
        config.check_cp(self.cp, self.tp)
        self.layer_start = layer_start
        self.layer_end = config.num_layers if layer_end is None else layer_end
        if not 0 <= self.layer_start <= self.layer_end <= config.num_layers:
            raise ValueError(f"layer slice [{layer_start}, {self.layer_end}) outside 0..{config.num_layers}")
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = config.sequence_parallel and self.tp > 1
        self.padded_vocab = config.padded_vocab(self.tp)
        self.device = torch.device(device) if device is not None else default_device(self.tp_group)
        tp_rank = topo.tp_rank if topo is not None else 0
        self.rng = RNGTracker(config.seed, tp_rank, stream=self.layer_start, device=self.device)
        where = torch.device("meta") if meta_init else self.device  # meta: values from param_initializer
        if pre_process:
            self.embedding = Embedding(config, self.padded_vocab, self.tp_group, self.rng, where)
        if (config.moe is not None or config.mtp_num_layers) and moe_state is None:  # MTP records its losses there
            from megazero.moe.layer import MoEState
            moe_state = MoEState(config.num_layers + (config.mtp_num_layers or 0), self.device,
                                 config.moe.num_experts if config.moe else 0,
                                 config.moe is not None and config.moe.enable_expert_bias, self.cp)
        self.moe_state = moe_state  # shared by the MoE routers of this rank's chunks (None: dense)
        self.layers = nn.ModuleDict({
            str(n): TransformerLayer(config, n, self.tp_group, self.rng, where, topo, moe_state, self.device)
            for n in range(self.layer_start, self.layer_end)})
        if post_process:
            self.final_norm = Norm(config, self.tp_group, self.sequence_parallel, where)
            twin = tied_embedding if config.tied_embeddings and not pre_process else None
            # a tuple: the other chunk's embedding, not registered here (its parameter is that chunk's)
            self.tied_embedding = (twin,) if twin is not None else ()
            uses_embedding = config.tied_embeddings and (pre_process or twin is not None)
            key = WORD_EMBEDDING if config.tied_embeddings else "output_layer.weight"
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, self.padded_vocab, self.tp_group, bias=False,
                sequence_parallel=self.sequence_parallel, real_out_features=config.vocab_size,
                init_method=seeded_normal(config.init_method_std, config.seed, key),
                params_dtype=config.params_dtype, device=where, create_weight=not uses_embedding)
        self.mtp = None
        if post_process and config.mtp_num_layers:
            copy = None if pre_process else Embedding(config, self.padded_vocab, self.tp_group, self.rng, where)
            self.mtp = MultiTokenPrediction(config, self.tp_group, self.rng, where, topo, moe_state, self.device, copy)

    def set_aux_loss_scale(self, scale) -> None:
        """The gradient the MoE aux losses and the MTP loss get in backward: ``loss_scale / M`` for a
        backward of ``loss * loss_scale / M`` (M micro-batches averaged, as the training loop's
        schedule and ``engine.backward`` seed the LM loss), so that the aux terms keep their
        coefficient against the LM loss; a no-op for a dense model without MTP."""
        if self.moe_state is not None:
            self.moe_state.set_aux_scale(scale)

    # ---- forward -------------------------------------------------------------------------
    def shared_embedding_weight(self) -> nn.Parameter | None:
        """The tied word-embedding weight this slice must keep in sync with its twin, or None."""
        mtp_copy = self.config.mtp_num_layers and not self.config.tied_embeddings  # MTP's embedding on the last stage
        if not (self.config.tied_embeddings or mtp_copy) or (self.pre_process and self.post_process):
            return None
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.mtp.embedding.word_embeddings.weight if mtp_copy else self.output_layer.weight
        return None

    def tied_output_weight(self) -> nn.Parameter | None:
        """The weight the output layer multiplies by when it owns none (tied): this slice's word
        embedding, or the one of this rank's first chunk (``tied_embedding``, the V); None: its own."""
        if self.output_layer.weight is not None:
            return None
        owner = self.embedding.word_embeddings if self.pre_process else self.tied_embedding[0]
        return owner.weight

    def _layer_groups(self) -> list[tuple[list[nn.Module], bool]]:
        """Consecutive layers and whether each run is recomputed (full granularity)."""
        layers = list(self.layers.values())
        c = self.config
        if c.recompute_granularity != "full" or not self.training:
            return [(layers, False)]
        n = c.recompute_num_layers or 1
        if c.recompute_method == "block":
            return [([layer], True) for layer in layers[:n]] + ([(layers[n:], False)] if layers[n:] else [])
        return [(layers[i:i + n], True) for i in range(0, len(layers), n)]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, inference_cache=None,
                attention_mask: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """See docs/INTERFACES.md. ``inference_cache`` (a prepared
        :class:`~megazero.inference.cache.InferenceCache`): ``x`` holds only the new tokens, the
        layers attend over the cached keys/values too (position ids default to the cache's).
        ``attention_mask``: ``[b, 1, s, s]`` bool, True where attention is not allowed (causal
        part included; ``--reset-attention-mask``'s per-document mask); None: causal."""
        if self.pre_process:
            b, s = x.shape
        else:
            s, b = x.shape[0] * (self.tp if self.sequence_parallel else 1), x.shape[1]
        needs_positions = self.config.position_embedding_type == "rope" or self.pre_process
        if position_ids is None and inference_cache is not None:
            position_ids = inference_cache.position_ids
        if position_ids is None and needs_positions:  # under CP: this rank's chunks' true positions
            device = x.device
            positions = (positions_for_rank(s, self.cp, self.cp_rank, device) if self.cp > 1
                         else torch.arange(s, device=device))
            position_ids = positions.unsqueeze(0).expand(b, s)
        hidden = self.embedding(x, position_ids) if self.pre_process else x
        rope = None
        if self.config.multi_latent_attention:  # MLA's decoupled RoPE part (YaRN): model/yarn.py
            rope = mla_rope_cos_sin(position_ids, self.config, self.config.params_dtype)
        elif self.config.position_embedding_type == "rope":
            rope = rope_cos_sin(position_ids, self.config.kv_channels, self.config.rotary_base,
                                self.config.params_dtype)
        if inference_cache is not None:
            if self.sequence_parallel or (self.training and self.config.hidden_dropout > 0):
                raise ValueError("incremental decoding needs eval mode and no sequence parallelism")
            for layer in self.layers.values():
                hidden = layer(hidden, rope, inference_cache)
            layer_groups = []
        else:
            layer_groups = self._layer_groups()
        for layers, recompute in layer_groups:
            def run(h, *cos_sin, layers=layers):
                for layer in layers:
                    h = layer(h, cos_sin if cos_sin else None, attention_mask=attention_mask)
                return h
            args = (hidden,) + (tuple(rope) if rope is not None else ())
            hidden = checkpoint(run, self.rng, *args) if recompute else run(*args)
        if not self.post_process:
            return hidden
        hidden = self.final_norm(hidden)
        weight = self.tied_output_weight()
        logits = self.output_layer(hidden, weight)  # [s, b, V'/p]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = self._cross_entropy(logits, labels)
        if self.mtp is not None and inference_cache is None:
            tokens = x if tokens is None and self.pre_process else tokens
            embedding = self.embedding if self.pre_process else self.mtp.embedding
            loss = self.mtp.loss(loss, hidden, tokens, position_ids, rope, attention_mask, labels, loss_mask,
                                 embedding, lambda h: self.output_layer(h, weight), self._cross_entropy)
        return loss

    def _cross_entropy(self, logits, labels):
        """``[s, b, V'/p]`` logits, ``[b, s]`` labels -> ``[b, s]`` fp32 losses."""
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.tp_group, self.config.vocab_size,
                                            self.config.label_smoothing)
        return loss.t().contiguous()

    def root_backward_reads_end(self) -> nn.Module | None:
        """For ZeRO-3 (:class:`~megazero.zero.stage3.ParamGatherer`): the module after whose
        backward -- once its input's gradient exists -- this chunk's backward reads no parameter
        outside its transformer layers: the final norm, when the chunk has the last stage.
        Backward reads the output layer's ``W`` (``dX = G W``) and the norm's weights, but the
        embeddings' backward only adds rows (``dW[ids] += G``, ``dW_pos[pos] += G``) and reads
        no weight: so on a first stage without the last it is the embedding (its input, token
        ids, has no gradient: its output's gradient marks the point). None on a middle stage."""
        if self.post_process:
            return self.final_norm
        return self.embedding if self.pre_process else None

    def tp_duplicated_parameters(self) -> list[nn.Parameter]:
        """Parameters replicated (not split) over the TP group: norms, row-parallel biases,
        position embeddings. Their gradients are equal on all TP ranks (under SP too), so a
        global gradient norm counts them once. Empty with TP = 1."""
        return tp_duplicated_params([self], self.tp)

    # ---- full (layout-independent) tensors ----------------------------------------------------
    def _named_params(self):
        for name, module, p_name, param, _ in named_tp_params(self):
            yield name, module, p_name, param

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter (or its gradient, zeros if None) as the full, unpadded tensor.

        Collective over the TP group (all TP ranks call it; an MoE model's routed experts over
        the expert-TP group, and only this EP rank's experts are in it). Keys are the parameter names; the
        vocabulary matrices have ``vocab_size`` rows. Independent of TP: the seam for
        checkpoint resharding and Hugging Face conversion.
        """
        out = {}
        for name, module, p_name, param in self._named_params():
            t = param.detach() if not grads else (param.grad if param.grad is not None else torch.zeros_like(param))
            out[name] = to_full(module, p_name, t, getattr(module, "tp_group", self.tp_group))
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> list[str]:
        """Copy full tensors (as from :meth:`full_state_dict`) into this slice's shards.

        Returns the names of this slice's parameters missing from ``state`` (``strict`` raises).
        """
        missing = []
        for name, module, p_name, param in self._named_params():
            full = state.get(name)
            if full is None and name == "output_layer.weight" and self.config.tied_embeddings:
                full = state.get(WORD_EMBEDDING)  # the last stage's copy of the tied embedding
            if full is None and name == MTP_EMBEDDING:
                full = state.get(WORD_EMBEDDING)  # the last stage's copy for multi-token prediction
            if full is None:
                missing.append(name)
                continue
            group = getattr(module, "tp_group", self.tp_group)  # an expert's: the expert-TP group
            local = to_local(module, p_name, full, group_rank(group), group_size(group))
            if local.shape != param.shape:
                raise ValueError(f"{name}: full shape {tuple(full.shape)} gives {tuple(local.shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.copy_(local)
        if missing and strict:
            raise KeyError(f"missing from state: {missing}")
        return missing
