"""A multi-latent-attention GPT through ``pretrain_gpt``'s flags: saved at TP 2 + SP, resumed
resharded at PP 2 x VP 2 (ZeRO 2) as if never stopped; a load with another MLA setting is refused
naming the flag; the checkpoint records Megatron's MLA argument names."""

import json

import numpy as np

from megazero.arguments import parse_args
from tests.test_training import MOCK, TINY, layout_flags, train


MLA_FLAGS = [
    "--qk-layernorm", "--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "10", "--qk-head-dim", "8",
    "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--rotary-scaling-factor", "4", "--mscale", "0.8",
    "--mscale-all-dim", "0.9", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
COMMON = TINY + MOCK + MLA_FLAGS + ["--train-iters", "6", "--save-interval", "100"]


def test_saved_at_tp2_sp_resumes_resharded_at_pp2_vp2(tmp_path, capfd):
    tp2 = layout_flags(2, 1, None, 1) + ["--sequence-parallel"]
    full = train(4, COMMON + tp2 + ["--save", str(tmp_path / "full")])
    first = train(4, COMMON + tp2 + ["--save", str(tmp_path / "ck"), "--exit-interval", "3"])
    second = train(4, COMMON + layout_flags(1, 2, 2, 2) + ["--save", str(tmp_path / "ck"), "--load",
                                                           str(tmp_path / "ck")])
    assert [i for i, _ in first + second] == list(range(1, 7))
    np.testing.assert_allclose([l for _, l in first + second], [l for _, l in full], rtol=1e-5)
    text = json.dumps(json.loads((tmp_path / "ck" / "iter_0000003" / "metadata.json").read_text()))
    for key in ('"multi_latent_attention": true', '"kv_lora_rank": 10', '"mscale_all_dim": 0.9'):
        assert key in text, text[:2000]
    generates_from(tmp_path / "ck", capfd)


def generates_from(save, capfd):
    """tools/generate.py loads the PP 2 x VP 2 checkpoint into TP 1 and TP 2 alike, says that the
    cache holds latents, and its greedy tokens are the in-process ones."""
    import megazero
    from megazero.inference.generation import generate
    from megazero.testing import run_distributed
    from tests.inference.test_generate import _run_tool
    gen = ["--load", str(save), "--prompt", "1 2 3", "--prompt", "40 41 42 43 44", "--max-new-tokens", "6",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    capfd.readouterr()
    one = run_distributed(_run_tool, 1, gen, timeout_s=60)[0]
    assert "> multi-latent attention: the KV cache holds each layer's compressed latent (kv_lora_rank 10 + " \
        "RoPE key 4 values per token), not K/V (72)" in capfd.readouterr().out
    assert run_distributed(_run_tool, 2, gen + ["--tensor-model-parallel-size", "2"], timeout_s=60) == [one, one]
    model = megazero.load_model(str(save)).gpt
    want = generate(model, [[1, 2, 3], [40, 41, 42, 43, 44]], 6).tokens
    assert [[int(t) for t in c.split()] for c in one] == want, (one, want)


def test_another_mla_setting_is_refused_naming_the_flag(tmp_path, capsys):
    from megazero.training import pretrain
    one = COMMON[:-2]  # no --save-interval
    one[one.index("--global-batch-size") + 1] = "2"
    one += ["--lr-decay-iters", "8"]
    save = tmp_path / "ck"
    assert pretrain(parse_args(one + ["--train-iters", "1", "--save", str(save), "--save-interval", "1"],
                               world_size=1, training=True)) == 0
    argv = one + ["--train-iters", "2", "--load", str(save), "--mscale", "0.5", "--v-head-dim", "8"]
    assert pretrain(parse_args(argv, world_size=1, training=True)) == 1
    err = capsys.readouterr().err
    assert "--v-head-dim: command line 8, checkpoint 6" in err and "--mscale: command line 0.5, checkpoint 0.8" in err
    assert not (save / "iter_0000002").exists()


def test_bad_mla_flags_one_line_each_before_any_work(capsys):
    import types

    import pytest

    from megazero.config.mla_flags import check_mla
    one = COMMON[:-2] + ["--lr-decay-iters", "8"]
    for extra, line in ((["--kv-channels", "8"], "--kv-channels 8 with --multi-latent-attention"),
                        (["--group-query-attention", "--num-query-groups", "2"], "mutually exclusive"),
                        (["--tensor-model-parallel-size", "8"], "--num-attention-heads 4 is not divisible by "
                                                                 "--tensor-model-parallel-size 8"),
                        (["--qk-pos-emb-head-dim", "5"], "--qk-pos-emb-head-dim 5: RoPE rotates pairs")):
        with pytest.raises(SystemExit):
            parse_args(one + extra, world_size=8)
        err = capsys.readouterr().err
        assert line in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit):
        parse_args(TINY + MOCK + ["--rope-type", "yarn", "--train-iters", "2"], world_size=1)
    assert "--rope-type yarn without --multi-latent-attention" in capsys.readouterr().err
    found = []
    check_mla(found.append, types.SimpleNamespace(**{**vars(parse_args(one, world_size=1)), "qk_layernorm": False}))
    assert found == ["--multi-latent-attention needs --qk-layernorm: megazero's MLA always normalizes its q/kv "
                     "latents (DeepSeek-V2/V3); Megatron's MLA has those norms only with --qk-layernorm"]
