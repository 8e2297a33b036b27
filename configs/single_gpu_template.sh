#!/usr/bin/env bash
# Template: your own HF model -> a ladder of Voodoo GGUFs with its model card, on one GPU
# (or CPU: DEVICE=cpu DTYPE=float32), in one command (`voodoo quantize`):
#   data -> imatrix -> candidate cache -> train (per size) -> export -> eval vs stock -> card
# Copy it, set the variables below, run it. Every step skips itself when its inputs are unchanged;
# an interrupted run resumes where it stopped (a training from its journal) when rerun.
set -euo pipefail
cd "$(dirname "$0")/.."

# ---- paths and settings ---------------------------------------------------------------------
MODEL=${MODEL:-./MyModel}                 # HF checkpoint dir (config.json, tokenizer, *.safetensors) or GGUF
NAME=${NAME:-$(basename "$MODEL")}        # <Model> in the GGUF names
CORPUS=${CORPUS:-corpus}                  # text files, folders (see --glob) or .jsonl (field "text")
OUT=${OUT:-runs/$NAME}                    # GGUFs, imatrix, eval.json, README.md; work files in $OUT/work
SIZES=${SIZES:-"30 45 60"}                # standard sizes: Voodoo<SIZE> = SIZE % of uniform Q8_0
SEQ_LEN=${SEQ_LEN:-1024}
STEPS=${STEPS:-100}
CALIB_SEQS=${CALIB_SEQS:-64}
MENU=${MENU:-"Q8_0 Q6_K Q5_K Q4_K IQ4_XS IQ3_S IQ2_S IQ2_XXS"}   # ordered by bits in the run anyway
DEVICE=${DEVICE:-cuda:0}
DTYPE=${DTYPE:-bfloat16}
V=${VOODOO:-.venv/bin/voodoo}
export HF_HUB_OFFLINE=1

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "environment"
$V doctor

say "look first: every tensor's menu, bytes and the achievable range (largest size)"
$V train --model "$MODEL" --compression_ratio 0.45 --candidate_types $MENU --dry_run

say "the ladder (train flags after --: here a Q8_0 teacher, as llama.cpp would serve it)"
$V quantize --model "$MODEL" --text "$CORPUS" --sizes $SIZES --output_dir "$OUT" --model_name "$NAME" \
  --seq_len "$SEQ_LEN" --max_steps "$STEPS" --calib_sequences "$CALIB_SEQS" --candidate_types $MENU \
  --device "$DEVICE" --dtype "$DTYPE" --lazy -- --teacher_quant Q8_0

echo "ladder and card: $OUT/README.md"
