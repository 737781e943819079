#!/usr/bin/env bash
# Validate a pretrain_gpt.py command line for NGPU ranks without starting anything, then print
# the memory planner's table for it (used by the examples' DRY_RUN=1).
#
#   bash examples/dry_run.sh NGPU VOCAB_SIZE GPU_MEMORY_GB -- <pretrain_gpt.py flags>
set -euo pipefail
NGPU="$1"; VOCAB="$2"; MEM="$3"; shift 4
PYTHON="${PYTHON:-python3}"
WORLD_SIZE="$NGPU" "$PYTHON" -c "import sys; from megazero.arguments import parse_args; \
a = parse_args(sys.argv[1:]); print('flags OK: world', a.world_size, 'TP', a.tensor_model_parallel_size, \
'PP', a.pipeline_model_parallel_size, 'VP', a.virtual_pipeline_model_parallel_size, 'DP', a.data_parallel_size, \
'micro-batches', a.num_micro_batches, 'SP', a.sequence_parallel, 'ZeRO', a.zero_stage)" "$@"
"$PYTHON" -m megazero.planner "$@" --vocab-size "$VOCAB" --world-size "$NGPU" --gpu-memory-gb "$MEM"
