#!/usr/bin/env bash
# The `make train` demo: a small GPT on the bundled KJV corpus, 8 CPU ranks, full 3D parallelism:
# TP 2 x PP 2 (2 virtual stages each, interleaved 1F1B) x DP 2 with ZeRO stage 2, bf16 params
# with fp32 master weights where the CPU computes bf16 natively (fp32 elsewhere, see BF16 below),
# evaluation, TensorBoard logs and checkpoints. Then it loads the last
# checkpoint into another layout (tensor parallelism GEN_TP, default 4, one pipeline stage) and
# generates a few lines with a KV cache (tools/generate.py; docs/generation.md).
#
#   bash examples/train_demo_cpu.sh            (run tools/prepare_demo_data.sh first)
#   TRAIN_ITERS=300 OUT=runs/demo bash examples/train_demo_cpu.sh
#   GEN_TP=1 bash examples/train_demo_cpu.sh   (GEN_TP=0: skip generation)
#   BF16=1 bash examples/train_demo_cpu.sh     (bf16 even where the CPU emulates it; BF16=0: fp32)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
DATA="${DATA:-data/prepared}"
OUT="${OUT:-runs/demo}"
TRAIN_ITERS="${TRAIN_ITERS:-150}"
GEN_TP="${GEN_TP:-4}"
# bf16 where the CPU has bf16 instructions (avx512_bf16 / amx_bf16). Elsewhere PyTorch emulates
# bf16 matmuls, about 20x slower than fp32 on an AVX2 core, and the demo would take ~20 minutes.
BF16="${BF16:-auto}"
NATIVE_BF16="$(grep -owE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null | sort -u | tr '\n' ' ' || true)"
if [ "$BF16" = auto ]; then
  if [ -n "$NATIVE_BF16" ]; then BF16=1; else BF16=0; fi
fi
if [ "$BF16" = 1 ]; then PRECISION=(--bf16); DTYPE=bf16; else PRECISION=(); DTYPE=fp32; fi
if [ -e "$OUT/checkpoints/latest_checkpointed_iteration.txt" ]; then
  # a fresh demo never overwrites an earlier one: keep it under a dated name
  KEEP="$OUT.$(date +%Y%m%d-%H%M%S)"
  mv "$OUT" "$KEEP"
  echo "megazero demo: kept the previous run in $KEEP"
fi
mkdir -p "$OUT"

CMD=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 8 pretrain_gpt.py
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1
  --sequence-parallel --zero-stage 2 ${PRECISION[@]+"${PRECISION[@]}"}
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128
  --attention-dropout 0.0 --hidden-dropout 0.0
  --micro-batch-size 4 --global-batch-size 32 --train-iters "$TRAIN_ITERS"
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.1 --clip-grad 1.0
  --data-path "$DATA/kjv_text_document" --split 98,2,0
  --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$DATA/kjv_sp.model"
  --log-interval 10 --eval-interval 50 --eval-iters 2
  --save "$OUT/checkpoints" --save-interval 100 --tensorboard-dir "$OUT/tensorboard")

echo "megazero demo: running in $DTYPE (BF16=$BF16; this CPU's bf16 instructions: ${NATIVE_BF16:-none})"
printf '  %q' "${CMD[@]}"; echo
OMP_NUM_THREADS=1 "${CMD[@]}" 2>&1 | tee "$OUT/train.log"
echo "megazero demo: log        $OUT/train.log"
echo "megazero demo: TensorBoard tensorboard --logdir $OUT/tensorboard"
echo "megazero demo: checkpoint $OUT/checkpoints (latest: $(cat "$OUT/checkpoints/latest_checkpointed_iteration.txt" 2>/dev/null || echo none))"

if [ "$GEN_TP" -gt 0 ]; then
  GEN=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$GEN_TP" tools/generate.py
    --load "$OUT/checkpoints" --tensor-model-parallel-size "$GEN_TP"
    --prompt "In the beginning" --prompt "And God said unto Moses" --prompt "The LORD is my shepherd"
    --max-new-tokens 40 --temperature 0.8 --top-p 0.9 --seed 1234)
  echo "megazero demo: generating from the checkpoint (trained TP 2 x PP 2 x DP 2, ZeRO 2, $DTYPE) at TP $GEN_TP"
  printf '  %q' "${GEN[@]}"; echo
  OMP_NUM_THREADS=1 "${GEN[@]}" 2>&1 | grep -v "TCPStore\|TORCHELASTIC" | tee "$OUT/generate.log"
fi
