#!/usr/bin/env bash
# bench/warm_start_ablation.sh: warm-start ablation of the two sensitivity kinds: held-aside KL of
# the gates' bake, gates+polish and the guarantee's winner, per kind / size / seed.
set -u
cd "$(dirname "$0")/.."
W=${WORK:-runs/demo/work}  # a `make demo` work dir: teacher HF dir, data, imatrix beside it
OUT=runs/warm
MENU="Q8_0 Q6_K Q5_K Q5_0 Q4_K IQ4_XS IQ4_NL Q3_K IQ3_S IQ2_S"
for size in 60 80; do for seed in 0 1; do for kind in fisher output; do
  d=$OUT/v$size-s$seed-$kind
  [ -f $d/done ] && continue
  t0=$(date +%s)
  VOODOO_QUANT_WORKERS=1 .venv/bin/voodoo train --model $W/hf/SmolLM2-135M-Instruct --data_dir $W/data \
    --imatrix ${IMATRIX:-runs/demo/imatrix.gguf} --compression_ratio 0.$size --candidate_types $MENU --max_steps 10 \
    --seq_len 256 --seed $seed --sensitivity_kind $kind --search_evals 0 --search_sequences 8 \
    --output_dir $d > $d.log 2>&1 && touch $d/done
  echo "$d rc=$? $(( $(date +%s) - t0 )) s"
done; done; done
