"""Behind the door (:mod:`megazero.arguments`): everything that comes from the command line and
config files, and the typed configs the rest of megazero reads instead of the namespace.

* :mod:`.flags` -- the flags by Megatron's argument groups (:mod:`.moe_flags`: Mixture of Experts
  and expert parallelism, with their checks); :mod:`.megatron_flags` with
  ``megatron_flags.tsv`` -- every other flag of Megatron-LM's parser, honoured, accepted with no
  effect, or refused;
* :mod:`.deepspeed_config` (:mod:`.deepspeed_keys`, :mod:`.deepspeed_optim`) -- a DeepSpeed JSON
  config read as DeepSpeed reads it, merged into the flags;
* :mod:`.checks`, :mod:`.run_checks`, :mod:`.path_checks` -- validation (every problem in one
  line, before any process group) and the derived values; :mod:`.failures` -- how a failed run
  reports itself;
* :mod:`.configs` -- the frozen configs (:class:`RunConfig` and one per concern), built by
  :func:`.run_config.run_config`; :mod:`.batch_schedule`, :mod:`.optimizer`, :mod:`.model`.

It imports the model's config and arithmetic (:mod:`megazero.model.config`,
:mod:`megazero.moe.config`, :mod:`megazero.planner.memory`), the data package's tokenizer
config and split parser, :mod:`megazero.parallel.launch`'s rank and
:func:`megazero.parallel.topology.layout` (the expert grid's divisibility, checked without a
process group); never training, checkpoint or planner code.
"""
