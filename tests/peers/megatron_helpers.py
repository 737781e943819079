"""megatron-core 0.16.1 on CPU/gloo for the peer tests: its GPTModel at TP x PP (x VP) writes a
``--ckpt-format torch`` checkpoint the way Megatron-LM's ``save_checkpoint`` does, and gives the
logits megazero's import must reproduce.

What is the real library and what is reconstructed here:

* **Real (megatron-core 0.16.1 wheel)**: ``parallel_state.initialize_model_parallel``,
  ``TransformerConfig``, ``GPTModel`` with ``get_gpt_layer_local_spec`` (the Transformer-Engine-free
  spec), its forward (attention, RoPE, norms, fused bias-gelu, SwiGLU, tensor-parallel
  collectives over gloo), ``set_input_tensor`` (how a pipeline stage takes its input),
  ``state_dict_for_save_checkpoint`` (the ``model`` entries of a torch-format checkpoint), the
  RNG tracker's ``get_states`` and the enum ``AttnBackend`` stored in ``args``.
* **Reconstructed** (the training package ``megatron/training`` is not in the megatron-core wheel
  or sdist, and Megatron-LM's code is not committed here), following NVIDIA/Megatron-LM tag
  ``core_v0.16.1``: the rank file (``megatron/training/checkpointing.py``:
  ``get_checkpoint_name`` for the path, ``generate_state_dict`` for ``args``,
  ``checkpoint_version`` 3.0, ``iteration``, ``model``/``model0..``, ``get_rng_state`` for
  ``rng_state``; ``--no-save-optim`` so no optimizer entries); the ``args`` Namespace
  (:func:`megatron_args`: the fields of ``megatron/training/arguments.py`` this model uses, with
  the types ``parse_args``/``validate_args`` give them, ``exit_signal`` a ``signal.Signals``);
  the mapping of those args to ``TransformerConfig`` (:func:`transformer_config`, the relevant lines
  of ``core_transformer_config_from_args``); the stage-to-stage hand-off of hidden states with
  ``send``/``recv`` (Megatron's schedules do the same with ``p2p_communication``, CUDA-only).

CPU shims (:func:`cpu_shims`, applied inside the forked ranks only, each explicit):

* ``torch.cuda.current_device()`` answers ``"cpu"``: megatron-core places scratch and cached
  tensors with it (``GlobalMemoryBuffer.get_tensor`` for attention's ``baddbmm`` input,
  ``RotaryEmbedding.get_emb`` moving ``inv_freq``), so they stay on the CPU; ``Tensor.cuda()``
  returns the tensor (``LanguageModule.setup_embeddings_and_output_layer`` moves the tied
  embedding to the GPU before all-reducing it between the first and last stage);
* the RNG tracker's two CUDA state helpers (``megatron.core.tensor_parallel.random.
  _get_cuda_rng_state`` / ``_set_cuda_rng_state``) read and set the CPU generator; its states
  are seeded with its public ``set_states`` (``model_parallel_cuda_manual_seed`` calls
  ``torch.cuda.manual_seed``);
* megatron-core's sliding-window mask (``megatron.core.transformer.utils.get_sliding_window_causal_mask``,
  its ``torch.ones(..., device="cuda")``) runs unchanged under a ``TorchFunctionMode`` that
  places tensors a factory asks on ``cuda`` on the CPU instead (:class:`CudaFactoriesOnCPU`);
* ``torch._dynamo.config.disable``: megatron-core wraps its fused kernels in ``torch.compile``
  (``megatron/core/jit.py``) and each rank would compile them again; they run as the same
  eager functions.

``--no-persist-layer-norm`` as Megatron-LM needs it without Apex (``WrappedTorchNorm`` refuses
``persist_layer_norm``). Dropout is 0.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import warnings

import numpy as np
import torch
import torch.distributed as dist

VOCAB = 99  # NullTokenizer --vocab-size 99: 100 ids, padded to 128 * TP
GPT2 = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128, seq_length=16,
            max_position_embeddings=16, position_embedding_type="learned_absolute", normalization="LayerNorm",
            swiglu=False, add_bias_linear=True, untie_embeddings_and_output_weights=False, group_query_attention=False,
            num_query_groups=None, rotary_base=10000, openai_gelu=False, bias_gelu_fusion=True)
LLAMA = dict(GPT2, ffn_hidden_size=48, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             add_bias_linear=False, untie_embeddings_and_output_weights=True, group_query_attention=True,
             num_query_groups=2, rotary_base=500000, bias_gelu_fusion=False)


def cpu_shims() -> None:
    """See the module doc; only in a forked rank (the changes die with it)."""
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|APEX|cuda_graph_scope|full scope).*")
    import torch._dynamo
    torch._dynamo.config.disable = True  # torch.compile'd fused kernels run eagerly
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    from megatron.core.tensor_parallel import random as mrandom
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    from megatron.core.fusions import fused_softmax
    window_mask = fused_softmax.get_sliding_window_causal_mask

    def window_mask_on_cpu(*args, **kwargs):
        with CudaFactoriesOnCPU():
            return window_mask(*args, **kwargs)
    fused_softmax.get_sliding_window_causal_mask = window_mask_on_cpu


class CudaFactoriesOnCPU(torch.overrides.TorchFunctionMode):
    """A tensor factory called with ``device="cuda"`` builds on the CPU (same values)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def padded_vocab(tp: int, vocab: int = VOCAB) -> int:
    """Megatron's ``_vocab_size_with_padding``: NullTokenizer's N + 1 ids up to a multiple of 128 TP."""
    multiple = 128 * tp
    return -(-(vocab + 1) // multiple) * multiple


def megatron_args(model: dict, tp: int, pp: int, vp: int | None, vocab: int = VOCAB) -> argparse.Namespace:
    """The run's ``args`` as Megatron-LM 0.16 stores them (field names and value types of
    ``megatron/training/arguments.py`` at core_v0.16.1; only the fields this model touches plus the
    typed ones that reach the pickle)."""
    from megatron.core.transformer.enums import AttnBackend
    a = dict(model, kv_channels=model["hidden_size"] // model["num_attention_heads"], rotary_percent=1.0,
             rotary_interleaved=False, norm_epsilon=1e-5, apply_layernorm_1p=False, squared_relu=False,
             quick_geglu=False, qk_layernorm=model.get("qk_layernorm", False), window_size=model.get("window_size"),
             apply_residual_connection_post_layernorm=False,
             add_qkv_bias=model["add_bias_linear"], num_experts=None, vocab_size=vocab,
             tokenizer_type="NullTokenizer", make_vocab_size_divisible_by=128, padded_vocab_size=padded_vocab(tp, vocab),
             tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
             virtual_pipeline_model_parallel_size=vp, data_parallel_size=1, world_size=tp * pp,
             params_dtype=torch.float32, main_grads_dtype=torch.float32, main_params_dtype=torch.float32,
             exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32, init_method_std=0.02, seed=1234,
             attention_dropout=0.0, hidden_dropout=0.0, ckpt_format="torch", no_save_optim=True, no_save_rng=False,
             transformer_impl="local", attention_backend=AttnBackend.auto, exit_signal=signal.SIGTERM,
             exit_signal_handler=False, no_persist_layer_norm=True, micro_batch_size=2, global_batch_size=2, train_iters=10, lr=1e-3)
    if not a["add_bias_linear"]:
        a["bias_gelu_fusion"] = False  # validate_args: no bias, no bias-gelu fusion
    return argparse.Namespace(**a)


def transformer_config(a: argparse.Namespace):
    """``TransformerConfig`` from ``args`` as ``core_transformer_config_from_args`` maps the fields
    used here (megatron/training/arguments.py, core_v0.16.1): ``--swiglu`` -> silu + GLU and the
    swiglu fusion, else ``bias_activation_fusion = --bias-gelu-fusion``; ``--openai-gelu`` is not read."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig
    kw = dict(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
              ffn_hidden_size=a.ffn_hidden_size, kv_channels=a.kv_channels,
              num_query_groups=a.num_query_groups if a.group_query_attention else None,
              normalization=a.normalization, layernorm_epsilon=a.norm_epsilon, add_bias_linear=a.add_bias_linear,
              add_qkv_bias=a.add_qkv_bias, hidden_dropout=a.hidden_dropout, attention_dropout=a.attention_dropout,
              init_method_std=a.init_method_std, tensor_model_parallel_size=a.tensor_model_parallel_size,
              pipeline_model_parallel_size=a.pipeline_model_parallel_size,
              virtual_pipeline_model_parallel_size=a.virtual_pipeline_model_parallel_size,
              params_dtype=a.params_dtype, pipeline_dtype=a.params_dtype, use_cpu_initialization=True,
              persist_layer_norm=not a.no_persist_layer_norm, qk_layernorm=a.qk_layernorm,
              window_size=a.window_size)
    if a.swiglu:
        kw.update(activation_func=F.silu, gated_linear_unit=True, bias_activation_fusion=False)
    else:
        kw.update(bias_activation_fusion=a.bias_gelu_fusion)
    return TransformerConfig(**kw)


def build_chunks(a: argparse.Namespace, pp_rank: int, seed: int = 7, parallel_output: bool = False) -> list:
    """This rank's GPTModel chunk(s), every parameter redrawn (``randn * 0.2``, norms and biases
    too, so a wrong mapping shows); a tied head copy equals the first stage's embedding.
    ``parallel_output`` False: the head gathers the full vocabulary (for comparing logits)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    get_cuda_rng_tracker().set_states({"model-parallel-rng": torch.Generator().manual_seed(seed).get_state()})
    config, tp_rank = transformer_config(a), ps.get_tensor_model_parallel_rank()
    vp = a.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for c in range(vp):
        stage = c * a.pipeline_model_parallel_size + pp_rank
        spec = get_gpt_layer_local_spec(normalization=a.normalization, qk_layernorm=a.qk_layernorm)
        model = GPTModel(config, spec, a.padded_vocab_size,
                         a.max_position_embeddings, pre_process=stage == 0,
                         post_process=stage == vp * a.pipeline_model_parallel_size - 1, parallel_output=parallel_output,
                         share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
                         position_embedding_type=a.position_embedding_type, rotary_base=a.rotary_base,
                         vp_stage=c if a.virtual_pipeline_model_parallel_size else None)
        with torch.no_grad():
            for name, p in model.named_parameters():
                shard = tp_rank if getattr(p, "tensor_model_parallel", False) else -1
                tied_copy = name == "output_layer.weight" and model.share_embeddings_and_output_weights
                key = "0.embedding.word_embeddings.weight" if tied_copy else f"{stage}.{name}"
                g = torch.Generator().manual_seed(seed * 1000003 + hash_name(f"{key}/{shard}"))
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        chunks.append(model.eval())
    return chunks


