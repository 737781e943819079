"""Peer tests against megatron-core 0.16.1 itself (``make peers``): its mcore GPTModel with
``--qk-layernorm`` (``q_layernorm`` / ``k_layernorm`` of the local spec, RMSNorm over the head
size) and ``--window-size 3,0`` (its ``FusedScaleMaskSoftmax`` with the sliding-window mask of
``get_sliding_window_causal_mask``), Llama-style otherwise, at TP 1/2 x PP 1/2, writes a
``--ckpt-format torch`` checkpoint; ``tools/convert_checkpoint.py from-megatron`` imports it and
megazero's model gives Megatron's logits (so the flags mean what they mean there: keys
``i - 3 .. i``, the norm before RoPE, one weight per head size); a few AdamW steps from the same
weights give Megatron's losses (the q/k norm gradients included)."""
import pytest
import torch

pytest.importorskip("megatron.core", reason="the Megatron peer suite runs under `make peers`")

from megazero.testing import run_distributed  # noqa: E402
from tests.peers import megatron_helpers as mh  # noqa: E402

import megatron.core.models.gpt  # noqa: E402,F401  -- once in the parent; the forked ranks share it

STYLES = {"qk_norm": dict(mh.LLAMA, qk_layernorm=True),
          "qk_norm_window": dict(mh.LLAMA, qk_layernorm=True, window_size=(3, 0)),
          "window": dict(mh.LLAMA, window_size=(5, 0))}


@pytest.mark.parametrize("style,tp,pp", [("qk_norm", 1, 1), ("qk_norm_window", 1, 1), ("qk_norm_window", 2, 1),
                                         ("qk_norm_window", 2, 2), ("window", 1, 2)])
def test_mcore_qk_norm_and_window_import_with_megatrons_logits(tmp_path, style, tp, pp):
    results = run_distributed(mh.megatron_rank, tp * pp, STYLES[style], tp, pp, None, str(tmp_path / "mt"),
                              timeout_s=90)
    (ref,) = [r[..., :mh.VOCAB + 1] for r in results if r is not None]
    mh.convert(str(tmp_path / "mt"), str(tmp_path / "mz"))
    ours = mh.megazero_model(str(tmp_path / "mz")).eval()
    assert ours.config.qk_layernorm == STYLES[style].get("qk_layernorm", False)
    assert ours.config.window_size == STYLES[style].get("window_size")
    with torch.no_grad():
        got = ours(mh.batch(None)[0])[..., :mh.VOCAB + 1]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    if "window" in style:  # without the window the same weights give other logits: the test sees it
        from megazero.model import GPTModel
        from megazero.model.config import replace_config
        full = GPTModel(replace_config(ours.config, window_size=None), None).eval()
        full.load_full_state_dict(ours.full_state_dict())
        with torch.no_grad():
            assert (full(mh.batch(None)[0])[..., :mh.VOCAB + 1] - ref).abs().max() > 1e-3


def test_training_steps_give_megatrons_losses(tmp_path):
    vocab, steps, lr = 127, 4, 1e-2
    (ref,) = run_distributed(mh.megatron_train_rank, 1, STYLES["qk_norm_window"], str(tmp_path / "mt"), steps, lr,
                             vocab, timeout_s=90)
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
    assert ref[0] != ref[-1]
    assert losses == pytest.approx(ref, rel=1e-5, abs=1e-6)
