"""Pretrain a GPT with tensor, pipeline (interleaved) and ZeRO data parallelism.

    torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 ...
"""

import sys

from megazero.arguments import parse_args


def main(argv=None) -> int:
    args = parse_args(argv, prog="pretrain_gpt.py")
    from megazero.training import pretrain
    return pretrain(args)


if __name__ == "__main__":
    sys.exit(main())
