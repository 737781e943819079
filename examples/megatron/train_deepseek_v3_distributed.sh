#!/bin/bash
# A DeepSeek-V3-style MoE with multi-token prediction, under the flag names of Megatron-LM's
# DeepSeek-V3 recipe (megatron-core 0.16.1 TransformerConfig / arguments: --moe-router-score-function
# sigmoid, --moe-router-enable-expert-bias, --moe-router-num-groups / --moe-router-group-topk,
# --moe-router-topk-scaling-factor, --moe-shared-expert-intermediate-size, --moe-layer-freq with the
# first layer dense, --mtp-num-layers, --mtp-loss-scaling-factor), sizes shrunk to a CPU run:
# 4 layers x 64 (layer 0 dense), 8 experts in 4 groups, top-4 within 2 groups, one MTP layer,
# TP 2 (SP) x EP 2 x PP 2 on 8 ranks (DP 2). Multi-latent attention with DeepSeek-V3's flags
# (--multi-latent-attention, --q-lora-rank, --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim,
# --v-head-dim, YaRN --rotary-scaling-factor / --mscale / --mscale-all-dim), ranks shrunk.
# --mock-data instead of a tokenizer and corpus.
#   bash examples/megatron/train_deepseek_v3_distributed.sh CHECKPOINT_PATH [TRAIN_ITERS]
# Run it twice with the same CHECKPOINT_PATH: the second run resumes (optimizer, RNG, expert bias)
# at the iteration the first one saved.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CHECKPOINT_PATH=$1
TRAIN_ITERS=${2:-3}

DISTRIBUTED_ARGS=(--standalone --nproc_per_node "$GPUS_PER_NODE")
MODEL_ARGS=(
    --disable-bias-linear
    --seq-length 32
    --max-position-embeddings 32
    --num-layers 4
    --hidden-size 64
    --ffn-hidden-size 96
    --num-attention-heads 4
    --multi-latent-attention
    --qk-layernorm
    --q-lora-rank 32
    --kv-lora-rank 16
    --qk-head-dim 16
    --qk-pos-emb-head-dim 8
    --v-head-dim 16
    --rope-type yarn
    --rotary-scaling-factor 4
    --mscale 1.0
    --mscale-all-dim 1.0
    --init-method-std 0.02
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --position-embedding-type rope
    --rotary-base 10000
    --swiglu
    --untie-embeddings-and-output-weights
    --no-masked-softmax-fusion
)
MOE_ARGS=(
    --num-experts 8
    --moe-layer-freq "([0]*1+[1]*3)"
    --moe-ffn-hidden-size 32
    --moe-shared-expert-intermediate-size 32
    --moe-router-topk 4
    --moe-router-num-groups 4
    --moe-router-group-topk 2
    --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3
    --moe-router-topk-scaling-factor 2.5
    --moe-router-dtype fp32
    --moe-router-load-balancing-type seq_aux_loss
    --moe-aux-loss-coeff 1e-4
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
)
MTP_ARGS=(
    --mtp-num-layers 1
    --mtp-loss-scaling-factor 0.1
)
DATA_ARGS=(
    --mock-data
    --vocab-size 256
    --split 99990,8,2
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 4
    --lr 1e-3
    --train-iters "$TRAIN_ITERS"
    --lr-decay-iters 4
    --lr-decay-style cosine
    --min-lr 1.0e-4
    --weight-decay 0.1
    --lr-warmup-iters 1
    --clip-grad 1.0
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2
    --expert-model-parallel-size 2
    --sequence-parallel
    --use-distributed-optimizer
)
LOGGING_ARGS=(
    --log-interval 1
    --save-interval 3
    --eval-interval 1000
    --eval-iters 1
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard"
)

# no cd: the caller's relative paths (checkpoints, logs, data) stay relative to where it runs
"$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${MTP_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}"