def hash_name(text: str) -> int:
    """A stable (not salted) 31-bit hash of a name."""
    h = 0
    for ch in text.encode():
        h = (h * 131 + ch) % (1 << 31)
    return h


def batch(a: argparse.Namespace, b: int = 2, s: int = 12, seed: int = 0, vocab: int = VOCAB + 1):
    """(ids, position ids, Megatron's causal mask (True = masked), labels)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s + 1), generator=g)
    pos = torch.arange(s).expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)
    return ids[:, :-1].contiguous(), pos, mask, ids[:, 1:].contiguous()


def pipeline_logits(chunks: list, a: argparse.Namespace, ids, pos, mask, labels=None):
    """Run the stages in Megatron's order (chunk c of PP rank p is stage c PP + p), handing hidden
    states ``[s, b, h]`` to the next stage's rank of the same TP rank by send/recv; returns the
    last stage's output (full-vocabulary logits ``[b, s, V]``, or per-token loss with labels) on
    the ranks of the last stage, else None."""
    from megatron.core import parallel_state as ps
    pp, pp_rank = a.pipeline_model_parallel_size, ps.get_pipeline_model_parallel_rank()
    s, b, h = ids.shape[1], ids.shape[0], a.hidden_size
    out = None
    for stage in range(len(chunks) * pp):
        c, owner = divmod(stage, pp)
        if stage > 0 and owner == pp_rank and (stage - 1) % pp != pp_rank:
            buf = torch.empty(s, b, h)
            dist.recv(buf, src=ps.get_pipeline_model_parallel_prev_rank())
            chunks[c].set_input_tensor(buf)
        elif stage > 0 and owner == pp_rank:
            chunks[c].set_input_tensor(out)
        if owner == pp_rank:
            out = chunks[c](ids, pos, mask, labels=labels if stage == len(chunks) * pp - 1 else None)
            if stage < len(chunks) * pp - 1 and (stage + 1) % pp != pp_rank:
                dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    return out if pp_rank == pp - 1 else None


def rank_file(a: argparse.Namespace, chunks: list, iteration: int) -> dict:
    """One rank's ``model_optim_rng.pt`` content (``generate_state_dict`` with ``--no-save-optim``,
    ``get_rng_state`` with the CPU generator standing in for the CUDA one)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    state = {"args": a, "checkpoint_version": 3.0, "iteration": iteration}
    for c, model in enumerate(chunks):
        state["model" if len(chunks) == 1 else f"model{c}"] = model.state_dict_for_save_checkpoint()
    state["rng_state"] = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                           "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
                           "rng_tracker_states": get_cuda_rng_tracker().get_states()}]
    return state


