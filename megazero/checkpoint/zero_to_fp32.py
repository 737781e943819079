"""Consolidate an engine checkpoint into one fp32 state dict (DeepSpeed's ``zero_to_fp32.py``).

    python -m megazero.checkpoint.zero_to_fp32 CHECKPOINT_DIR OUTPUT_FILE [--tag TAG]

Reads every rank's shards (any DP size, any ZeRO stage) in one process on the CPU and writes
``torch.save`` of ``{name: fp32 tensor}`` (tied parameters under each of their names, and the
persistent buffers), which the model's ``load_state_dict`` takes (a Hugging Face model: then
``save_pretrained``). Needs memory for the fp32 model once.
"""

from __future__ import annotations

import argparse
import sys

import torch

from .engine import consolidated_state_dict


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megazero.checkpoint.zero_to_fp32", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint_dir", help="the folder given to engine.save_checkpoint")
    p.add_argument("output_file")
    p.add_argument("--tag", default=None, help="default: the tag in CHECKPOINT_DIR/latest")
    a = p.parse_args(argv)
    try:
        state = consolidated_state_dict(a.checkpoint_dir, a.tag)
    except (FileNotFoundError, ValueError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    torch.save(state, a.output_file)
    n = sum(v.numel() for k, v in state.items() if v.is_floating_point())
    print(f"wrote {a.output_file}: {len(state)} tensors, {n / 1e6:.2f}M fp32 values")
    return 0


if __name__ == "__main__":
    sys.exit(main())
