"""ZeRO-2 vs ZeRO-3 on a RoBERTa MLM (transformers' RobertaForMaskedLM, random weights), with
DeepSpeed's defaults and with the zero block of the report that started megazero (issue 31),
megazero (``megazero.initialize``) and DeepSpeed (``deepspeed.initialize``, when importable:
``make peers`` installs it in /work/peers_venv, whose site-packages is appended to ``sys.path``)
interleaved: each round runs every (system, stage, block) once, in a fresh group of DP forked
gloo ranks, so both systems see the same box load. Per configuration it reports the median
per-iteration time (over rounds, each the median of its measured iterations), collectives issued
per step and bytes handed to them per step per rank (megazero: its own counters; DeepSpeed: its
``comms_logger``), and the peak RSS growth per rank (the largest rank's ``ru_maxrss`` minus its
RSS before the model is built; CPU tensors have no allocator statistics).

    python bench/zero_stage3.py                     # box-sized defaults, 3 rounds
    python bench/zero_stage3.py --rounds 1 --iters 2 --hidden 64 --layers 2   # smoke
    python bench/zero_stage3.py --knobs             # stage 3: each knob of the block alone

The ratio column: ZeRO-3 / ZeRO-2 of the same system and block (with ``--knobs``: / the same
system's stage 3 with the defaults).

One optimizer step per iteration (gradient_accumulation_steps 1), fp32, AdamW (DeepSpeed:
``torch_adam``, its CPU build has no fused Adam), no clipping.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import statistics
import sys
import time
import warnings

import torch

SEED_BLOCK = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
              "reduce_bucket_size": 1, "stage3_prefetch_bucket_size": 1, "stage3_param_persistence_threshold": 1,
              "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
              "stage3_gather_16bit_weights_on_model_save": True}


# --knobs: one knob of the seed's block at a time (the rest at DeepSpeed's defaults)
ONE_KNOB = {"reduce_bucket_size=1": {"reduce_bucket_size": 1}, "prefetch=1": {"stage3_prefetch_bucket_size": 1},
            "persistence=1": {"stage3_param_persistence_threshold": 1}}


def zero_block(stage: int, block: str) -> dict:
    """DeepSpeed's defaults (only the stage given), the seed's block, or one of its knobs."""
    if block == "defaults":
        return {"stage": stage}
    if block in ONE_KNOB:
        return dict(ONE_KNOB[block], stage=stage)
    return dict(SEED_BLOCK, stage=stage)


def ds_config(stage: int, block: str, micro: int, system: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
           "zero_optimization": zero_block(stage, block)}
    if system == "deepspeed":
        cfg["optimizer"]["params"]["torch_adam"] = True
        cfg["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}
    return cfg


def roberta(sizes: dict):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.RobertaConfig(vocab_size=sizes["vocab"], hidden_size=sizes["hidden"],
                                     num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"],
                                     intermediate_size=4 * sizes["hidden"], max_position_embeddings=sizes["seq"] + 4,
                                     type_vocab_size=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.RobertaForMaskedLM(cfg)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _ds_comm_totals() -> tuple[int, int]:
    """(calls, bytes) logged by DeepSpeed's comms_logger since its last reset."""
    import deepspeed.comm as dscomm
    calls = nbytes = 0
    for sizes in dscomm.comms_logger.comms_dict.values():
        for size, record in sizes.items():
            calls += record[0]
            nbytes += record[0] * size
    return calls, nbytes


