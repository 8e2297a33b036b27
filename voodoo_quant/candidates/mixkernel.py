"""The native CPU kernel that mixes candidates kept as int8 codes (:mod:`voodoo_quant.candidates.compact`).

A float32 stack costs 4 bytes per weight per candidate, and the soft mixture reads all of it
twice a step (forward, and the gate gradients' dot products): on a CPU that traffic is most of
what a training step adds to a plain forward+backward. Every quantized ggml type is
``scale · code (+ offset)`` per sub-block (:mod:`voodoo_quant.quants.affine`) with int8 codes, so
the candidates fit in about 1.3 bytes per weight, and one pass can expand and mix them in cache:

- ``vq_mix_forward``: ``out = Σ_k p_k · w_k``, with ``w_k = scale · code`` then ``+ offset``, each
  product rounded and then added in candidate order (compiled with ``-ffp-contract=off``: never
  fused). Bit for bit what the sequential float32 sum over dequantized candidates gives
  (``layers._mix_block``'s loop, the ``--lazy`` path).
- ``vq_mix_backward``: ``dL/dp_k = Σ_i g_i · w_k,i``, float32 products summed in 32 lanes per
  4096-weight chunk and the chunks in float64, in a fixed order whatever the thread count.
- ``vq_expand``: one candidate's float32 weights (bake, search, inspection).

The C source is compiled once per machine with the system C compiler (``cc``, as the llama.cpp
build needs one) into the cache directory, keyed by its source, flags, compiler and CPU, and
loaded with ctypes after torch, so that its OpenMP runtime is the one torch already loaded.
Where no compiler works, :func:`load` returns None and the callers keep float32 stacks;
``VOODOO_MIX_KERNEL=0`` chooses that too.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from ..core import envs

log = logging.getLogger(__name__)

CHUNK = 4096  # weights per work item (a multiple of every sub-block length: 8, 16 or 32)

_SOURCE = r"""
#include <stdint.h>
#include <stddef.h>

#define CHUNK @CHUNK@
#define LANES 32

typedef struct {
    const int8_t *code;   /* n codes */
    const float *scale;   /* n >> shift scales */
    const float *offset;  /* n >> shift offsets, or NULL */
    int64_t shift;        /* log2 of the sub-block length */
} vq_cand;

/* w[i - lo] = scale * code (one rounding), then + offset (a second one), for i in [lo, hi).
   The sub-block length is a compile-time constant in each branch, so every sub-block is a few
   whole vector operations. */
#define EXPAND(LEN)                                                              \
    for (int64_t b = lo / (LEN); b < hi / (LEN); b++) {                          \
        const float s = c->scale[b];                                             \
        const int8_t *restrict q = c->code + b * (LEN);                          \
        float *restrict y = w + (b * (LEN) - lo);                                \
        if (c->offset) {                                                         \
            const float m = c->offset[b];                                        \
            for (int t = 0; t < (LEN); t++) {                                    \
                const float v = s * (float)q[t];                                 \
                y[t] = v + m;                                                    \
            }                                                                    \
        } else {                                                                 \
            for (int t = 0; t < (LEN); t++) y[t] = s * (float)q[t];              \
        }                                                                        \
    }

static void expand_range(const vq_cand *c, int64_t lo, int64_t hi, float *restrict w) {
    switch (c->shift) {
    case 3: EXPAND(8) break;
    case 4: EXPAND(16) break;
    case 5: EXPAND(32) break;
    default: {
        const int64_t sh = c->shift, len = (int64_t)1 << sh;
        for (int64_t b = lo >> sh; b < (hi >> sh); b++) {
            const float s = c->scale[b];
            const int8_t *restrict q = c->code + (b << sh);
            float *restrict y = w + ((b << sh) - lo);
            const float m = c->offset ? c->offset[b] : 0.0f;
            for (int64_t t = 0; t < len; t++) {
                const float v = s * (float)q[t];
                y[t] = c->offset ? v + m : v;
            }
        }
    }
    }
}

void vq_expand(int64_t n, const vq_cand *c, float *out, int32_t nthreads) {
    const int64_t nch = (n + CHUNK - 1) / CHUNK;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t ch = 0; ch < nch; ch++) {
        const int64_t lo = ch * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
        expand_range(c, lo, hi, out + lo);
    }
}

/* o[i - lo] (+)= p * (scale * code (+ offset)): candidate k == first writes, the others add */
#define MIX(LEN)                                                                 \
    for (int64_t b = lo / (LEN); b < hi / (LEN); b++) {                          \
        const float s = c->scale[b], m = c->offset ? c->offset[b] : 0.0f;        \
        const int8_t *restrict q = c->code + b * (LEN);                          \
        float *restrict y = o + (b * (LEN) - lo);                                \
        float v[LEN];                                                            \
        if (c->offset) {                                                         \
            for (int t = 0; t < (LEN); t++) { const float a = s * (float)q[t]; v[t] = a + m; } \
        } else {                                                                 \
            for (int t = 0; t < (LEN); t++) v[t] = s * (float)q[t];              \
        }                                                                        \
        if (first) {                                                             \
            for (int t = 0; t < (LEN); t++) y[t] = v[t] * pk;                    \
        } else {                                                                 \
            for (int t = 0; t < (LEN); t++) { const float a = v[t] * pk; y[t] = y[t] + a; } \
        }                                                                        \
    }

