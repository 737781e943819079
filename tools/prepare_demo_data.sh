#!/usr/bin/env bash
# Prepare the bundled KJV corpus for the demo run; reuses earlier results.
#
#   tools/prepare_demo_data.sh [OUT_DIR]          (default OUT_DIR: data/prepared)
#   PYTHON=.venv/bin/python VOCAB_SIZE=4096 WORKERS=2 tools/prepare_demo_data.sh
#
# Produces, if missing:
#   OUT_DIR/kjv_sp.model, kjv_sp.vocab          sentencepiece tokenizer (unigram, VOCAB_SIZE)
#   OUT_DIR/kjv_text_document.bin, .idx         the corpus tokenized, eod after each chapter
# and prints the flags to train on it. Each step is skipped when its outputs exist (delete
# OUT_DIR to redo). Both tools write to temporary names and rename on success, so an
# interrupted run never leaves a half-written file that a later run would reuse.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/data/prepared}"
CORPUS="${CORPUS:-$ROOT/data/kjv.jsonl.gz}"
VOCAB_SIZE="${VOCAB_SIZE:-4096}"
WORKERS="${WORKERS:-2}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

mkdir -p "$OUT"
MODEL="$OUT/kjv_sp.model"
PREFIX="$OUT/kjv"

if [[ -f "$MODEL" ]]; then
  echo "prepare_demo_data: reusing tokenizer $MODEL"
else
  echo "prepare_demo_data: training sentencepiece tokenizer (vocab $VOCAB_SIZE) -> $MODEL"
  "$PYTHON" "$ROOT/tools/train_tokenizer.py" --input "$CORPUS" --json-keys text \
    --vocab-size "$VOCAB_SIZE" --output-prefix "$OUT/kjv_sp"
fi

if [[ -f "${PREFIX}_text_document.bin" && -f "${PREFIX}_text_document.idx" \
      && "${PREFIX}_text_document.idx" -nt "$MODEL" ]]; then
  echo "prepare_demo_data: reusing dataset ${PREFIX}_text_document.{bin,idx}"
else
  echo "prepare_demo_data: tokenizing $CORPUS -> ${PREFIX}_text_document.{bin,idx}"
  "$PYTHON" "$ROOT/tools/preprocess_data.py" --input "$CORPUS" --json-keys text \
    --output-prefix "$PREFIX" --tokenizer-type GPTSentencePieceTokenizer \
    --tokenizer-model "$MODEL" --append-eod --workers "$WORKERS"
fi

echo "prepare_demo_data: train with --data-path ${PREFIX}_text_document" \
     "--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model $MODEL"
