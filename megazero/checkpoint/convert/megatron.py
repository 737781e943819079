"""Read a Megatron-LM legacy (``--ckpt-format torch``) checkpoint as full megazero tensors.

Facts read from NVIDIA/Megatron-LM, tag ``core_v0.13.0``, and checked against megatron-core
0.16.1 itself (mcore keys, TP/PP/VP layout, QKV and SwiGLU order: tests/peers/, ``make peers``;
the file's pickled globals: :mod:`megazero.checkpoint.convert.megatron_pickle`):

* Layout (``megatron/training/checkpointing.py``: ``get_checkpoint_name``, ``read_metadata``,
  ``generate_state_dict``): ``DIR/latest_checkpointed_iteration.txt`` holds the iteration or the
  word ``release``; the files are ``DIR/iter_NNNNNNN/`` (or ``DIR/release/``) +
  ``mp_rank_TT/model_optim_rng.pt`` with PP = 1, ``mp_rank_TT_PPP/model_optim_rng.pt`` with PP > 1.
  Each is a ``torch.save`` dict: ``args`` (an ``argparse.Namespace``), ``checkpoint_version``
  (3.0), ``iteration``, ``model`` (or ``model0``, ``model1``, ... per virtual stage),
  ``optimizer``, ``opt_param_scheduler``, ``rng_state``, ``rerun_state_machine``.
* Legacy names (``megatron/legacy/model/{gpt_model,language_model,transformer}.py``), nested dicts
  flattened with ``.``: ``language_model.embedding.word_embeddings.weight``,
  ``language_model.embedding.position_embeddings.weight``,
  ``language_model.encoder.layers.i.{input_norm, self_attention.query_key_value,
  self_attention.dense, post_attention_norm, mlp.dense_h_to_4h, mlp.dense_4h_to_h}.*``,
  ``language_model.encoder.final_norm.*``, ``language_model.output_layer.weight`` (untied),
  ``word_embeddings_for_head.weight`` (tied copy on the last stage). Older ``*_layernorm`` norm
  names are accepted too.
* mcore names (``megatron/core/models/gpt/gpt_model.py``, ``gpt_layer_specs.py``):
  ``embedding.{word,position}_embeddings.weight``, ``decoder.layers.i.{input_layernorm,
  self_attention.linear_qkv, self_attention.linear_proj, pre_mlp_layernorm, mlp.linear_fc1,
  mlp.linear_fc2}.*``, ``decoder.final_layernorm.*``, ``output_layer.weight``; with Transformer
  Engine the norms are fused: ``linear_qkv.layer_norm_{weight,bias}``,
  ``linear_fc1.layer_norm_{weight,bias}``; ``*._extra_state`` entries are skipped.
* Layer ``i`` is numbered within its file's model chunk: chunk ``c`` of pipeline rank ``p`` holds
  global layers from ``(c * PP + p) * L / (PP * VP)`` (uniform split).
* Fused QKV rows (``attention.py``: ``[sq, b, ng, (np/ng + 2) * hn]``): per query group, that
  group's query heads, then its key head, then its value head; TP rank ``t`` holds groups
  ``[t G/TP, (t+1) G/TP)``. megazero's full QKV is ``[Q; K; V]`` (head-major rows). Its bias,
  present with ``add_bias_linear or add_qkv_bias`` (``attention.py``'s ``linear_qkv``, the legacy
  ``query_key_value``, core_v0.16.0), is ordered as those rows and regrouped the same way.
* SwiGLU's fused fc1 (``mlp.py``: ``glu``: ``chunk(x, 2)``, silu on the first half): each TP
  rank's rows are ``[gate_t; up_t]``; megazero's full fc1 is ``[gate; up]``.
* Column-parallel weights (embedding, output layer, QKV, fc1) concatenate over TP on rows,
  row-parallel ones (``dense``/``linear_proj``, ``fc2``) on columns; biases of row-parallel
  layers and norms are replicated. Vocabulary rows are padded (``padded_vocab_size``).
* MoE (mcore): expert-parallel rank folders ``mp_rank_TT[_PPP]_EEE``, router, routed experts in
  the sequential, TE-grouped and legacy grouped layouts, shared experts:
  :mod:`megazero.checkpoint.convert.megatron_moe`.

Only the weights are read (``optimizer``, RNG and scheduler state are ignored): the converted
checkpoint starts a fresh optimizer.
"""
from __future__ import annotations

