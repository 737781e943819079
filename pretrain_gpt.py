"""Pretrain a GPT with tensor, pipeline (interleaved) and ZeRO data parallelism.

    torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 ...

Thin on purpose, as in Megatron-LM: the model provider and the forward step are defined here and
everything else (distributed start-up, topology, data, schedule, ZeRO optimizer, checkpoints,
logs) is ``megazero.training.pretrain``. Another model plugs in by changing these two functions.
"""

import sys

from megazero.arguments import parse_args


def model_provider(args, topo):
    """This rank's GPT chunks: layers split over PP x VP in Megatron's interleaved order."""
    from megazero.model import GPTConfig
    from megazero.pipeline import build_model_chunks
    return build_model_chunks(GPTConfig.from_args(args), topo)


def forward_step(chunk, micro_batch, input_tensor):
    """Run one chunk on one micro-batch: hidden states for the next stage, or on the last stage
    the language-model loss ``sum(loss * loss_mask) / sum(loss_mask)``."""
    x = micro_batch["tokens"] if input_tensor is None else input_tensor
    if not chunk.post_process:
        return chunk(x, position_ids=micro_batch["position_ids"])
    losses = chunk(x, position_ids=micro_batch["position_ids"], labels=micro_batch["labels"])
    mask = micro_batch["loss_mask"].to(losses.dtype)
    return (losses * mask).sum() / mask.sum()


def main(argv=None) -> int:
    args = parse_args(argv, prog="pretrain_gpt.py")
    from megazero.training import pretrain
    return pretrain(args, model_provider=model_provider, forward_step_func=forward_step)


if __name__ == "__main__":
    sys.exit(main())
