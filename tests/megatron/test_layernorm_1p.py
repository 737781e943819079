"""--apply-layernorm-1p (Megatron's zero-centred gamma): norm weights stored as w, initialized to
0, applied as 1 + w. The 1p model equals a plain-norm model whose norm weights are 1 + w."""

import pytest
import torch

from megazero.arguments import parse_args
from megazero.config.model import gpt_config
from megazero.model import GPTConfig, GPTModel
from megazero.model.config import replace_config

NORMS = ("input_norm.weight", "post_attention_norm.weight", "final_norm.weight")


def config(normalization):
    return GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, seq_length=16,
                     normalization=normalization, attention_dropout=0.0, hidden_dropout=0.0,
                     position_embedding_type="rope" if normalization == "RMSNorm" else "learned_absolute",
                     apply_layernorm_1p=True)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_1p_model_equals_plain_model_with_one_plus_w(normalization):
    cfg = config(normalization)
    one_p = GPTModel(cfg, device="cpu").eval()
    plain = GPTModel(replace_config(cfg, apply_layernorm_1p=False), device="cpu").eval()
    norm_weights = {n: p for n, p in one_p.named_parameters() if n.endswith(NORMS)}
    assert len(norm_weights) == 2 * 2 + 1 and all(torch.equal(p, torch.zeros_like(p)) for p in norm_weights.values())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in norm_weights.values():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        state = dict(one_p.state_dict())
        plain.load_state_dict({n: t + 1 if n in norm_weights else t for n, t in state.items()})
    tokens = torch.randint(0, 100, (2, 16), generator=gen)
    labels = torch.randint(0, 100, (2, 16), generator=gen)
    torch.testing.assert_close(one_p(tokens), plain(tokens), rtol=1e-5, atol=1e-5)
    loss_1p, loss_plain = one_p(tokens, labels=labels).mean(), plain(tokens, labels=labels).mean()
    loss_1p.backward()
    loss_plain.backward()
    plain_params = dict(plain.named_parameters())
    for n, p in one_p.named_parameters():  # d/dw of f(1 + w) = f'(1 + w): the same gradients
        torch.testing.assert_close(p.grad, plain_params[n].grad, rtol=1e-4, atol=1e-6)


def test_flag_reaches_the_config_and_meta_init():
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--mock-data", "--vocab-size", "100", "--apply-layernorm-1p"]
    args = parse_args(argv, world_size=1)
    cfg = gpt_config(args)
    assert cfg.apply_layernorm_1p and cfg.to_args()["apply_layernorm_1p"] is True
    assert GPTConfig.from_saved_args(cfg.to_args()).apply_layernorm_1p
    meta = GPTModel(cfg, device="cpu", meta_init=True)
    assert torch.equal(meta.final_norm.param_inits["weight"](), torch.zeros(32))


def test_hugging_face_mapping_adds_the_one():
    from megazero.checkpoint.convert.hf import full_to_hf, hf_to_full
    cfg = replace_config(config("RMSNorm"), activation="swiglu", add_bias_linear=False)
    full = GPTModel(cfg, device="cpu").full_state_dict()
    hf = full_to_hf(full, cfg, "llama")
    assert torch.equal(hf["model.norm.weight"], torch.ones(32))  # w = 0 -> HF scale 1
    assert torch.equal(hf["model.layers.0.input_layernorm.weight"], torch.ones(32))
    back = hf_to_full(hf, cfg, "llama")
    assert all(torch.equal(back[k], full[k]) for k in full)
    plain = replace_config(cfg, apply_layernorm_1p=False)
    assert torch.equal(hf_to_full(hf, plain, "llama")["final_norm.weight"], torch.ones(32))


def test_megatron_import_keeps_the_flag():
    from megazero.checkpoint.convert.megatron import config_from_megatron_args
    a = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16, "padded_vocab_size": 128,
         "apply_layernorm_1p": True}
    assert config_from_megatron_args(a).apply_layernorm_1p
    assert not config_from_megatron_args({**a, "apply_layernorm_1p": False}).apply_layernorm_1p
