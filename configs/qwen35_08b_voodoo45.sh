#!/usr/bin/env bash
# Qwen3.5-0.8B -> Voodoo45 (45 % of its uniform-Q8_0 size, badge IQ2_M) on one GPU.
#   data -> make-teacher -> imatrix -> precache -> train (--dry_run first) -> export -> eval
# Menus and budget knobs are the SPEC reference recipe's, scaled to one device and 0.8B.
# Every step skips itself when its output exists, so a rerun resumes (train resumes from
# its journal partial.pt by itself). Override any variable from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."

# ---- paths and settings ---------------------------------------------------------------------
MODEL=${MODEL:-./Qwen3.5-0.8B}                # HF checkpoint dir (config, tokenizer, safetensors)
CORPUS=${CORPUS:-corpus}                      # text files / folders / .jsonl for calibration + eval
DATA=${DATA:-data/qwen35-08b}                 # train_tokens.pt, eval_tokens.pt, meta.json
CKPT=${CKPT:-checkpoints/Qwen3.5-0.8B}        # base and Q8_0 teacher .pt
IMATRIX=${IMATRIX:-$CKPT/imatrix.gguf}
RUN=${RUN:-$CKPT/Voodoo45}                    # journal, assignment.json, tensor-types.txt
OUT=${OUT:-out}                               # exported GGUFs
SIZE=45                                       # Voodoo45: --compression_ratio 0.45
SEQ_LEN=${SEQ_LEN:-2048}
STEPS=${STEPS:-100}
CALIB_SEQS=${CALIB_SEQS:-64}                  # sequences for the imatrix
DEVICE=${DEVICE:-cuda:0}
TEXT_CLASS=qwen3_5_text                       # the text model of the Qwen3.5 checkpoint
STRIP_PREFIX=model.language_model.            # where a multimodal wrapper keeps it (harmless otherwise)
NAME=Qwen3.5-0.8B
BASE=qwen35_08b_lm_base.pt
TEACHER=qwen35_08b_lm_teacher_q8_0.pt
V=${VOODOO:-.venv/bin/voodoo}
PY=${PYTHON:-.venv/bin/python}
export HF_HUB_OFFLINE=1

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
mkdir -p "$CKPT" "$OUT"

say "environment"
$V doctor

say "1/7 data: tokenize the corpus (train / eval split by document)"
[ -f "$DATA/eval_tokens.pt" ] || \
  $V data --model "$MODEL" --output_dir "$DATA" --seq_len "$SEQ_LEN" --eval_fraction 0.05 "$CORPUS"

say "2/7 make-teacher: BF16 base + llama.cpp-exact Q8_0 teacher"
[ -f "$CKPT/$TEACHER" ] || \
  $V make-teacher --model "$MODEL" --output_dir "$CKPT" --strip_prefix "$STRIP_PREFIX" \
    --text_model_class "$TEXT_CLASS" --base_name "$BASE" --teacher_name "$TEACHER"

say "3/7 imatrix from the calibration tokens"
[ -f "$IMATRIX" ] || \
  $V imatrix --model "$MODEL" --tokens "$DATA/train_tokens.pt" --max_sequences "$CALIB_SEQS" \
    --text_model_class "$TEXT_CLASS" --output "$IMATRIX"

say "4/7 precache: every candidate through libggml-base, on all CPU cores"
$V precache --model "$MODEL" --base_checkpoint "$CKPT/$BASE" --text_model_class "$TEXT_CLASS" \
  --imatrix "$IMATRIX" \
  --candidate_types      Q8_0 Q5_K IQ3_S IQ2_S IQ2_XXS IQ1_S \
  --attention_candidates Q5_K IQ3_S IQ2_S IQ2_XXS \
  --non_attention_candidates IQ4_XS IQ3_S IQ2_S IQ2_XXS IQ1_S

TRAIN=(
  --model "$MODEL" --base_checkpoint "$CKPT/$BASE" --text_model_class "$TEXT_CLASS"
  --teacher_quant Q8_0 --teacher_checkpoint "$CKPT/$TEACHER"
  --compression_ratio "0.$SIZE" --budget_reduction 0.03
  --tensor_upgrades '[{"pattern":"mlp\\.(gate|up|down)_proj$","levels":1},{"pattern":"linear_attn|self_attn","levels":-1}]'
  --seq_len "$SEQ_LEN" --batch_size 1 --max_steps "$STEPS"
  --lr 0.5 --size_weight 100.0 --size_tolerance 0.02
  --lazy --imatrix "$IMATRIX"
  --candidate_types Q8_0 Q5_K IQ3_S IQ2_S IQ2_XXS IQ1_S
  --attention_candidates Q5_K IQ3_S IQ2_S IQ2_XXS
  --non_attention_candidates IQ4_XS IQ3_S IQ2_S IQ2_XXS IQ1_S
  --gradient_checkpointing
  --data_dir "$DATA" --data_name train_tokens.pt
  --output_dir "$RUN" --output_name "$NAME-Voodoo$SIZE.pt"
  --device "$DEVICE" --dtype bfloat16 --partial_save_interval 5
)

say "5/7 train: dry run (menus, bytes, achievable range), then the gates"
$V train "${TRAIN[@]}" --dry_run
[ -f "$RUN/assignment.json" ] || $V train "${TRAIN[@]}"

say "6/7 export: GGUF with exactly the trained candidates' bytes"
GGUF="$OUT/$NAME.Voodoo${SIZE}_IQ2_M.gguf"
[ -f "$GGUF" ] || \
  $V export --model "$MODEL" --assignment "$RUN/assignment.json" --base_checkpoint "$CKPT/$BASE" \
    --imatrix "$IMATRIX" --output_dir "$OUT" --size_percent "$SIZE" --model_name "$NAME"

say "7/7 eval: KLD against the BF16 model in stock llama-perplexity"
REF="$OUT/$NAME.BF16.gguf"
[ -f "$REF" ] || $PY third_party/llama.cpp/convert_hf_to_gguf.py "$MODEL" --outtype bf16 --no-mtp --outfile "$REF"
$V eval --gguf "$GGUF" --reference "$REF" --eval_tokens "$DATA/eval_tokens.pt" --tokenizer "$MODEL" \
  -c 512 --chunks 100 --output_json "$OUT/$NAME.Voodoo$SIZE.eval.json"

echo "GGUF: $GGUF"