static void mix_range(const vq_cand *c, float pk, int first, int64_t lo, int64_t hi, float *restrict o) {
    switch (c->shift) {
    case 3: MIX(8) break;
    case 4: MIX(16) break;
    case 5: MIX(32) break;
    default: {
        float w[CHUNK];
        expand_range(c, lo, hi, w);
        for (int64_t i = 0; i < hi - lo; i++) {
            const float a = w[i] * pk;
            o[i] = first ? a : o[i] + a;
        }
    }
    }
}

void vq_mix_forward(int64_t n, int32_t k_count, const vq_cand *cands, const float *p, float *out,
                    int32_t nthreads) {
    const int64_t nch = (n + CHUNK - 1) / CHUNK;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t ch = 0; ch < nch; ch++) {
        const int64_t lo = ch * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
        for (int32_t k = 0; k < k_count; k++) mix_range(&cands[k], p[k], k == 0, lo, hi, out + lo);
    }
}

/* partial: nch * k_count doubles of scratch; grad: k_count doubles */
void vq_mix_backward(int64_t n, int32_t k_count, const vq_cand *cands, const float *g, double *partial,
                     double *grad, int32_t nthreads) {
    const int64_t nch = (n + CHUNK - 1) / CHUNK;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t ch = 0; ch < nch; ch++) {
        const int64_t lo = ch * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n, len = hi - lo;
        float w[CHUNK];
        const float *restrict gg = g + lo;
        for (int32_t k = 0; k < k_count; k++) {
            expand_range(&cands[k], lo, hi, w);
            /* 32 independent lanes (several vector accumulators: not one chain of dependent adds) */
            float acc[LANES] = {0};
            const int64_t body = len - len % LANES;
            for (int64_t i = 0; i < body; i += LANES)
                for (int u = 0; u < LANES; u++) acc[u] += gg[i + u] * w[i + u];
            for (int64_t i = body; i < len; i++) acc[i - body] += gg[i] * w[i];
            double s = 0.0;
            for (int u = 0; u < LANES; u++) s += (double)acc[u];
            partial[ch * k_count + k] = s;
        }
    }
    for (int32_t k = 0; k < k_count; k++) {
        double s = 0.0;
        for (int64_t ch = 0; ch < nch; ch++) s += partial[ch * k_count + k];
        grad[k] = s;
    }
}
""".replace("@CHUNK@", str(CHUNK))  # one value for the kernel and the scratch its caller sizes

FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-fast-math", "-std=c11", "-shared", "-fPIC")
# Where the compiler refuses those (Apple clang has no -fopenmp): one thread, generic code, the same bits.
PORTABLE_FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-std=c11", "-shared", "-fPIC")


class Cand(ctypes.Structure):
    _fields_ = [("code", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("offset", ctypes.c_void_p),
                ("shift", ctypes.c_int64)]


_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None
_failure: str | None = None


def _cpu_key() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> tuple[str, str] | None:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return cc, version


def _build(cc: str, key: str, flags: tuple[str, ...]) -> Path:
    out_dir = envs.cache_dir() / "kernels"
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"mix-{key}.so"
    if lib.exists():
        return lib
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / "mix.c"
        src.write_text(_SOURCE)
        tmp_lib = Path(tmp) / "mix.so"
        proc = subprocess.run([cc, *flags, str(src), "-o", str(tmp_lib)], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            raise RuntimeError(lines[-1] if lines else f"{cc} exited with {proc.returncode}")
        os.replace(tmp_lib, lib)  # atomic: a concurrent builder finds a whole library or none
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled kernel (built on first use), or None when it is switched off or cannot be built
    (:func:`unavailable_reason` says why)."""
    global _loaded, _failure
    if not envs.mix_kernel():
        return None
    with _lock:
        if _loaded is not None or _failure is not None:
            return _loaded
        import torch  # noqa: F401  (torch's OpenMP runtime first: the kernel shares it)

        found = _compiler()
        if found is None:
            _failure = "no C compiler (cc, gcc or clang) found"
        else:
            cc, version = found
            lib, errors = None, []
            for flags in (FLAGS, PORTABLE_FLAGS):
                key = hashlib.sha256("\n".join([_SOURCE, " ".join(flags), version, _cpu_key()]).encode()).hexdigest()[:16]
                try:
                    lib = ctypes.CDLL(str(_build(cc, key, flags)))
                    break
                except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                    errors.append(str(e))
            if lib is None:
                _failure = f"the mixing kernel did not build: {errors[-1]}"
            else:
                i64, i32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
                lib.vq_expand.argtypes = [i64, ptr, ptr, i32]
                lib.vq_mix_forward.argtypes = [i64, i32, ptr, ptr, ptr, i32]
                lib.vq_mix_backward.argtypes = [i64, i32, ptr, ptr, ptr, ptr, i32]
                for fn in (lib.vq_expand, lib.vq_mix_forward, lib.vq_mix_backward):
                    fn.restype = None
                _loaded = lib
        if _failure is not None:
            log.warning("%s; eager candidates stay float32 stacks", _failure)
        return _loaded


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (after it was called), or None."""
    if not envs.mix_kernel():
        return "VOODOO_MIX_KERNEL=0"
    return _failure