def save_rank(root: str, a: argparse.Namespace, chunks: list, iteration: int) -> None:
    """``get_checkpoint_name``'s path for this rank (``mp_rank_TT`` + ``_PPP`` with PP > 1) and the
    tracker file (rank 0)."""
    from megatron.core import parallel_state as ps
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if a.pipeline_model_parallel_size > 1 else "")
    folder = os.path.join(root, f"iter_{iteration:07d}", name)
    os.makedirs(folder, exist_ok=True)
    torch.save(rank_file(a, chunks, iteration), os.path.join(folder, "model_optim_rng.pt"))
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(iteration))


def megatron_rank(rank: int, world: int, model: dict, tp: int, pp: int, vp: int | None, root: str,
                  iteration: int = 7):
    """One gloo rank: build the chunks, save this rank's file, return the logits of :func:`batch`
    on the last stage's TP rank 0 (else None)."""
    cpu_shims()
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp)
    try:
        a = megatron_args(model, tp, pp, vp)
        chunks = build_chunks(a, ps.get_pipeline_model_parallel_rank())
        save_rank(root, a, chunks, iteration)
        ids, pos, mask, _ = batch(a)
        with torch.no_grad():
            out = pipeline_logits(chunks, a, ids, pos, mask)
        return out if out is not None and ps.get_tensor_model_parallel_rank() == 0 else None
    finally:
        ps.destroy_model_parallel()


