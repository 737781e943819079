"""ZeRO stages 0-3 composed with the real GPTModel under TP = 2, PP = 2 (1F1B and interleaved)
and TP x PP x DP = 2 x 2 x 2, built from the flags (OptimizerConfig) and gpt_stages exactly as training does;
compared with single-process torch.optim.AdamW.  Adam eps 1e-6 and lr 1e-3 here: with eps 1e-8
and lr 1e-2 Adam's normalization turns last-bit differences of near-zero gradient entries (TP/PP
change the model's summation order, whatever the ZeRO stage; all stages err identically) into
1e-4 parameter differences (the attention key bias has an exactly-zero true gradient)."""

import torch

from megazero.parallel.topology import Topology

from .common import launch
from .gpt_helpers import args_for, compare, gpt_batches, gpt_reference, gpt_train

M, STEPS, CLIP, EPS, LR = 4, 5, 0.05, 1e-6, 1e-3


def _run(rank, world, layouts, data):
    out = []
    for tp, pp, vp in layouts:
        topo = Topology(world, rank, tp=tp, pp=pp, vp=vp).create_groups()
        for stage in (0, 1, 2, 3):
            full, mult = gpt_train(topo, data[topo.dp], args_for(stage, M, clip_grad=CLIP, adam_eps=EPS, lr=LR))
            out.append(((tp, pp, vp, stage), full, mult))
    return out


def _check(results, data):
    refs = {}
    for rank, res in enumerate(results):
        for (tp, pp, vp, stage), full, mult in res:
            dp = len(results) // (tp * pp)
            if dp not in refs:
                refs[dp] = gpt_reference(data[dp], clip=CLIP, eps=EPS, lr=LR)
            err = compare(full, refs[dp])
            assert err <= 1e-5, f"rank {rank} tp{tp} pp{pp} vp{vp} stage {stage}: {err:.2e}"
            if dp > 1 and stage in (0, 1):
                assert mult == 2.0


def test_gpt_tp2_pp2_interleaved_four_ranks():
    data = {d: gpt_batches(STEPS, d, M) for d in (1, 2)}
    _check(launch(_run, 4, [(2, 1, 1), (1, 2, 1), (1, 2, 2), (2, 2, 1)], data), data)


def test_gpt_3d_eight_ranks():
    data = {2: gpt_batches(STEPS, 2, M)}
    _check(launch(_run, 8, [(2, 2, 1)], data), data)
