"""Checkpoints, every format in one home: megazero's own (the one the trainer writes: the on-disk
format :mod:`.schema`, crash-safe files :mod:`.files`, saving and loading a run :mod:`.api`, the
layout-free reader :mod:`.reader`, resharding :mod:`.reshard`, the saved RNG state :mod:`.rng`),
the engine's (:mod:`.engine`, ``megazero.initialize``'s ``save_checkpoint``/``load_checkpoint``,
and its consolidation :mod:`.zero_to_fp32`), and the converters from and to other tools' files
(:mod:`.convert`: Hugging Face, Megatron-LM)."""

from megazero.checkpoint.schema import CheckpointError  # noqa: F401
