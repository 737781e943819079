#!/bin/bash
# Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh (core_v0.19.0), flag for flag, with the
# sizes shrunk to a CPU run, its MOCK data branch, and DTYPE bf16 instead of fp8 (fp8 needs a GPU):
#   bash examples/megatron/train_llama3_8b.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH [TRAIN_SAMPLES]
# Every flag is accepted (docs/megatron.md: honoured, or named once as having no effect here).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
CHECKPOINT_PATH=${1:-"checkpoints/llama3_8b"}
TENSORBOARD_LOGS_PATH=${2:-"tensorboard_logs/llama3_8b"}
TRAIN_SAMPLES=${3:-48}
GPUS_PER_NODE=${GPUS_PER_NODE:-2}
TP_SIZE=1
CP_SIZE=${CP_SIZE:-1}
MICRO_BATCH_SIZE=1
GLOBAL_BATCH_SIZE=8
NUM_LAYERS=2
DTYPE="bf16"
SEQ_LENGTH=64
MAX_POSITION_EMBEDDINGS=64
DATA_CACHE_PATH="${DATA_CACHE_PATH:-$(dirname "$CHECKPOINT_PATH")/benchmark_cache_llama3_8b}"
mkdir -p "$DATA_CACHE_PATH"

DISTRIBUTED_ARGS=(--standalone --nproc_per_node "$GPUS_PER_NODE")
MODEL_ARGS=(
    --use-mcore-models
    --num-layers $NUM_LAYERS
    --hidden-size 64
    --ffn-hidden-size 224
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --kv-channels 16
    --seq-length $SEQ_LENGTH
    --max-position-embeddings $MAX_POSITION_EMBEDDINGS
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --normalization RMSNorm
    --init-method-std 0.0134
    --attention-backend fused
    --apply-layernorm-1p
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)
TRAINING_ARGS=(
    --micro-batch-size $MICRO_BATCH_SIZE
    --global-batch-size $GLOBAL_BATCH_SIZE
    --train-samples "$TRAIN_SAMPLES"
    --lr-decay-samples 40
    --lr-warmup-samples 16
    --lr 0.00015
    --min-lr 0.00001
    --decoupled-lr 5.0e-4
    --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --grad-reduce-in-bf16
    --cross-entropy-loss-fusion
    --calculate-per-token-loss
    --manual-gc
    --empty-unused-memory-level 1
    --exit-duration-in-mins 235
)
DTYPE_ARGS=()
if [[ "$DTYPE" == "fp8" ]]; then
    DTYPE_ARGS+=("--fp8-format hybrid" "--fp8-amax-history-len 1024" "--fp8-amax-compute-algo max" "--fp8-param-gather")
fi
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP_SIZE
    --context-parallel-size $CP_SIZE
    --sequence-parallel
)
TRAINING_ARGS+=(--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)
# the original's MOCK branch: its entries are word-split unquoted, so --split's quotes reach argv
DATA_ARGS_LIST=(
    "--mock-data"
    "--tokenizer-type NullTokenizer"
    "--vocab-size 512"
    "--data-cache-path ${DATA_CACHE_PATH}"
    "--tiktoken-pattern v2"
    "--split '99,1,0'"
    "--no-create-attention-mask-in-dataloader"
    "--no-mmap-bin-files"
    "--num-workers 1"
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --eval-iters 1
    --eval-interval 100
    --save-interval 1000
    --log-throughput
    --profile
    --profile-step-start 4
    --profile-step-end 6
    --ckpt-format torch_dist
    --distributed-timeout-minutes 60
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)
ALL=(${MODEL_ARGS[@]} ${TRAINING_ARGS[@]} ${DTYPE_ARGS[@]} ${MODEL_PARALLEL_ARGS[@]} ${DATA_ARGS_LIST[@]} ${EVAL_AND_LOGGING_ARGS[@]})

# no cd: the caller's relative paths (checkpoints, logs, data) stay relative to where it runs
"$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt.py" "${ALL[@]}"
