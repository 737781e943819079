"""Peer tests against megatron-core 0.16.1 itself (``make peers``): its mcore GPTModel, GPT-2-style
(learned positions, LayerNorm, biases, fused bias-gelu, tied embeddings) and Llama-style (RoPE base
500000, RMSNorm, SwiGLU, GQA 4 heads / 2 groups, no biases, untied), at TP 1/2 x PP 1/2 and with
virtual stages, writes a ``--ckpt-format torch`` checkpoint (tests/peers/megatron_helpers.py says
which parts are the library and which are reconstructed); ``tools/convert_checkpoint.py
from-megatron`` imports it unmodified and megazero's model gives Megatron's logits; a few AdamW
steps from the same weights and batches give Megatron's losses."""
import pytest
import torch

pytest.importorskip("megatron.core", reason="the Megatron peer suite runs under `make peers`")

from megazero.testing import run_distributed  # noqa: E402
from tests.peers import megatron_helpers as mh  # noqa: E402

import megatron.core.models.gpt  # noqa: E402,F401  -- once in the parent; the forked ranks share it

CASES = [("gpt2", 1, 1, None), ("gpt2", 2, 1, None), ("gpt2", 1, 2, None), ("gpt2", 2, 2, None),
         ("llama", 1, 1, None), ("llama", 2, 1, None), ("llama", 1, 2, None), ("llama", 2, 2, None),
         ("llama", 1, 2, 2), ("gpt2", 2, 2, 2)]
STYLES = {"gpt2": mh.GPT2, "llama": mh.LLAMA,
          # finding (b): --openai-gelu saved, but mcore computes exact gelu without the bias-gelu fusion
          "gpt2_exact_gelu": dict(mh.GPT2, openai_gelu=True, bias_gelu_fusion=False)}


def megatron_logits(tmp_path, model: dict, tp: int, pp: int, vp):
    results = run_distributed(mh.megatron_rank, tp * pp, model, tp, pp, vp, str(tmp_path / "mt"), timeout_s=90)
    (logits,) = [r for r in results if r is not None]
    return logits[..., :mh.VOCAB + 1]


@pytest.mark.parametrize("style,tp,pp,vp", CASES + [("gpt2_exact_gelu", 1, 1, None)])
def test_mcore_checkpoint_imports_with_megatrons_logits(tmp_path, style, tp, pp, vp):
    ref = megatron_logits(tmp_path, STYLES[style], tp, pp, vp)
    # what Megatron-LM 0.16's rank files pickle besides tensors (finding (a): all of it loads)
    assert mh.rank_file_globals(str(tmp_path / "mt")) == {
        "argparse.Namespace", "signal.Signals", "megatron.core.transformer.enums.AttnBackend",
        "numpy.ndarray", "numpy.dtype", "numpy._core.multiarray._reconstruct"}
    mh.convert(str(tmp_path / "mt"), str(tmp_path / "mz"))
    ours = mh.megazero_model(str(tmp_path / "mz")).eval()
    ids = mh.batch(None)[0]
    with torch.no_grad():
        got = ours(ids)[..., :mh.VOCAB + 1]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_training_steps_give_megatrons_losses(tmp_path, style):
    vocab, steps, lr = 127, 4, 1e-2  # 128 ids: no vocabulary padding, so both softmaxes span the same rows
    (ref,) = run_distributed(mh.megatron_train_rank, 1, STYLES[style], str(tmp_path / "mt"), steps, lr, vocab,
                             timeout_s=90)
    mh.convert(str(tmp_path / "mt"), str(tmp_path / "mz"))
    ours = mh.megazero_model(str(tmp_path / "mz")).train()
    opt = torch.optim.AdamW(ours.parameters(), lr=lr, weight_decay=0.1)
    losses = []
    for step in range(steps):
        ids, _, _, labels = mh.batch(None, seed=step, vocab=vocab + 1)
        loss = ours(ids, labels=labels).float().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert ref[0] != ref[-1]  # the steps moved the model
    assert losses == pytest.approx(ref, rel=1e-5, abs=1e-6)
