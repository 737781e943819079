"""megazero: 3D-parallel GPT pretraining (tensor, interleaved pipeline and ZeRO 0-3 data
parallelism) over one explicit process-group topology. See README.md and docs/."""

__version__ = "0.1.0"
