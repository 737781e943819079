"""QK normalization and sliding-window attention as building blocks: the window's mask against
an explicit per-query loop, a window as long as the sequence changes nothing, the planner counts
the q/k norm weights, the flags parse as Megatron-LM's and bad values are refused in one line,
and a checkpoint's recorded values are compared on load."""

import pytest
import torch

from megazero.arguments import parse_args
from megazero.model import GPTConfig, GPTModel
from megazero.model.attention import Attention
from megazero.model.config import checked_window
from megazero.model.saved_args import checkpoint_model_args, model_arg_diffs
from megazero.planner import memory


def _config(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=64, seq_length=12,
                attention_dropout=0.0, hidden_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm",
                activation="swiglu", add_bias_linear=False)
    return GPTConfig(**dict(base, **kw))


@pytest.mark.parametrize("left,doc", [(0, None), (1, None), (4, None), (11, None), (4, 5)])
def test_window_mask_against_a_loop(left, doc):
    """``doc``: a --reset-attention-mask document boundary (documents 0..doc-1 and doc..11)."""
    att = Attention(_config(window_size=(left, 0)), 0, None, None, None).eval()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 12, 8, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = k[:, ::2].contiguous(), v[:, ::2].contiguous()  # 2 groups for 4 heads
    mask = None
    if doc is not None:  # Megatron's convention: True = not attended (causal and per document)
        i, j = torch.arange(12).unsqueeze(1), torch.arange(12).unsqueeze(0)
        mask = ((j > i) | ((i >= doc) & (j < doc))).expand(2, 1, 12, 12)
    got = att.core_attention(q, k, v, mask)
    ke, ve = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for i in range(12):
        lo = max(0, i - left)  # keys i - left .. i: HF Mistral's i - W < j <= i with W = left + 1
        lo = max(lo, doc) if doc is not None and i >= doc else lo
        p = torch.softmax(q[:, :, i:i + 1] @ ke[:, :, lo:i + 1].transpose(-1, -2) / 8 ** 0.5, -1)
        torch.testing.assert_close(got[:, :, i:i + 1], p @ ve[:, :, lo:i + 1])


def test_window_as_long_as_the_sequence_is_plain_causal_and_qk_norm_changes_the_model():
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    plain, wide = GPTModel(_config()).eval(), GPTModel(_config(window_size=(11, 0))).eval()
    torch.testing.assert_close(wide(tokens), plain(tokens), rtol=0, atol=0)
    narrow = GPTModel(_config(window_size=(3, 0))).eval()
    assert (narrow(tokens) - plain(tokens)).abs().max() > 1e-3
    qk = GPTModel(_config(qk_layernorm=True)).eval()
    new = {n for n, _ in qk.named_parameters()} - {n for n, _ in plain.named_parameters()}
    assert new == {f"layers.{i}.attention.{x}_norm.weight" for i in range(2) for x in "qk"}
    from megazero.tensor_parallel.spec import tp_duplicated_params  # replicated: the grad norm counts them once
    dup = {id(p) for p in tp_duplicated_params([qk], 2)}
    assert all(id(p) in dup for n, p in qk.named_parameters() if n in new)


@pytest.mark.parametrize("norm", ["RMSNorm", "LayerNorm"])
def test_planner_counts_the_qk_norms(norm):
    config = _config(qk_layernorm=True, normalization=norm)
    assert memory.total_params(config) == sum(p.numel() for p in GPTModel(config).parameters())
    assert memory.attention_params(config) - memory.attention_params(_config(normalization=norm)) == \
        2 * 8 * (2 if norm == "LayerNorm" else 1)


BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 2 --global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data --vocab-size 64 "
        "--tokenizer-type NullTokenizer --normalization RMSNorm --swiglu --disable-bias-linear "
        "--position-embedding-type rope").split()


def test_flags_as_megatron_and_refusals(capsys):
    args = parse_args(BASE + ["--qk-layernorm", "--window-size", "(4095,0)"], world_size=1)
    assert args.qk_layernorm and args.window_size == (4095, 0)
    assert checked_window([7, 0]) == (7, 0) and checked_window((-1, 0)) is None
    for bad, line in ((["--window-size", "4,1"], "--window-size 4,1: megazero's GPT attention is causal"),
                      (["--window-size", "4"], "argument --window-size: expected two integers"),
                      (["--apply-wd-to-qk-layernorm"], "--apply-wd-to-qk-layernorm"),
                      (["--window-size", "4,0", "--use-flash-attn"], "--window-size with the flash backend")):
        with pytest.raises(SystemExit):
            parse_args(BASE + bad, world_size=1)
        assert line in capsys.readouterr().err


def test_checkpoint_records_and_compares_the_new_flags():
    saved = _config(qk_layernorm=True, window_size=(7, 0)).to_args()
    assert saved["qk_layernorm"] is True and saved["window_size"] == [7, 0]
    assert GPTConfig.from_saved_args(saved).window_size == (7, 0)
    now = _config(window_size=(3, 0)).to_args()
    assert model_arg_diffs(saved, now) == ["--qk-layernorm: command line False, checkpoint True",
                                           "--window-size: command line [3, 0], checkpoint [7, 0]"]
    assert model_arg_diffs(saved, dict(saved)) == []
    taken = checkpoint_model_args(saved, {"qk_layernorm": False, "window_size": None})
    assert taken == {"qk_layernorm": True, "window_size": [7, 0]}