import os
import re

import torch

from megazero.checkpoint.convert import megatron_moe as moe
from megazero.checkpoint.convert.megatron_pickle import load_megatron_file
from megazero.checkpoint.schema import CheckpointError, iteration_dir
from megazero.model.config import GPTConfig

__all__ = ["MegatronCheckpoint", "config_from_megatron_args", "find_rank_files", "load_megatron_file",
           "megatron_activation", "megazero_name"]

TRACKER = "latest_checkpointed_iteration.txt"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
LAYER_SUFFIX = {  # Megatron layer-local suffix -> megazero layer suffix (legacy, older legacy, mcore, TE)
    "input_norm": "input_norm", "input_layernorm": "input_norm",
    "self_attention.query_key_value": "attention.qkv", "self_attention.linear_qkv": "attention.qkv",
    "self_attention.linear_qkv.layer_norm": "input_norm",
    "self_attention.dense": "attention.dense", "self_attention.linear_proj": "attention.dense",
    "post_attention_norm": "post_attention_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_mlp_layernorm": "post_attention_norm", "mlp.linear_fc1.layer_norm": "post_attention_norm",
    "mlp.dense_h_to_4h": "mlp.fc1", "mlp.linear_fc1": "mlp.fc1",
    "mlp.dense_4h_to_h": "mlp.fc2", "mlp.linear_fc2": "mlp.fc2",
    "self_attention.q_layernorm": "attention.q_norm", "self_attention.k_layernorm": "attention.k_norm",  # --qk-layernorm
}
GLOBAL_NAMES = {
    "language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "language_model.embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "language_model.output_layer.weight": "output_layer.weight", "output_layer.weight": "output_layer.weight",
    "word_embeddings_for_head.weight": "output_layer.weight",
}
FINAL_NORMS = ("language_model.encoder.final_norm.", "language_model.encoder.final_layernorm.",
               "decoder.final_layernorm.")
LAYERS = re.compile(r"^(?:language_model\.encoder|decoder)\.layers\.(\d+)\.(.+)\.(weight|bias|layer_norm_weight|"
                    r"layer_norm_bias)$")


def megazero_name(key: str) -> tuple[str, int | None] | None:
    """(megazero name with the *local* layer number, local layer or None) of a flattened Megatron
    key; None for entries that hold no weight (``_extra_state``, rotary buffers)."""
    if key.endswith("_extra_state") or "rotary_pos_emb" in key:
        return None
    if key in GLOBAL_NAMES:
        return GLOBAL_NAMES[key], None
    for prefix in FINAL_NORMS:
        if key.startswith(prefix):
            return "final_norm." + key[len(prefix):], None
    m = LAYERS.match(key)
    if m:
        local, module, kind = int(m.group(1)), m.group(2), m.group(3)
        if kind.startswith("layer_norm_"):  # TE's fused norm: linear_qkv.layer_norm_weight
            module, kind = module + ".layer_norm", kind[len("layer_norm_"):]
        if module in LAYER_SUFFIX:
            return f"layers.{local}.{LAYER_SUFFIX[module]}.{kind}", local
    raise CheckpointError(f"unknown Megatron-LM parameter {key!r}")


