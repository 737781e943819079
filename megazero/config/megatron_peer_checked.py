"""Megatron-LM flags whose meaning here is checked against megatron-core itself (0.16.1) by the
peer suite (``make peers``, tests/peers/test_megatron_*.py): its GPTModel built from these
options writes a checkpoint that megazero imports with Megatron's logits and losses. Every other
row of docs/megatron.md's table rests on reading Megatron-LM's source (the versions named there).
"""
from __future__ import annotations

__all__ = ["PEER_CHECKED", "peer_checked"]

_LOGITS = "megatron-core 0.16.1: logits (tests/peers/test_megatron_checkpoints.py)"
PEER_CHECKED = {name: _LOGITS for name in (
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank", "--num-layers", "--hidden-size", "--num-attention-heads",
    "--ffn-hidden-size", "--kv-channels", "--group-query-attention", "--num-query-groups", "--seq-length",
    "--max-position-embeddings", "--position-embedding-type", "--rotary-base", "--normalization",
    "--norm-epsilon", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--vocab-size",
    "--make-vocab-size-divisible-by", "--tokenizer-type", "--attention-dropout", "--hidden-dropout",
    "--use-cpu-initialization", "--no-persist-layer-norm", "--ckpt-format", "--no-save-optim")}
# found to differ for training (from-megatron follows megatron-core; the training flags do not yet)
PEER_CHECKED.update({
    "--openai-gelu": "megatron-core 0.16.1: DIFFERS for training: mcore ignores it (its GELU is tanh under the "
                     "default --bias-gelu-fusion, exact with --no-bias-gelu-fusion); here it is the legacy "
                     "model's tanh GELU; from-megatron follows mcore",
    "--no-bias-gelu-fusion": "megatron-core 0.16.1: DIFFERS by default: mcore's fused default is tanh GELU, "
                             "megazero's exact (a start-up WARNING says so and names --openai-gelu); "
                             "from-megatron honours it",
})
PEER_CHECKED.update({name: "megatron-core 0.16.1: logits at TP 1/2 x PP 1/2 and AdamW losses "
                           "(tests/peers/test_megatron_qk_window.py)" for name in ("--qk-layernorm", "--window-size")})
PEER_CHECKED.update({"--lr": "megatron-core 0.16.1: AdamW losses (tests/peers/test_megatron_checkpoints.py)",
                     "--data-path": "megatron-core 0.16.1: IndexedDatasetBuilder files "
                                    "(tests/peers/test_megatron_data.py)"})


def peer_checked(name: str) -> str:
    """The table cell: what checked the flag against the real library, or that nothing did."""
    return PEER_CHECKED.get(name, "no (source read)")
