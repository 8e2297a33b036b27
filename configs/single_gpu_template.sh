#!/usr/bin/env bash
# Template: your own HF model -> Voodoo<SIZE> GGUF on one GPU (or CPU: DEVICE=cpu DTYPE=float32).
#   data -> make-teacher -> imatrix -> train (--dry_run first) -> export -> eval
# Copy it, set the variables below, run it. Every step skips itself when its output exists;
# an interrupted train resumes from <RUN>/partial.pt when rerun with the same flags.
set -euo pipefail
cd "$(dirname "$0")/.."

# ---- paths and settings ---------------------------------------------------------------------
MODEL=${MODEL:-./MyModel}                 # HF checkpoint dir (config.json, tokenizer, *.safetensors)
NAME=${NAME:-$(basename "$MODEL")}        # <Model> in the GGUF name
CORPUS=${CORPUS:-corpus}                  # text files, folders (see --glob) or .jsonl (field "text")
WORK=${WORK:-runs/$NAME}                  # data, checkpoints, run, GGUFs all go below this
SIZE=${SIZE:-45}                          # standard size 25..80 step 5: Voodoo<SIZE> = SIZE % of Q8_0
SEQ_LEN=${SEQ_LEN:-1024}
STEPS=${STEPS:-100}
CALIB_SEQS=${CALIB_SEQS:-64}
MENU=${MENU:-"Q8_0 Q6_K Q5_K Q4_K IQ4_XS IQ3_S IQ2_S IQ2_XXS"}   # ordered by bits in the run anyway
DEVICE=${DEVICE:-cuda:0}
DTYPE=${DTYPE:-bfloat16}
V=${VOODOO:-.venv/bin/voodoo}
PY=${PYTHON:-.venv/bin/python}
export HF_HUB_OFFLINE=1

DATA="$WORK/data"
CKPT="$WORK/checkpoints"
IMATRIX="$WORK/imatrix.gguf"
RUN="$WORK/Voodoo$SIZE"
OUT="$WORK/gguf"
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
mkdir -p "$WORK"

say "environment"
$V doctor

say "1/6 data"
[ -f "$DATA/eval_tokens.pt" ] || \
  $V data --model "$MODEL" --output_dir "$DATA" --seq_len "$SEQ_LEN" --eval_fraction 0.1 "$CORPUS"

say "2/6 make-teacher (BF16 base + Q8_0 teacher)"
[ -f "$CKPT/teacher_q8_0.pt" ] || \
  $V make-teacher --model "$MODEL" --output_dir "$CKPT" --base_name base.pt --teacher_name teacher_q8_0.pt

say "3/6 imatrix"
[ -f "$IMATRIX" ] || \
  $V imatrix --model "$MODEL" --tokens "$DATA/train_tokens.pt" --max_sequences "$CALIB_SEQS" --output "$IMATRIX"

say "4/6 train: dry run, then the gates"
$V train --model "$MODEL" --base_checkpoint "$CKPT/base.pt" --teacher_quant Q8_0 \
  --teacher_checkpoint "$CKPT/teacher_q8_0.pt" --imatrix "$IMATRIX" --compression_ratio "0.$SIZE" \
  --seq_len "$SEQ_LEN" --max_steps "$STEPS" --candidate_types $MENU --lazy \
  --data_dir "$DATA" --output_dir "$RUN" --output_name "$NAME-Voodoo$SIZE.pt" \
  --device "$DEVICE" --dtype "$DTYPE" --dry_run
[ -f "$RUN/assignment.json" ] || \
  $V train --model "$MODEL" --base_checkpoint "$CKPT/base.pt" --teacher_quant Q8_0 \
    --teacher_checkpoint "$CKPT/teacher_q8_0.pt" --imatrix "$IMATRIX" --compression_ratio "0.$SIZE" \
    --seq_len "$SEQ_LEN" --max_steps "$STEPS" --candidate_types $MENU --lazy \
    --data_dir "$DATA" --output_dir "$RUN" --output_name "$NAME-Voodoo$SIZE.pt" \
    --device "$DEVICE" --dtype "$DTYPE"

say "5/6 export"
GGUF=$(ls "$OUT/$NAME.Voodoo${SIZE}_"*.gguf 2>/dev/null | head -n 1 || true)
if [ -z "$GGUF" ]; then
  $V export --model "$MODEL" --assignment "$RUN/assignment.json" --base_checkpoint "$CKPT/base.pt" \
    --imatrix "$IMATRIX" --output_dir "$OUT" --size_percent "$SIZE" --model_name "$NAME"
  GGUF=$(ls "$OUT/$NAME.Voodoo${SIZE}_"*.gguf | head -n 1)
fi

say "6/6 eval: KLD against the F16 model (stock llama-perplexity)"
REF="$OUT/$NAME.F16.gguf"
[ -f "$REF" ] || $PY third_party/llama.cpp/convert_hf_to_gguf.py "$MODEL" --outtype f16 --outfile "$REF"
$V eval --gguf "$GGUF" --reference "$REF" --eval_tokens "$DATA/eval_tokens.pt" --tokenizer "$MODEL" \
  -c 512 --output_json "$WORK/eval.json"

echo "GGUF: $GGUF   tensor types: ${GGUF%.gguf}.tensor-types.txt"
