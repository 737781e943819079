"""--eod-mask-loss, --reset-position-ids, --reset-attention-mask: Megatron-LM's
get_ltor_masks_and_position_ids (core_v0.19.0 megatron/core/datasets/gpt_dataset.py), against a
hand-worked example and a literal loop of Megatron's code; the per-document mask in the model is
block-diagonal (a document's outputs ignore earlier documents) and TP 2 equals TP 1."""

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from megazero.arguments import parse_args
from megazero.model import GPTConfig, GPTModel
from megazero.model.stages import gpt_forward_step
from megazero.parallel.topology import Topology
from megazero.tensor_parallel import gather_from_tp_region
from megazero.testing import run_distributed
from megazero.config.run_config import data_config
from megazero.training.data import DocumentMasks

ALL = DocumentMasks(eod=9, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)


def megatron_loop(tokens, eod):
    """Megatron's per-sample loop, literally (mask True = not attended)."""
    b, s = tokens.shape
    att = torch.tril(torch.ones(b, 1, s, s))
    loss_mask = torch.ones(b, s)
    loss_mask[tokens == eod] = 0.0
    pos = torch.arange(s).unsqueeze(0).repeat(b, 1)
    for r in range(b):
        prev = 0
        for i in pos[r, tokens[r] == eod].clone().tolist():
            att[r, 0, i + 1:, :i + 1] = 0
            pos[r, i + 1:] -= i + 1 - prev
            prev = i + 1
    return att < 0.5, loss_mask, pos


def test_hand_worked_example():
    out = ALL(torch.tensor([[5, 9, 2, 3, 9, 4]]))
    assert out["loss_mask"].tolist() == [[1, 0, 1, 1, 0, 1]]
    assert out["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0]]
    allowed = (~out["attention_mask"][0, 0]).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0, 0],
                       [0, 0, 1, 0, 0, 0],
                       [0, 0, 1, 1, 0, 0],
                       [0, 0, 1, 1, 1, 0],
                       [0, 0, 0, 0, 0, 1]]
    only_loss = DocumentMasks(eod=9, eod_mask_loss=True)(torch.tensor([[5, 9, 2]]))
    assert only_loss["position_ids"].tolist() == [[0, 1, 2]] and "attention_mask" not in only_loss


def test_equals_megatron_loop_on_random_tokens():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 10, (4, 37), generator=gen)  # about one eod in ten, some adjacent
    tokens[0, 0], tokens[1, -1], tokens[2, :3] = 9, 9, 9
    att, loss_mask, pos = megatron_loop(tokens, 9)
    out = ALL(tokens)
    assert torch.equal(out["attention_mask"], att) and torch.equal(out["loss_mask"], loss_mask)
    assert torch.equal(out["position_ids"], pos)


def test_flags_reach_document_masks():
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--mock-data", "--vocab-size", "100"]
    assert DocumentMasks.from_config(data_config(parse_args(argv, world_size=1)), 100) is None
    args = parse_args(argv + ["--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask"], world_size=1)
    assert DocumentMasks.from_config(data_config(args), 100) == DocumentMasks(99, True, True, True)


CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=50, seq_length=12,
           make_vocab_size_divisible_by=8, position_embedding_type="rope", normalization="RMSNorm",
           activation="swiglu", ffn_hidden_size=48, attention_dropout=0.0, hidden_dropout=0.0)


