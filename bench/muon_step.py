"""Muon vs AdamW optimizer step on the CPU (issue 44): the demo model of examples/train_demo_cpu.sh
(4 layers, hidden 128, 4 heads, seq 128, vocabulary 4096), fp32, one process (ZeRO 0) and DP 2
(ZeRO 1: the Muon matrices dealt to owner ranks); random gradients written into the flat
gradient shards, the median of REPS ``step()`` calls; the optimizer-state bytes per rank
(fp32 master and moments as allocated: Muon keeps no second moment on its matrices);
``muon`` runs Newton-Schulz in bf16 (Megatron's default), ``muon-fp32`` in fp32.

    PYTHONPATH=. .venv/bin/python bench/muon_step.py [REPS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from megazero.testing import run_distributed

CFG = dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, max_position_embeddings=128,
           attention_dropout=0.0, hidden_dropout=0.0, vocab_size=4096, make_vocab_size_divisible_by=128)


def worker(rank, world, optimizer, reps):
    from megazero.model import GPTConfig
    from megazero.model.stages import gpt_stages
    from megazero.optim.muon import MuonSettings
    from megazero.parallel.topology import Topology
    from megazero.training.muon_setup import muon_matrices
    from megazero.zero import ZeroOptimizer
    topo = Topology(world, rank).create_groups()
    stages = gpt_stages(GPTConfig(**CFG), topo, 4)
    opt = ZeroOptimizer(stages.chunks, topo, stage=0 if world == 1 else 1, lr=1e-3, weight_decay=0.1,
                        shared_params=stages.shared_params)
    muon_elems = 0
    if optimizer.startswith("muon"):
        settings = MuonSettings(momentum=0.9, nesterov=False, flavour="megatron", coefficient_type="quintic",
                                scale_mode="spectral", split_qkv=True,
                                ns_dtype=torch.float32 if optimizer.endswith("fp32") else torch.bfloat16)
        matrices = muon_matrices(stages, topo, True)
        opt.set_muon(settings, matrices)
        muon_elems = sum(p.numel() for p in matrices)
    times = []
    for _ in range(reps):
        for r in opt.regions:
            r.grad_shard.normal_()
        t0 = time.perf_counter()
        assert opt.step()[0]
        times.append(time.perf_counter() - t0)
    sb = opt.state_bytes()
    return {"ms": 1e3 * statistics.median(times), "master": sb["master"], "moments": sb["moments"],
            "phi": opt.phi, "muon_elems": muon_elems}


def main():
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    print(f"{'layout':7} {'optimizer':10} {'step ms':>8} {'master B/rank':>14} {'moments B/rank':>15} {'total':>11}")
    for world in (1, 2):
        for optimizer in ("adam", "muon", "muon-fp32"):
            res = run_distributed(worker, world, optimizer, reps, timeout_s=600)
            r = res[0]
            print(f"{'DP' + str(world):7} {optimizer:10} {max(x['ms'] for x in res):8.1f} {r['master']:14,d} "
                  f"{r['moments']:15,d} {r['master'] + r['moments']:11,d}   (rank 0; phi {r['phi']:,}, "
                  f"Muon elements {r['muon_elems']:,})", flush=True)


if __name__ == "__main__":
    main()