def find_rank_files(root: str, iteration: int | None = None) -> tuple[str, int, dict]:
    """(iteration folder, iteration (0 for release), {(tp_rank, pp_rank, ep_rank): file}) of a
    checkpoint; one 3-digit suffix is told apart (PP or EP) by the saved ``args``."""
    if iteration is None:
        tracker = os.path.join(root, TRACKER)
        if not os.path.isfile(tracker):
            raise CheckpointError(f"{root}: no {TRACKER} (not a Megatron-LM checkpoint folder)")
        text = open(tracker).read().strip()
        if text != "release" and not text.isdigit():
            raise CheckpointError(f"{tracker}: {text!r} is neither an iteration nor 'release'")
        iteration = None if text == "release" else int(text)
    directory = os.path.join(root, "release") if iteration is None else iteration_dir(root, iteration)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory} is missing")
    raw = {}
    for name in sorted(os.listdir(directory)):
        m = RANK_DIR.match(name)
        if m and os.path.isfile(os.path.join(directory, name, "model_optim_rng.pt")):
            raw[tuple(None if g is None else int(g) for g in m.groups())] = \
                os.path.join(directory, name, "model_optim_rng.pt")
    if not raw:
        raise CheckpointError(f"{directory}: no mp_rank_*/model_optim_rng.pt and no .metadata (neither a legacy "
                              "nor a torch_dist Megatron-LM checkpoint)")
    return directory, iteration or 0, moe.rank_files(raw, directory, lambda path: load_megatron_file(path).get("args"))


def megatron_activation(a: dict, family: str) -> str:
    """The MLP activation Megatron-LM's ``family`` model computes under saved ``args`` ``a``
    (megatron-core 0.16.1 / Megatron-LM ``core_v0.16.1``):

    * ``legacy`` (``megatron/legacy/model/transformer.py``, ``ParallelMLP``): ``--openai-gelu``
      (tanh approximation) before ``--swiglu``, else exact (erf) gelu; its bias-gelu fusion is off.
    * ``mcore``: ``core_transformer_config_from_args`` (``megatron/training/arguments.py``) never
      reads ``--openai-gelu``; ``--swiglu`` gives silu-GLU, else ``F.gelu``, which ``MLP.forward``
      (``megatron/core/transformer/mlp.py``) computes with ``bias_gelu_impl``, the tanh
      approximation (``megatron/core/fusions/fused_bias_gelu.py``), whenever
      ``bias_activation_fusion`` (= ``--bias-gelu-fusion``, on by default, forced off by
      ``validate_args`` under ``--disable-bias-linear``) is set; exact gelu otherwise.
    """
    if a.get("swiglu") and not (family == "legacy" and a.get("openai_gelu")):
        return "swiglu"
    if family == "legacy":
        if a.get("swiglu"):
            raise CheckpointError("args set both --swiglu and --openai-gelu: Megatron's legacy MLP applies "
                                  "openai_gelu to the doubled fc1 (no model megazero can build)")
        return "gelu_tanh" if a.get("openai_gelu") else "gelu"
    fused = a.get("bias_gelu_fusion", True) and a.get("add_bias_linear", True)
    return "gelu_tanh" if fused else "gelu"


