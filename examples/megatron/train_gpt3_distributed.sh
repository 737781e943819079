#!/bin/bash
# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh (core_v0.19.0), flag for flag, with the
# sizes shrunk to a CPU run and the data at --mock-data (the original reads a GPT-2 BPE corpus):
#   bash examples/megatron/train_gpt3_distributed.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH [TRAIN_ITERS]
# Run it twice with the same CHECKPOINT_PATH: the first run starts from scratch (its --load folder
# does not exist yet), the second resumes from it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
GPUS_PER_NODE=${GPUS_PER_NODE:-2}
CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
TRAIN_ITERS=${3:-6}

DISTRIBUTED_ARGS=(--standalone --nproc_per_node "$GPUS_PER_NODE")
GPT_MODEL_ARGS=(
    --num-layers 4
    --hidden-size 64
    --num-attention-heads 4
    --seq-length 64
    --max-position-embeddings 64
    --attention-backend auto
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 8
    --step-batch-size-schedule "0:4 2.4B:6 12B:8"
    --train-iters "$TRAIN_ITERS"
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --lr 6.0e-5
    --lr-decay-style cosine
    --min-lr 6.0e-6
    --lr-warmup-fraction .001
    --lr-decay-iters 5
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 2
)
DATA_ARGS=(
    --mock-data
    --vocab-size 256
    --split 949,50,1
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --save-interval 2
    --eval-interval 2
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --eval-iters 1
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

# no cd: the caller's relative paths (checkpoints, logs, data) stay relative to where it runs
"$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt.py" \
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}"
