"""``bench/context_parallel.py --process``: what a user measures, the whole ``pretrain_gpt.py``
process per rank under torchrun (its ``PROCESS_FLAGS`` model), peak RSS and CPU seconds, at each
``--seq`` minus the same layout at ``--base-seq``; medians of ``--repeat`` interleaved runs (see
that script's docstring and docs/benchmarks.md, "Context parallelism in whole processes")."""

from __future__ import annotations

import collections
import json
import os
import statistics

from rss import torchrun_peaks

MB = 2 ** 20


def ratio_text(a, b) -> str:
    return f"{a / b:.2f}" if b else "-"


PROCESS_FLAGS = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
                 "--position-embedding-type rope --swiglu --attention-dropout 0.0 --hidden-dropout 0.0 "
                 "--micro-batch-size 1 --global-batch-size 1 --train-iters 2 --lr 1e-4 --mock-data --vocab-size 512 "
                 "--distributed-backend gloo --log-interval 1 --eval-iters 0 --eval-interval 1000").split()


def process_mode(o, root: str) -> int:
    """The whole-process figure: per rank, the median peak at each ``--seq`` minus the median peak
    of the same layout at ``--base-seq``; the worst rank's; CPU: all ranks' seconds, the same way."""
    import tempfile
    runs = collections.defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(o.repeat):  # interleaved, so the box's load drifts over every configuration alike
            for cp in o.cp:
                for seq in (o.base_seq, *o.seq):
                    flags = PROCESS_FLAGS + ["--seq-length", str(seq), "--max-position-embeddings", str(seq),
                                             "--context-parallel-size", str(cp), "--cp-comm-type", o.comm[0]]
                    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
                    prefix = os.path.join(tmp, f"{i}-{cp}-{seq}")
                    runs[cp, seq].append(torchrun_peaks("pretrain_gpt.py", flags, cp, prefix, root, env))
    med = lambda cp, seq, key, r: statistics.median(run[r][key] for run in runs[cp, seq])  # noqa: E731
    rows = []
    for seq in o.seq:
        for cp in o.cp:
            deltas = [med(cp, seq, "peak", r) - med(cp, o.base_seq, "peak", r) for r in range(cp)]
            cpu = [sum(run[r]["cpu"] for r in range(cp)) for run in runs[cp, seq]]
            cpu0 = [sum(run[r]["cpu"] for r in range(cp)) for run in runs[cp, o.base_seq]]
            rows.append({"seq": seq, "cp": cp, "delta": max(deltas), "deltas": deltas,
                         "cpu_added": statistics.median(cpu) - statistics.median(cpu0),
                         "peaks": [[r["peak"] for r in run] for run in runs[cp, seq]]})
            print(json.dumps(dict(rows[-1], kind="process")), flush=True)
    print("| seq | CP | peak RSS added, worst rank MiB | / CP 1 | every rank MiB | CPU s added, all ranks | / CP 1 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        b = next(x for x in rows if x["seq"] == r["seq"] and x["cp"] == 1)
        print(f"| {r['seq']} | {r['cp']} | {r['delta'] / MB:.0f} | {ratio_text(r['delta'], b['delta'])} | "
              f"{' / '.join(f'{d / MB:.0f}' for d in r['deltas'])} | {r['cpu_added']:.1f} | "
              f"{ratio_text(r['cpu_added'], b['cpu_added'])} |")
        if r["cp"] == max(o.cp) > 1:
            ratio = r["delta"] / b["delta"]
            print(f"target seq {r['seq']} CP {r['cp']} process peak: {ratio:.2f} x CP 1 (target <= {o.target}): "
                  f"{'met' if ratio <= o.target else 'not met'}")
    return 0