def config_from_megatron_args(a: dict, vocab_size: int | None = None, family: str = "mcore") -> GPTConfig:
    """The :class:`GPTConfig` of a Megatron-LM run's ``args`` (refusing what megazero lacks) for
    its ``family``'s model (``legacy``: ``language_model.*`` keys, ``mcore``: ``decoder.*``).

    Real vocabulary: ``vocab_size`` if given, else NullTokenizer's ``N + 1`` (Megatron's
    convention), else the padded size (the padding rows become ordinary, never-seen ids).
    Activation: :func:`megatron_activation`. RoPE base: ``--rotary-base`` for mcore; 10000 for
    the legacy model, which builds ``RotaryEmbedding`` without it
    (``megatron/legacy/model/language_model.py``, ``TransformerLanguageModel.__init__``, so
    megatron-core's default ``rotary_base=10000`` holds whatever the flag said)."""
    unsupported = [k for k, bad in (("rotary_percent != 1", a.get("rotary_percent", 1.0) != 1.0),
                                    ("rotary_interleaved", a.get("rotary_interleaved")),
                                    ("apply_residual_connection_post_layernorm",
                                     a.get("apply_residual_connection_post_layernorm")),
                                    ("squared_relu", a.get("squared_relu")), ("quick_geglu", a.get("quick_geglu")),
                                    ("window_attn_skip_freq", a.get("window_attn_skip_freq") is not None))
                   if bad]
    if a.get("position_embedding_type", "learned_absolute") not in ("learned_absolute", "rope"):
        unsupported.append(f"position_embedding_type {a['position_embedding_type']}")
    if unsupported:
        raise CheckpointError(f"unsupported Megatron-LM model options: {', '.join(unsupported)}")
    heads = a["num_attention_heads"]
    if vocab_size is None:
        null = a.get("tokenizer_type") == "NullTokenizer" and a.get("vocab_size")
        vocab_size = a["vocab_size"] + 1 if null else a["padded_vocab_size"]
    dtype = a.get("params_dtype", torch.float32)
    saved = {**{k: a.get(k) for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                       "seq_length", "max_position_embeddings", "rotary_base",
                                       "init_method_std", "seed")},
             "swiglu": megatron_activation(a, family) == "swiglu",
             "openai_gelu": megatron_activation(a, family) == "gelu_tanh",
             "num_query_groups": a.get("num_query_groups") if a.get("group_query_attention") else heads,
             "kv_channels": a.get("kv_channels") or a["hidden_size"] // heads, "vocab_size": vocab_size,
             "make_vocab_size_divisible_by": a.get("make_vocab_size_divisible_by", 128),
             "position_embedding_type": a.get("position_embedding_type", "learned_absolute"),
             "normalization": a.get("normalization", "LayerNorm"),
             "apply_layernorm_1p": bool(a.get("apply_layernorm_1p", False)),  # norm weights stored as w (1 + w)
             "norm_epsilon": a.get("norm_epsilon", a.get("layernorm_epsilon", 1e-5)),
             "add_bias_linear": a.get("add_bias_linear", True), "add_qkv_bias": bool(a.get("add_qkv_bias")),
             "untie_embeddings_and_output_weights": a.get("untie_embeddings_and_output_weights", False),
             "qk_layernorm": bool(a.get("qk_layernorm")), "window_size": a.get("window_size"),
             "params_dtype": str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) else dtype,
             **moe.moe_args(a)}
    saved["max_position_embeddings"] = saved["max_position_embeddings"] or saved["seq_length"]
    saved["init_method_std"] = saved["init_method_std"] or 0.02
    saved["seed"] = saved["seed"] if saved["seed"] is not None else 1234
    if family == "legacy":
        saved["rotary_base"] = 10000
    return GPTConfig.from_saved_args(saved, attention_dropout=a.get("attention_dropout", 0.1),
                                     hidden_dropout=a.get("hidden_dropout", 0.1))


