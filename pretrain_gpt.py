"""Pretrain a GPT with tensor, pipeline (interleaved) and ZeRO data parallelism.

    torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 ...

Thin on purpose, as in Megatron-LM: the model provider and the forward step are chosen here and
everything else (the build order, distributed start-up, topology, data, schedule, ZeRO optimizer,
checkpoints, logs) is ``megazero.training``. Another model plugs in by passing its own two
functions: a provider returning :class:`megazero.model.stages.ModelStages` (this rank's pipeline
chunks, the activation shape, tied parameters, RNG states) and a forward step
(tests/test_non_gpt_model.py trains such a model through the same loop).
"""

import sys

from megazero.arguments import parse_args


def model_provider(model_config, topo, micro_batch_size, device=None):
    """This rank's GPT chunks: layers split over PP x VP in Megatron's interleaved order
    (``device="meta"`` under ZeRO-3: ZeRO materializes them unit by unit into its shards)."""
    from megazero.model.stages import gpt_stages
    return gpt_stages(model_config, topo, micro_batch_size, device=device)


def main(argv=None) -> int:
    from megazero.config.failures import warnings_as_lines
    from megazero.config.path_checks import check_free_space  # room for one checkpoint at --save
    from megazero.config.rank import current_rank
    from megazero.checkpoint.torch_dist import saved_args  # --use-checkpoint-args of a Megatron torch_dist folder
    with warnings_as_lines(current_rank()):  # one WARNING line per job, not one per rank
        args = parse_args(argv, prog="pretrain_gpt.py", training=True, checks=(check_free_space,),
                          read_saved=saved_args)
    from megazero.model.stages import gpt_forward_step  # loss = sum(loss * loss_mask) / sum(loss_mask)
    from megazero.training import pretrain
    return pretrain(args, model_provider=model_provider, forward_step_func=gpt_forward_step)


if __name__ == "__main__":
    sys.exit(main())
