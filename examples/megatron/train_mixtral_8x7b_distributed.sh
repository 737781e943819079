#!/bin/bash
# Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh (core_v0.20.0), flag for flag,
# with the sizes shrunk to a CPU run (32 layers x 4096 -> 4 x 64, PP 4 x EP 8 -> PP 2 x EP 2 on 4
# ranks, 500000 iterations -> TRAIN_ITERS) and the data at --mock-data instead of a Llama-2
# tokenizer and corpus; launched --standalone on one node:
#   bash examples/megatron/train_mixtral_8x7b_distributed.sh CHECKPOINT_PATH [TRAIN_ITERS]
# Run it twice with the same CHECKPOINT_PATH: the first run starts from scratch, the second loads
# the weights saved at its end (--no-load-optim --no-load-rng, as the original) and goes on.
# GPUS_PER_NODE=8 runs PP 2 x EP 2 on 8 ranks (DP 4).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
CHECKPOINT_PATH=$1
TRAIN_ITERS=${2:-4}

DISTRIBUTED_ARGS=(--standalone --nproc_per_node "$GPUS_PER_NODE")
MODEL_ARGS=(
    --use-mcore-models
    --disable-bias-linear
    --seq-length 64
    --max-position-embeddings 512
    --num-layers 4
    --hidden-size 64
    --ffn-hidden-size 224
    --num-attention-heads 4
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups 2
    --no-masked-softmax-fusion
    --no-position-embedding
    --rotary-base 1000000
)
MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
)
DATA_ARGS=(
    --mock-data
    --vocab-size 256
    --split 99990,8,2
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 8
    --lr 1e-4
    --train-iters "$TRAIN_ITERS"
    --lr-decay-iters 3
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters 1
    --clip-grad 1.0
    --bf16
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 2
    --expert-model-parallel-size 2
    --use-distributed-optimizer
    --sequence-parallel
)
LOGGING_ARGS=(
    --log-interval 1
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 10
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard"
    --no-load-optim
    --no-load-rng
)
if [ -n "${WANDB_API_KEY:-}" ]; then
    LOGGING_ARGS+=(
        --wandb-project "${WANDB_PROJECT:-Mixtral}"
        --wandb-exp-name "${WANDB_NAME:-Mixtral_8x7B}"
    )
fi

# no cd: the caller's relative paths (checkpoints, logs, data) stay relative to where it runs
"$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}"