def _engine(system: str, model, cfg):
    if system == "megazero":
        import megazero
        return megazero.initialize(model=model, config=cfg)[0]
    import deepspeed
    import torch.distributed as dist
    os.environ.update(LOCAL_RANK=str(dist.get_rank()), RANK=str(dist.get_rank()),
                      WORLD_SIZE=str(dist.get_world_size()))  # what its launcher would set (one rank each)
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def worker(rank, world, system, stage, block, sizes, warmup, iters):
    """Build, train ``warmup + iters`` steps, report this rank's figures."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's notes on DeepSpeed's calls
    base = _rss_mb()
    engine = _engine(system, roberta(sizes), ds_config(stage, block, sizes["micro"], system))
    g = torch.Generator().manual_seed(rank)
    times, calls, nbytes = [], 0, 0
    for it in range(warmup + iters):
        ids = torch.randint(4, sizes["vocab"], (sizes["micro"], sizes["seq"]), generator=g)
        labels = torch.where(torch.rand(ids.shape, generator=g) < 0.15, ids, torch.full_like(ids, -100))
        if system == "deepspeed" and it == warmup:
            import deepspeed.comm as dscomm
            dscomm.comms_logger.comms_dict.clear()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        if it >= warmup:
            times.append(time.perf_counter() - t0)
            if system == "megazero":
                comm = engine.zero.last_comm["by_group"].values()
                calls += sum(v["calls"] for v in comm)
                nbytes += sum(v["handed_bytes"] for v in comm)
    if system == "deepspeed":
        calls, nbytes = _ds_comm_totals()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    return {"time": statistics.median(times), "calls": calls / iters, "bytes": nbytes / iters, "peak_mb": peak,
            "loss": loss.item()}


def _deepspeed_available() -> bool:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for site in glob.glob("/work/peers_venv/lib/python3*/site-packages"):
        if site not in sys.path:
            sys.path.append(site)  # after our own packages: only what we lack (deepspeed) comes from there
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument("--json", default=None, help="also write the raw figures here")
    p.add_argument("--knobs", action="store_true", help="stage 3 only: defaults, each knob of the block alone, "
                   "the whole block")
    a = p.parse_args(argv)
    sizes = {"hidden": a.hidden, "layers": a.layers, "heads": max(1, a.hidden // 64), "vocab": a.vocab,
             "seq": a.seq, "micro": a.micro}
    from megazero.testing import run_distributed
    systems = ["megazero"] + ([] if a.no_deepspeed or not _deepspeed_available() else ["deepspeed"])
    blocks, stages = ("defaults", "seed block"), (2, 3)
    if a.knobs:
        blocks, stages = ("defaults", *ONE_KNOB, "seed block"), (3,)
    runs = [(s, stage, block) for block in blocks for stage in stages for s in systems]
    got = {r: [] for r in runs}
    for rnd in range(a.rounds):
        for r in (runs if rnd % 2 == 0 else runs[::-1]):
            ranks = run_distributed(worker, a.dp, *r, sizes, a.warmup, a.iters, timeout_s=1200, collective_timeout_s=600)
            got[r].append({"time": max(x["time"] for x in ranks), "calls": ranks[0]["calls"],
                           "bytes": ranks[0]["bytes"], "peak_mb": max(x["peak_mb"] for x in ranks),
                           "loss": ranks[0]["loss"]})
    n = sum(p.numel() for p in roberta(sizes).parameters())
    print(f"RoBERTa MLM {n / 1e6:.2f}M parameters, DP {a.dp}, micro-batch {a.micro} x seq {a.seq}, fp32, "
          f"{a.rounds} interleaved rounds x {a.iters} iterations (median)")
    print(f"{'system':10} {'zero block':21} {'stage':>5} {'s/iter':>8} {'ratio':>6} {'coll/step':>10} "
          f"{'MB/step':>9} {'peak MB':>8}")
    table = {}
    for (s, stage, block), rows in got.items():
        table[(s, stage, block)] = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
    for (s, stage, block), m in table.items():
        ratio = m["time"] / (table[(s, 3, "defaults")] if a.knobs else table[(s, 2, block)])["time"]
        print(f"{s:10} {block:21} {stage:>5} {m['time']:8.3f} {ratio:6.2f} {m['calls']:10.0f} "
              f"{m['bytes'] / 2 ** 20:9.1f} {m['peak_mb']:8.0f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"sizes": sizes, "dp": a.dp, "params": n,
                       "rows": [dict(system=s, stage=st, block=b, **m) for (s, st, b), m in table.items()]}, f, indent=1)


if __name__ == "__main__":
    main()
