#!/bin/bash
# Qwen3 pretraining with Megatron-LM's flag names (the model flags of a Qwen3-8B run: RoPE base 1e6,
# RMSNorm eps 1e-6, SwiGLU, GQA, --kv-channels 128 decoupled from the hidden size, no biases,
# untied head, and --qk-layernorm: Qwen3's per-head q_norm / k_norm), sizes shrunk to a CPU run
# (36 layers x 4096 -> 4 x 64, 32 heads / 8 groups -> 4 / 2, head size 128 -> 32, vocabulary
# 151936 -> 256, mock data) at TP 2 with sequence parallelism x DP 2 and the distributed
# optimizer, 4 ranks on one node:
#   bash examples/qwen3/train_qwen3.sh CHECKPOINT_PATH [TRAIN_ITERS]
# Run it twice with the same CHECKPOINT_PATH: the first run starts from scratch, the second
# resumes (weights, optimizer, RNG) from the checkpoint saved at its end and goes on.
# WINDOW_SIZE=L adds --window-size L,0 (a sliding window of L + 1 keys, Mistral-style);
# CP_SIZE=2 splits each sequence over two ranks (TP 2 x CP 2, DP 1).
# A Hugging Face Qwen3 folder converts with tools/convert_checkpoint.py from-hf (docs/model.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
CHECKPOINT_PATH=$1
TRAIN_ITERS=${2:-4}
CP_SIZE=${CP_SIZE:-1}

DISTRIBUTED_ARGS=(--standalone --nproc_per_node "$GPUS_PER_NODE")
MODEL_ARGS=(
    --num-layers 4
    --hidden-size 64
    --ffn-hidden-size 192
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --kv-channels 32
    --qk-layernorm
    --seq-length 64
    --max-position-embeddings 64
    --position-embedding-type rope
    --rotary-base 1000000
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.02
)
if [ -n "${WINDOW_SIZE:-}" ]; then
    MODEL_ARGS+=(--window-size "${WINDOW_SIZE},0")
fi
DATA_ARGS=(
    --mock-data
    --vocab-size 256
    --tokenizer-type NullTokenizer
    --split 99990,8,2
)
TRAINING_ARGS=(
    --micro-batch-size 2
    --global-batch-size 8
    --train-iters "$TRAIN_ITERS"
    --lr 3e-4
    --min-lr 3e-5
    --lr-decay-style cosine
    --lr-decay-iters 8
    --lr-warmup-iters 1
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --bf16
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --sequence-parallel
    --context-parallel-size "$CP_SIZE"
    --use-distributed-optimizer
)
LOGGING_ARGS=(
    --log-interval 1
    --save-interval 1000
    --eval-interval 1000
    --eval-iters 0
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
)

# no cd: the caller's relative paths stay relative to where it runs
"$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}"
