"""ZeRO-3 under zero-bubble plans: per rank, the most parameter elements gathered at once during a
step (the gatherer's count, ``ParamGatherer.peak_live``, which the regions' storage matches), beside
1F1B's, on a small GPT at PP 2 (DP 2) and PP 4 (DP 1) over 4 forked gloo ranks. An element count,
not a time: the machine's load does not change it.

    python bench/zero3_gathered.py                  # PP 2 and 4; 1f1b, zb-h1, zbv; no prefetch
    python bench/zero3_gathered.py --prefetch 20000 # with ZeRO-3 prefetch (elements)

Per rank: ``shard`` = the elements it keeps whatever happens (its shards of the partitioned units,
the persistent parameters whole); ``root+layer`` = its largest chunk's root unit (embedding; final
norm and output layer) plus its largest layer unit, what a backward needs at once; ``peak`` = the
most gathered at once in the second step (the first records the order; prefetch starts then).
"""

from __future__ import annotations

import argparse
import json

import torch

SEQ, MB = 16, 2
CFG = dict(num_layers=8, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=SEQ,
           max_position_embeddings=SEQ, attention_dropout=0.0, hidden_dropout=0.0, make_vocab_size_divisible_by=4,
           position_embedding_type="rope", swiglu=True, normalization="RMSNorm", add_bias_linear=False,
           untie_embeddings_and_output_weights=True, params_dtype=torch.float32)
VOCAB = 512
VP = {"1f1b": 1, "zb-h1": 1, "zbv": 2, "interleaved-zb": 2, "dualpipev": 2}


def _root_plus_layer(units) -> int:
    out = 0
    for c in {u.chunk for u in units}:
        mine = [u for u in units if u.chunk == c]
        root = sum(u.region.padded for u in mine if u.root)
        out = max(out, root + max((u.region.padded for u in mine if not u.root), default=0))
    return out


def bench(rank, world, pp, schedule, prefetch):
    from megazero.model.config import GPTConfig
    from megazero.model.stages import gpt_stages
    from megazero.parallel.topology import Topology
    from megazero.pipeline import PipelineRunner
    from megazero.zero import ZeroOptimizer
    m = 2 * pp
    topo = Topology(world, rank, pp=pp, vp=VP[schedule],
                    pipeline_schedule=None if schedule == "1f1b" else schedule).create_groups()
    stages = gpt_stages(GPTConfig.from_megatron(CFG, vocab_size=VOCAB), topo, MB)
    opt = ZeroOptimizer(stages.chunks, topo, stage=3, num_micro_batches=m, lr=1e-3,
                        prefetch_bucket_size=prefetch, param_persistence_threshold=0, max_reuse_distance=0,
                        shared_params=stages.shared_params, tp_duplicated_params=stages.tp_duplicated_params)
    runner = PipelineRunner(topo, m, stages.activation_shape, stages.activation_dtype)
    g = torch.Generator().manual_seed(5 + topo.dp_rank)
    for _ in range(2):
        opt.gatherer.peak_live = 0
        batches = [{"tokens": torch.randint(0, VOCAB, (MB, SEQ), generator=g),
                    "labels": torch.randint(0, VOCAB, (MB, SEQ), generator=g)} for _ in range(m)]
        runner.run(stages.chunks, batches, stages.forward_step, grad_scale=opt.loss_scale,
                   weight_grad_stores=stages.weight_grad_stores)
        opt.step()
    shard = sum(r.shard_len if r.partitioned else r.padded for r in opt.regions)
    return {"pp_rank": topo.pp_rank, "dp_rank": topo.dp_rank, "peak": opt.gatherer.peak_live, "shard": shard,
            "root+layer": _root_plus_layer(opt.gatherer.units)}


def main() -> None:
    from megazero.testing import run_distributed
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--schedules", nargs="+", default=["1f1b", "zb-h1", "zbv"], choices=list(VP))
    p.add_argument("--prefetch", type=int, default=0, help="ZeRO-3 prefetch bucket (elements)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    rows = []
    for pp in a.pp:
        for schedule in a.schedules:
            for r in run_distributed(bench, 4, pp, schedule, a.prefetch, timeout_s=300):
                rows.append(dict(pp=pp, schedule=schedule, **r))
    if a.json:
        print(json.dumps(rows))
        return
    print("| PP | schedule | pp rank | shard | root+layer | peak gathered |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["dp_rank"] == 0:
            print(f"| {r['pp']} | {r['schedule']} | {r['pp_rank']} | {r['shard']} | {r['root+layer']} | {r['peak']} |")


if __name__ == "__main__":
    main()