def _batch():
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 49, (2, 12), generator=gen)
    tokens[0, 4], tokens[1, 2], tokens[1, 7] = 49, 49, 49
    masks = DocumentMasks(eod=49, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    return {"tokens": tokens, "labels": torch.randint(0, 50, (2, 12), generator=gen), **masks(tokens)}


def test_later_document_ignores_earlier_one():
    model = GPTModel(GPTConfig(**CFG)).eval()
    batch = _batch()
    changed = batch["tokens"].clone()
    changed[0, :4] = (changed[0, :4] + 1) % 49  # the first document of sample 0
    with torch.no_grad():
        a = model(batch["tokens"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"])
        b = model(changed, position_ids=batch["position_ids"], attention_mask=batch["attention_mask"])
        causal = model(changed, position_ids=batch["position_ids"])
    torch.testing.assert_close(a[0, 5:], b[0, 5:], rtol=0, atol=1e-6)
    assert not torch.allclose(a[0, :4], b[0, :4]) and not torch.allclose(causal[0, 5:], a[0, 5:])


def _tp_run(rank, world):
    batch = _batch()
    out = {}
    for tp in (1, 2):
        topo = Topology(world, rank, tp=tp).create_groups()
        model = GPTModel(GPTConfig(**CFG), topo)
        logits = gather_from_tp_region(model(batch["tokens"], position_ids=batch["position_ids"],
                                             attention_mask=batch["attention_mask"]), topo.tp_group)[..., :50]
        loss = gpt_forward_step(model, batch, None)
        loss.backward()
        out[tp] = (logits.detach(), loss.detach(), model.full_state_dict(grads=True))
    return out


def test_document_mask_tp2_equals_tp1():
    for out in run_distributed(_tp_run, 2):
        (l1, loss1, g1), (l2, loss2, g2) = out[1], out[2]
        torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss2, loss1, rtol=1e-6, atol=1e-6)
        for name in g1:
            torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-6)


def _lm_losses(nproc, flags):
    root = Path(__file__).resolve().parents[2]
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "2",
            "--log-interval", "1", "--eval-iters", "0", "--attention-dropout", "0", "--hidden-dropout", "0",
            "--mock-data", "--vocab-size", "10", "--position-embedding-type", "rope", "--seed", "5", *flags]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    out = subprocess.run([*launch, str(root / "pretrain_gpt.py"), *base], capture_output=True, text=True,
                         timeout=300, cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    return [float(m) for m in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", out.stdout)]


def test_training_with_document_masks_pp2_equals_pp1():
    """Mock tokens in [0, 10): eod 9 about every tenth token. Through pretrain_gpt.py the three
    switches change the loss, and PP 2 (the mask reaches both stages) equals one process."""
    flags = ["--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask"]
    plain, one = _lm_losses(1, []), _lm_losses(1, flags)
    two = _lm_losses(2, flags + ["--pipeline-model-parallel-size", "2"])
    assert len(one) == len(two) == 2 and all(abs(a - b) > 1e-4 for a, b in zip(plain, one))
    for a, b in zip(one, two):
        assert abs(a - b) <= 1e-5 * abs(a)


def test_mask_with_attention_dropout_and_recompute():
    """Training mode with attention dropout (the explicit softmax path): a later document still
    ignores an earlier one (same dropout draws), and selective/full recompute give the same
    gradients as no recompute."""
    batch = _batch()
    cfg = GPTConfig(**{**CFG, "attention_dropout": 0.3})
    changed = batch["tokens"].clone()
    changed[0, :4] = (changed[0, :4] + 1) % 49
    model = GPTModel(cfg).train()
    state = model.rng.state_dict()
    a = model(batch["tokens"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"])
    model.rng.load_state_dict(state)
    b = model(changed, position_ids=batch["position_ids"], attention_mask=batch["attention_mask"])
    torch.testing.assert_close(a[0, 5:], b[0, 5:], rtol=0, atol=1e-6)
    grads = []
    for recompute in (None, "selective", "full"):
        m = GPTModel(GPTConfig(**{**CFG, "attention_dropout": 0.3}, recompute_granularity=recompute)).train()
        m.rng.load_state_dict(state)
        gpt_forward_step(m, batch, None).backward()
        grads.append(m.full_state_dict(grads=True))
    for other in grads[1:]:
        for name, g in grads[0].items():
            torch.testing.assert_close(other[name], g, rtol=1e-5, atol=1e-7)


def test_flash_backend_with_document_mask_is_refused(capsys):
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--mock-data", "--vocab-size", "100", "--reset-attention-mask"]
    for flash in (["--use-flash-attn"], ["--attention-backend", "flash"]):
        try:
            parse_args(argv + flash, world_size=1, prog="pretrain_gpt.py")
            raise AssertionError("accepted")
        except SystemExit as e:
            assert e.code == 2 and "use --attention-backend fused" in capsys.readouterr().err
    assert parse_args(argv + ["--attention-backend", "fused"], world_size=1).reset_attention_mask
