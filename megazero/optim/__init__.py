"""The optimizer math and the learning-rate schedules, shared by the trainer and the engine:
AdamW on flat shards (:mod:`.adamw`, called by :mod:`megazero.zero` on each rank's shard),
Megatron's and DeepSpeed's LR schedules (:mod:`.lr_schedule`) and the DeepSpeed schedule over
user param groups (:mod:`.group_schedule`). ZeRO owns where state lives; this owns the math."""