def megatron_train_rank(rank: int, world: int, model: dict, root: str, steps: int, lr: float,
                        vocab: int) -> list[float]:
    """TP 1 x PP 1: save the freshly drawn model (iteration 0), then ``steps`` steps of torch's
    AdamW on the mean of megatron-core's per-token loss (``GPTModel.forward(labels=...)``, the
    full padded-vocabulary softmax of ``vocab_parallel_cross_entropy``) over :func:`batch`
    ``seed = step``; returns the losses. Megatron's own optimizer (``get_megatron_optimizer``)
    needs its CUDA-resident DDP buffers, so torch's AdamW runs on both sides."""
    cpu_shims()
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(1, 1)
    try:
        a = megatron_args(model, 1, 1, None, vocab)
        (net,) = build_chunks(a, 0, parallel_output=True)  # as pretrain_gpt.py builds it
        save_rank(root, a, [net], 0)
        net.train()
        opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.1)
        losses = []
        for step in range(steps):
            ids, pos, mask, labels = batch(a, seed=step, vocab=vocab + 1)
            loss = net(ids, pos, mask, labels=labels).float().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses
    finally:
        ps.destroy_model_parallel()


def megazero_model(root: str):
    """The megazero model of an imported checkpoint (dropout 0), one process."""
    from megazero.checkpoint.reader import CheckpointReader
    from megazero.model import GPTConfig, GPTModel
    reader = CheckpointReader(root)
    config = GPTConfig.from_saved_args(reader.args, attention_dropout=0.0, hidden_dropout=0.0)
    model = GPTModel(config, None)
    missing = model.load_full_state_dict(reader.full_model_state_dict(), strict=False)
    assert missing == [], missing
    return model


@contextlib.contextmanager
def without_megatron_safe_globals():
    """Importing megatron-core registers its ``SAFE_GLOBALS`` with torch
    (``megatron/core/safe_globals.py``), which would hide from megazero's loader what a converter
    process without Megatron sees; they are cleared for the block and restored after."""
    from torch import serialization
    saved = serialization.get_safe_globals()
    serialization.clear_safe_globals()
    try:
        yield
    finally:
        serialization.add_safe_globals(saved)


def rank_file_globals(root: str) -> set:
    """The non-tensor globals torch lists in the first rank file (no Megatron allow-list)."""
    from torch.serialization import get_unsafe_globals_in_checkpoint
    folder = os.path.join(root, sorted(d for d in os.listdir(root) if d.startswith("iter_"))[0])
    path = os.path.join(folder, sorted(os.listdir(folder))[0], "model_optim_rng.pt")
    with without_megatron_safe_globals():
        return set(get_unsafe_globals_in_checkpoint(path))


def convert(src: str, dst: str, *extra: str) -> None:
    """``tools/convert_checkpoint.py from-megatron`` as a user runs it (its ``main``, in a process
    where Megatron's safe globals are not registered)."""
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "convert_checkpoint.py")
    spec = importlib.util.spec_from_file_location("convert_checkpoint", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with without_megatron_safe_globals():
        assert tool.main(["from-megatron", "--load", src, "--save", dst, *extra]) == 0
