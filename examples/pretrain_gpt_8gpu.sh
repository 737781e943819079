#!/usr/bin/env bash
# A 7B Llama-2-style GPT on 8 GPUs of one node, bf16, full 3D parallelism.
#
# Model (Llama-2 7B shape): 32 layers, hidden 4096, 32 heads (head dim 128), SwiGLU MLP with
# FFN 11008, RoPE, RMSNorm, no linear biases, untied embeddings, sequence 4096, a 32000-entry
# SentencePiece vocabulary: 6,738,415,616 parameters.
#
# Layout: TP 2 x PP 2 x DP 2 = 8 GPUs.
#   * TP 2 with --sequence-parallel: each TP region's all-gather / reduce-scatter stays on NVLink,
#     and the norms' and dropouts' activations are stored 1/2 as large.
#   * PP 2, interleaved: --num-layers-per-virtual-pipeline-stage 8 gives 2 virtual stages per rank
#     (32 / (2 x 8)); bubble (PP-1)/(VP*M) = 1/(2*128) with M = 256 / (1 x 2) = 128 micro-batches.
#   * DP 2 with --zero-stage 1: the fp32 master weights and AdamW moments are sharded over the 2 DP
#     ranks (ZeRO-1 needs DP > 1, which is why this is not TP 4 x PP 2 -- see below).
#   * bf16 parameters, fp32 gradient accumulation, selective activation recompute, dropout 0 so
#     attention runs through F.scaled_dot_product_attention (flash kernels).
# Micro-batch 1 x 4096 tokens, global batch 256 sequences (1M tokens per step).
#
# Memory, from the planner (python -m megazero.planner, same flags + --world-size 8), the most
# loaded stage (the first):
#   1.68B parameters per GPU; model states 18.83 GiB + activations 10.65 GiB = 29.48 GiB -> fits
#   80 GB (micro-batch 2: 40.12 GiB, also fits). Communication per step per GPU: 268.7 GiB
#   (TP 256 GiB over NVLink, DP 4.7 GiB, PP 8 GiB).
# Alternatives the planner also fits in 80 GB: TP 4 x PP 2 (VP 2), DP 1 (19.45 GiB, but no
#   data parallelism, so no ZeRO, and 3x the TP traffic: 776 GiB/step); TP 8 (16.3 GiB, 1792 GiB
#   of TP traffic); pure ZeRO-3 DP 8 (31.7 GiB, 1406 GiB of DP traffic).
#
#   DATA_PATH=/data/corpus_text_document TOKENIZER_MODEL=/data/llama_sp.model bash examples/pretrain_gpt_8gpu.sh
#   MOCK=1 bash examples/pretrain_gpt_8gpu.sh          # random tokens (vocab 32000): a throughput check
#   DRY_RUN=1 bash examples/pretrain_gpt_8gpu.sh       # validate the flags for 8 ranks, print the plan
# Multi-node: see examples/slurm/ (the same flags; TP and PP stay within a node).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
NGPU="${NGPU:-8}"
OUT="${OUT:-runs/gpt_7b_8gpu}"
TRAIN_ITERS="${TRAIN_ITERS:-250000}"          # 250k x 1M tokens = 262B tokens
DATA_PATH="${DATA_PATH:-data/prepared/kjv_text_document}"
TOKENIZER_MODEL="${TOKENIZER_MODEL:-data/prepared/kjv_sp.model}"

MODEL=(--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
  --seq-length 4096 --max-position-embeddings 4096
  --swiglu --position-embedding-type rope --normalization RMSNorm --norm-epsilon 1e-5
  --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02)
PARALLEL=(--tensor-model-parallel-size 2 --sequence-parallel
  --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 8
  --zero-stage 1 --bf16 --recompute-granularity selective)
TRAINING=(--micro-batch-size 1 --global-batch-size 256 --train-iters "$TRAIN_ITERS"
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --clip-grad 1.0)
if [[ "${MOCK:-0}" == 1 ]]; then
  DATA=(--mock-data --vocab-size 32000)
else
  DATA=(--data-path "$DATA_PATH" --split 969,30,1
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
fi
LOGGING=(--log-interval 10 --eval-interval 1000 --eval-iters 10
  --save "$OUT/checkpoints" --save-interval 500 --load "$OUT/checkpoints"
  --tensorboard-dir "$OUT/tensorboard")

ARGS=("${MODEL[@]}" "${PARALLEL[@]}" "${TRAINING[@]}" "${DATA[@]}" "${LOGGING[@]}")

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  mkdir -p "$OUT/checkpoints"   # --load must exist to validate
  PYTHON="$PYTHON" bash examples/dry_run.sh "$NGPU" 32000 80 -- "${ARGS[@]}"
  exit 0
fi

mkdir -p "$OUT/checkpoints"
CMD=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" pretrain_gpt.py "${ARGS[@]}")
printf '  %q' "${CMD[@]}"; echo
"${CMD[@]}" 2>&1 | tee -a "$OUT/train.log"