def _flatten(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            yield prefix + key, value


class MegatronCheckpoint:
    """Full megazero tensors of a Megatron-LM legacy checkpoint (see the module doc).

    ``config``, ``iteration``, ``directory``, ``args`` (the saved Namespace as a dict), ``tp``,
    ``pp``, ``vp``, ``family`` (``legacy`` or ``mcore`` keys), ``tokenizer_flags`` (the recorded tokenizer when megazero has that type);
    ``full_tensor(name)`` gives one full, unpadded tensor under megazero's name.
    """

    def __init__(self, root: str, iteration: int | None = None, vocab_size: int | None = None):
        from megazero.data.tokenizers import TOKENIZER_FLAGS, TOKENIZER_TYPES
        self.directory, self.iteration, files = find_rank_files(root, iteration)
        self.tp, self.pp, self.ep = (max(k[i] for k in files) + 1 for i in range(3))
        states = {rank: load_megatron_file(path) for rank, path in files.items()}
        first = states[min(states)]
        self.args = dict(vars(first["args"])) if "args" in first else {}
        saved = tuple(int(self.args.get(f"{k}_model_parallel_size") or n)
                      for k, n in (("tensor", self.tp), ("pipeline", self.pp), ("expert", self.ep)))
        if saved != (self.tp, self.pp, self.ep):
            raise CheckpointError(f"{self.directory}: rank files give TP {self.tp} PP {self.pp} EP {self.ep}, "
                                  f"args say TP {saved[0]} PP {saved[1]} EP {saved[2]}")
        self.etp = moe.expert_tp(self.args, self.tp)
        chunks = sorted(k for k in first if k == "model" or re.fullmatch(r"model\d+", k))
        self.vp = len(chunks)
        if not chunks:
            raise CheckpointError(f"{files[min(files)]}: no 'model' entry")
        self.family = "legacy" if "language_model" in first[chunks[0]] else "mcore"
        self.config = config_from_megatron_args(self.args, vocab_size, self.family)
        self.tensors = self._collect(states, chunks)
        kind = self.args.get("tokenizer_type")
        self.tokenizer_flags = ({k: self.args[k] for k in TOKENIZER_FLAGS if self.args.get(k) is not None}
                                if kind in TOKENIZER_TYPES else {})

    def _collect(self, states: dict, chunks: list[str]) -> dict:
        """{megazero name: {tp_rank (a routed expert's: expert-TP rank): tensor}}, global layers."""
        per_chunk = self.config.num_layers // (self.pp * self.vp)
        if per_chunk * self.pp * self.vp != self.config.num_layers:
            raise CheckpointError(f"{self.config.num_layers} layers do not split evenly over PP {self.pp} x VP {self.vp}")
        out: dict[str, dict[int, torch.Tensor]] = {}
        for (t, p, e), state in states.items():
            for c, chunk in enumerate(chunks):
                offset = (c * self.pp + p) * per_chunk
                for key, tensor in _flatten(state[chunk]):
                    found = moe.moe_tensors(key, tensor, self.config, self.ep, e)
                    if found is None:
                        hit = megazero_name(key)
                        found = [] if hit is None else [(*hit, tensor)]
                    for name, local, tensor in found:
                        if name == "output_layer.weight" and self.config.tied_embeddings:
                            continue  # the last stage's copy of the tied embedding
                        if local is not None:
                            if local >= per_chunk:
                                raise CheckpointError(f"{key}: local layer {local} beyond {per_chunk} per chunk")
                            name = name.replace(f"layers.{local}.", f"layers.{offset + local}.", 1)
                        out.setdefault(name, {})[t % self.etp if moe.is_expert_name(name) else t] = tensor
        return out

    def full_tensor(self, name: str) -> torch.Tensor:
        shards, size = self.tensors.get(name), self.etp if moe.is_expert_name(name) else self.tp
        if shards is None or len(shards) != size:
            raise CheckpointError(f"{self.directory}: no complete {name} in the checkpoint")
        pieces = [shards[t] for t in range(size)]
        c = self.config
        suffix = moe.mlp_suffix(name.split(".", 2)[-1]) if name.startswith("layers.") else name
        if suffix in ("attention.dense.weight", "mlp.fc2.weight"):
            return torch.cat(pieces, 1)
        if suffix.startswith("attention.qkv."):
            fused = torch.cat(pieces, 0)
            per_group = c.num_attention_heads // c.num_query_groups * c.kv_channels
            grouped = fused.reshape(c.num_query_groups, per_group + 2 * c.kv_channels, *fused.shape[1:])
            q, k, v = grouped.split([per_group, c.kv_channels, c.kv_channels], 1)
            return torch.cat([x.reshape(-1, *fused.shape[1:]) for x in (q, k, v)], 0)
        if suffix.startswith("mlp.fc1.") and c.activation == "swiglu":
            halves = [x.chunk(2, 0) for x in pieces]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
        if suffix in ("embedding.word_embeddings.weight", "output_layer.weight"):
            return torch.cat(pieces, 0)[:c.vocab_size]
        if suffix.startswith(("mlp.fc1.", "attention.qkv.")):
            return torch.cat(pieces, 0)
        return pieces[0]  # replicated: norms, position embeddings, row-parallel biases

    def close(self) -> None:
        self.tensors = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
