#!/usr/bin/env bash
# The SPEC reference recipe: Qwen3.8-27B (Qwen3.5-family hybrid) -> Voodoo30 on 4 GPUs, TP-4.
#   data -> make-teacher -> imatrix -> voodoo tp (the recipe, flag for flag) -> export -> eval
#
# `voodoo tp` validates every train flag exactly as `voodoo train` does, checks the inputs
# (model dir, checkpoints, imatrix, tokens, GPU count) and starts 4 ranks through torchrun, one GPU
# each (`--device cuda:0` means "each rank on its own GPU" under torchrun). Each rank holds a
# quarter of every layer's heads and features and of every candidate's bytes (--lazy); the gates
# are shared, so the assignment equals a single-device run's. Tested on CPU with gloo on tiny
# models of this architecture; never run at 27B on real GPUs by us (no GPU was available).
set -euo pipefail
cd "$(dirname "$0")/.."

# ---- paths (the defaults are the recipe's own) ----------------------------------------------
MODEL=${MODEL:-./Qwen3.8-27B}                      # HF checkpoint dir
CORPUS=${CORPUS:-corpus-longctx}                   # long-context calibration text
DATA=${DATA:-data/qwen38-longctx}                  # train_tokens.pt / eval_tokens.pt
CKPT=${CKPT:-checkpoints/Qwen3.8-27B}
BASE=${BASE:-qwen38_27b_lm_base.pt}
TEACHER=${TEACHER:-qwen38_27b_lm_teacher_q8_0.pt}
IMATRIX=${IMATRIX:-imatrix.gguf}
RUN=${RUN:-$CKPT/Voodoo30}
OUT=${OUT:-out}
NAME=Qwen3.8-27B
CALIB_SEQS=${CALIB_SEQS:-32}
V=${VOODOO:-.venv/bin/voodoo}
PY=${PYTHON:-.venv/bin/python}
export HF_HUB_OFFLINE=1

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
mkdir -p "$CKPT" "$OUT"

say "environment (ranks per host: 4)"
$V doctor --world-size 4

say "1/6 data: 8192-token sequences"
[ -f "$DATA/train_tokens.pt" ] || \
  $V data --model "$MODEL" --output_dir "$DATA" --seq_len 8192 --eval_fraction 0.05 "$CORPUS"

say "2/6 make-teacher: BF16 base + Q8_0 teacher of the text model"
[ -f "$CKPT/$TEACHER" ] || \
  $V make-teacher --model "$MODEL" --output_dir "$CKPT" --strip_prefix model.language_model. \
    --text_model_class qwen3_5_text --base_name "$BASE" --teacher_name "$TEACHER"

say "3/6 imatrix"
[ -f "$IMATRIX" ] || \
  $V imatrix --model "$MODEL" --tokens "$DATA/train_tokens.pt" --max_sequences "$CALIB_SEQS" \
    --text_model_class qwen3_5_text --output "$IMATRIX"

say "4/6 train: the reference recipe, tensor-parallel over 4 GPUs"
$V tp --nproc 4 -- \
    --model "$MODEL" \
    --base_checkpoint "$CKPT/$BASE" \
    --text_model_class qwen3_5_text \
    --teacher_quant Q8_0 --teacher_checkpoint "$CKPT/$TEACHER" \
    --compression_ratio 0.30 --budget_reduction 0.03 \
    --tensor_upgrades '[{"pattern":"mlp\\.(gate|up|down)_proj$","levels":1},
                        {"pattern":"linear_attn|self_attn","levels":-1}]' \
    --seq_len 8192 --batch_size 1 --max_steps 100 \
    --lr 0.5 --size_weight 100.0 --size_tolerance 0.02 \
    --lazy --imatrix "$IMATRIX" \
    --candidate_types      Q8_0 Q5_K IQ3_S IQ2_S IQ2_XXS IQ1_S \
    --attention_candidates Q5_K IQ3_S IQ2_S IQ2_XXS \
    --non_attention_candidates IQ4_XS IQ3_S IQ2_S IQ2_XXS IQ1_S \
    --tensor_parallel 4 --gradient_checkpointing \
    --data_dir "$DATA" --data_name train_tokens.pt \
    --output_dir "$RUN" \
    --output_name "$NAME-Voodoo30.pt" \
    --device cuda:0 --dtype bfloat16 --partial_save_interval 1 --no_compile

say "5/6 export: Qwen3.8-27B.Voodoo30_IQ2_XXS.gguf + its llama-quantize tensor-type file"
GGUF="$OUT/$NAME.Voodoo30_IQ2_XXS.gguf"
[ -f "$GGUF" ] || \
  $V export --model "$MODEL" --assignment "$RUN/assignment.json" --base_checkpoint "$CKPT/$BASE" \
    --imatrix "$IMATRIX" --output_dir "$OUT" --size_percent 30 --model_name "$NAME"

say "6/6 eval: KLD against the BF16 model in stock llama-perplexity"
REF="$OUT/$NAME.BF16.gguf"
[ -f "$REF" ] || $PY third_party/llama.cpp/convert_hf_to_gguf.py "$MODEL" --outtype bf16 --no-mtp --outfile "$REF"
$V eval --gguf "$GGUF" --reference "$REF" --eval_tokens "$DATA/eval_tokens.pt" --tokenizer "$MODEL" \
  -c 4096 --chunks 20 --output_json "$OUT/$NAME.Voodoo30.eval.json"
