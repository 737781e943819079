#!/usr/bin/env bash
# A ~1.3B Llama-style GPT on ONE GPU, bf16.
#
# Model: 24 layers, hidden 2048, 16 heads (head dim 128), SwiGLU MLP (FFN 5440 = 8/3 h rounded
# down to a multiple of 64), RoPE, RMSNorm, no linear biases, untied input/output embeddings,
# sequence 2048, a 32000-entry SentencePiece vocabulary: 1,335,986,176 parameters.
# (GPT-2/GPT-3-XL style instead: drop --swiglu --position-embedding-type rope --normalization RMSNorm
# --disable-bias-linear --untie-embeddings-and-output-weights and use a GPT-2 BPE tokenizer: 1.32B.)
#
# Layout: TP 1, PP 1, DP 1. --zero-stage 0: with one data-parallel rank there is nothing to
# shard (stage 1 would hold the same bytes). bf16 parameters, fp32 gradient accumulation, fp32
# master weights and AdamW moments: 2 + 4 + 12 = 18 bytes/parameter = 22.4 GiB of model states.
# Micro-batch 4 x 2048 tokens with --recompute-granularity selective; global batch 256 sequences
# (0.5M tokens, 64 micro-batches of gradient accumulation per step). Dropout 0, so attention
# goes through F.scaled_dot_product_attention (flash kernels on Ampere/Hopper).
#
# Memory, from the planner (python -m megazero.planner, same flags + --world-size 1):
#   model states 22.40 GiB + activations 13.80 GiB = 36.20 GiB per GPU -> fits 80 GB (on a 40 GB
#   GPU use --micro-batch-size 2). Micro-batch 8: 50.0 GiB; 16: 77.6 GiB (too tight).
#   Without recompute the same 36.20 GiB: flash attention keeps no a*s^2 scores (66.2 GiB with
#   --attention-backend unfused), so selective recompute only costs time here (planner: +4.6 %;
#   measured on an H200: 45.5 GiB peak both ways, MFU 0.371 without, 0.359 with; docs/benchmarks.md).
# Throughput: `PYTHONPATH=. python bench/gpu_mfu.py --recompute selective --micro-batch-size 4` times
# this model's training step (tokens/s and MFU; 8 micro-batches per step instead of 64).
#
#   DATA_PATH=/data/mycorpus_text_document TOKENIZER_MODEL=/data/sp32k.model bash examples/pretrain_gpt_1gpu.sh
#   MOCK=1 bash examples/pretrain_gpt_1gpu.sh          # random tokens (vocab 32000): a throughput check
#   DRY_RUN=1 bash examples/pretrain_gpt_1gpu.sh       # validate the flags and print the planner's estimate
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
OUT="${OUT:-runs/gpt_1p3b_1gpu}"
TRAIN_ITERS="${TRAIN_ITERS:-50000}"            # 50k x 0.5M tokens = 26B tokens (~20 tokens/param)
DATA_PATH="${DATA_PATH:-data/prepared/kjv_text_document}"
TOKENIZER_MODEL="${TOKENIZER_MODEL:-data/prepared/kjv_sp.model}"

MODEL=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16
  --seq-length 2048 --max-position-embeddings 2048
  --swiglu --position-embedding-type rope --normalization RMSNorm --disable-bias-linear
  --untie-embeddings-and-output-weights
  --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02)
PARALLEL=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --zero-stage 0
  --bf16 --recompute-granularity selective)
TRAINING=(--micro-batch-size 4 --global-batch-size 256 --train-iters "$TRAIN_ITERS"
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0)
if [[ "${MOCK:-0}" == 1 ]]; then
  DATA=(--mock-data --vocab-size 32000)
else
  DATA=(--data-path "$DATA_PATH" --split 969,30,1
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
fi
LOGGING=(--log-interval 10 --eval-interval 1000 --eval-iters 10
  --save "$OUT/checkpoints" --save-interval 1000 --load "$OUT/checkpoints"
  --tensorboard-dir "$OUT/tensorboard")

ARGS=("${MODEL[@]}" "${PARALLEL[@]}" "${TRAINING[@]}" "${DATA[@]}" "${LOGGING[@]}")

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  mkdir -p "$OUT/checkpoints"   # --load must exist to validate
  PYTHON="$PYTHON" bash examples/dry_run.sh 1 32000 80 -- "${ARGS[@]}"
  exit 0
fi

mkdir -p "$OUT/checkpoints"
CMD=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 pretrain_gpt.py "${ARGS[@]}")
printf '  %q' "${CMD[@]}"; echo
"${CMD[@]}" 2>&1 | tee -a "$OUT/train.log"
