"""megazero's multi-token prediction = megatron-core 0.16.1's (``GPTModel`` with
``get_gpt_mtp_block_spec``, local spec, CPU, TP 1) on the same weights: the per-token LM loss, each
depth's MTP loss (``MTPLossLoggingHelper``'s tracker: ``sum(mask * CE) / sum(mask)`` of the rolled
labels and mask) and the gradients of ``mean(lm loss)`` with the MTP loss attached
(``MTPLossAutoScaler``, backward scale 1; megazero's ``aux_scale`` 1), fp32, max-relative 1e-5.
The flags' meanings are Megatron's (``--mtp-num-layers``, ``--mtp-loss-scaling-factor``), and so is
full recompute (uniform, one layer: the decoder layers and each MTP layer's projection + transformer
layer checkpointed on both sides, ``MultiTokenPredictionLayer._checkpointed_forward``)."""

import pytest
import torch

from tests.peers.megatron_helpers import cpu_shims

CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, mtp_num_layers=2,
           mtp_loss_scaling_factor=0.3)
V, S, B = 128, 12, 2
UNIFORM = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def megazero_model(recompute):
    from megazero.model import GPTConfig, GPTModel
    cfg = GPTConfig(vocab_size=V, make_vocab_size_divisible_by=128, seq_length=S, position_embedding_type="rope",
                    normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
                    untie_embeddings_and_output_weights=True, attention_dropout=0.0, hidden_dropout=0.0, **CFG, **recompute)
    model = GPTModel(cfg)
    with torch.no_grad():  # norms away from one, so a misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _megatron_name(name: str) -> str:
    """megazero -> megatron-core (local spec) parameter name."""
    layer = {"input_norm.": "input_layernorm.", "attention.qkv.": "self_attention.linear_qkv.",
             "attention.dense.": "self_attention.linear_proj.", "post_attention_norm.": "pre_mlp_layernorm.",
             "mlp.fc1.": "mlp.linear_fc1.", "mlp.fc2.": "mlp.linear_fc2."}
    name = name.replace("final_norm.", "final_layernorm.")
    if name.startswith(("layers.", "final_layernorm.")):
        name = "decoder." + name
    for ours, theirs in layer.items():
        name = name.replace(ours, theirs)
    return name


def _megatron_value(name: str, t: torch.Tensor) -> torch.Tensor:
    """megazero's ``[Q; K; V]`` rows -> Megatron's per-head ``[q_h; k_h; v_h]`` (no GQA here)."""
    if "linear_qkv" not in name:
        return t
    H, d = CFG["num_attention_heads"], CFG["hidden_size"] // CFG["num_attention_heads"]
    return t.view(3, H, d, -1).transpose(0, 1).reshape(t.shape)


def _megatron(rank, world, full, ids, labels, recompute):
    cpu_shims()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    ps.initialize_model_parallel(1, 1)
    try:
        get_cuda_rng_tracker().set_states({"model-parallel-rng": torch.Generator().manual_seed(1).get_state()})
        cfg = TransformerConfig(normalization="RMSNorm", layernorm_epsilon=1e-5, add_bias_linear=False,
                                gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                                bias_activation_fusion=False, use_cpu_initialization=True, hidden_dropout=0.0,
                                attention_dropout=0.0, persist_layer_norm=False, **CFG, **recompute)
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        model = GPTModel(cfg, spec, V, S, position_embedding_type="rope", share_embeddings_and_output_weights=False,
                         mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, t in full.items():
                params[_megatron_name(name)].copy_(_megatron_value(_megatron_name(name), t))
        mask = torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), 1)
        pos = torch.arange(S).expand(B, S)
        model.train()
        loss = model(ids, pos, mask, labels=labels)
        loss.mean().backward()
        mtp = MTPLossLoggingHelper.tracker["values"].clone()
        grads = {name: params[_megatron_name(name)].grad.clone() for name in full}
        grads = {n: (g if "linear_qkv" not in _megatron_name(n) else
                     g.view(-1, 3, g.shape[0] // (3 * CFG["num_attention_heads"]), g.shape[1]).transpose(0, 1)
                     .reshape(g.shape)) for n, g in grads.items()}
        return loss.detach(), mtp, grads
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("recompute", [{}, UNIFORM], ids=["plain", "full-uniform-recompute"])
def test_megazero_mtp_equals_megatron_core(recompute):
    from megazero.testing import run_distributed
    model = megazero_model(recompute)
    full = {k: v.detach().clone() for k, v in model.full_state_dict().items()}
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, V, (B, S + 1), generator=g)
    ids, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    model.train()
    model.moe_state.set_aux_scale(1.0)
    losses = model(ids, labels=labels)
    losses.mean().backward()
    mtp = model.moe_state.take()["mtp_loss"][:CFG["mtp_num_layers"]]
    (want_loss, want_mtp, want_grads), = run_distributed(_megatron, 1, full, ids, labels, recompute,
                                                                  timeout_s=120)

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()
    assert rel(losses, want_loss) < 1e-5 and rel(mtp, want_mtp) < 1e-5, (mtp, want_mtp)
    for name, p in model.named_parameters():
        assert rel(p.grad, want_grads[name]) < 1e-5, name


def test_uniform_recompute_of_two_layers_megatron_asserts_megazero_refuses():
    """Megatron stops in the MTP layer's forward (``recompute_num_layers must be 1 for MTP
    recompute``); megazero refuses the same setting when the model is built (and the flags parsed)."""
    from megazero.testing import run_distributed
    two = dict(UNIFORM, recompute_num_layers=2)
    with pytest.raises(ValueError, match="--recompute-num-layers 2: megatron-core 0.16.1"):
        megazero_model(two)
    full = {k: v.detach().clone() for k, v in megazero_model({}).full_state_dict().items()}
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))
    with pytest.raises(Exception, match="recompute_num_layers must be 1 for MTP recompute"):
        run_distributed(_megatron, 1, full, ids, ids.roll(-1, 1), two, timeout_s=120)
