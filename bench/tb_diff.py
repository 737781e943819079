"""Compare two runs' TensorBoard scalars and log lines, field by field (a refactor's check).

    python bench/tb_diff.py RUN_A/tensorboard RUN_B/tensorboard [--log-a A.log --log-b B.log]

Prints, for every scalar tag both runs wrote, the number of steps compared and the largest
absolute difference; timing tags (``iteration-time``, ``throughput``) and the ``arguments`` text
are skipped. With the two logs, also the Megatron log lines' fields (``lm loss``, ``grad norm``,
``learning rate``, ``loss scale``, ``global batch size``, skipped/nan counts) by iteration. Exits 1
when any compared value differs.
"""

from __future__ import annotations

import argparse
import re
import sys

TIMING = ("iteration-time", "throughput", "mem-")
FIELDS = ("consumed samples", "learning rate", "global batch size", "lm loss", "loss scale", "grad norm",
          "number of skipped iterations", "number of nan iterations")


def scalars(path: str) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of every scalar event under ``path``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def log_fields(path: str) -> dict[int, dict[str, str]]:
    """``{iteration: {field: text}}`` of Megatron's iteration lines in a log."""
    out = {}
    for line in open(path, errors="replace"):
        m = re.search(r"iteration\s+(\d+)/\s*\d+ \|(.*)", line)
        if m:
            parts = dict(p.strip().rsplit(":", 1) for p in m.group(2).split("|") if ":" in p)
            out[int(m.group(1))] = {k.strip(): v.strip() for k, v in parts.items() if k.strip() in FIELDS}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--log-a")
    p.add_argument("--log-b")
    opts = p.parse_args(argv)
    sa, sb = scalars(opts.a), scalars(opts.b)
    differ = False
    for tag in sorted(set(sa) | set(sb)):
        if tag.startswith(TIMING) or " vs samples" in tag and tag.split(" vs ")[0].startswith(TIMING):
            continue
        if tag not in sa or tag not in sb:
            print(f"{tag}: only in {'a' if tag in sa else 'b'}")
            differ = True
            continue
        steps = sorted(set(sa[tag]) & set(sb[tag]))
        worst = max((abs(sa[tag][s] - sb[tag][s]) for s in steps), default=0.0)
        differ |= worst != 0.0 or set(sa[tag]) != set(sb[tag])
        print(f"{tag}: {len(steps)} steps, max |a - b| = {worst:.3e}")
    if opts.log_a and opts.log_b:
        la, lb = log_fields(opts.log_a), log_fields(opts.log_b)
        for it in sorted(set(la) | set(lb)):
            same = la.get(it) == lb.get(it)
            differ |= not same
            print(f"log iteration {it}: {'identical fields' if same else f'{la.get(it)} vs {lb.get(it)}'}")
    print("RESULT: " + ("differ" if differ else "identical"))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
