"""Checkpoints: the on-disk format (:mod:`.schema`), crash-safe files (:mod:`.files`), saving and
loading a run (:mod:`.api`), the layout-free reader (:mod:`.reader`), resharding (:mod:`.reshard`)
and the saved RNG state (:mod:`.rng`)."""

from megazero.checkpoint.schema import CheckpointError  # noqa: F401
