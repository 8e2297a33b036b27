"""How fast can the soft mixture run on this CPU? Memory bandwidth of its two passes, side by side.

The mixture ``W = Σ_k p_k W_k`` (forward) and its gate gradient ``<G, W_k>`` for every k (backward)
each read the K float32 candidates once, so on the CPU they are bounded by memory bandwidth
(``layers._Mix``; the training step's ratio to a plain step). This bench times, on one synthetic (K, N) stack in one
run, interleaved and repeated (median):

- ``sum``               a plain reduction over the stack: the read bandwidth ceiling;
- ``fwd gemv``          ``p @ W.view(K, -1)`` into a fresh tensor, as ``_Mix`` does;
- ``fwd gemv chunked``  the same product a block of columns at a time into one output (the same bits);
- ``bwd dots``          one ``torch.dot`` per candidate, as ``_Mix.backward`` does;
- ``bwd mv``            ``W.view(K, -1) @ G`` (one pass over the stack);
- ``fwd C`` / ``bwd C`` a plain C loop over column blocks with OpenMP (built with ``cc`` at run time;
  skipped when no compiler is found): what a fused kernel would reach without packed candidates.

GB/s counts the bytes of the stack read once (K·N·4). Nothing here is used by the package; it
tells whether a custom CPU kernel would pay for itself.

    .venv/bin/python bench/mix_bandwidth.py [--k 4] [--n 40000000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from voodoo_quant.hardware.envdefaults import apply_env_defaults, host_env_defaults  # noqa: E402

apply_env_defaults(host_env_defaults(), os.environ)  # huge pages, as the CLI runs

import torch  # noqa: E402

C_SOURCE = r"""
#include <stddef.h>
#define BLOCK 4096
void mix_fwd(const float *w, size_t k, size_t n, const float *p, float *y) {
    #pragma omp parallel for schedule(static)
    for (size_t b = 0; b < n; b += BLOCK) {
        size_t e = b + BLOCK < n ? b + BLOCK : n;
        for (size_t i = b; i < e; i++) y[i] = p[0] * w[i];
        for (size_t j = 1; j < k; j++) {
            const float *wj = w + j * n;
            for (size_t i = b; i < e; i++) y[i] += p[j] * wj[i];
        }
    }
}
void mix_bwd(const float *w, size_t k, size_t n, const float *g, double *out) {
    for (size_t j = 0; j < k; j++) {
        const float *wj = w + j * n;
        double s = 0.0;
        #pragma omp parallel for reduction(+:s) schedule(static)
        for (size_t b = 0; b < n; b += BLOCK) {
            size_t e = b + BLOCK < n ? b + BLOCK : n;
            float part = 0.f;
            for (size_t i = b; i < e; i++) part += wj[i] * g[i];
            s += part;
        }
        out[j] = s;
    }
}
"""


def build_c(workdir: Path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    src, lib = workdir / "mix.c", workdir / "libmix.so"
    src.write_text(C_SOURCE)
    cmd = [cc, "-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(lib)]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        return None
    return ctypes.CDLL(str(lib))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=4, help="candidates per tensor")
    ap.add_argument("--n", type=int, default=40_000_000, help="elements per candidate")
    ap.add_argument("--chunk", type=int, default=1 << 18, help="columns per block of the chunked product")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args(argv)

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(a.k, a.n, generator=gen)
    p = torch.softmax(torch.randn(a.k, generator=gen), 0)
    g = torch.randn(a.n, generator=gen)
    out = torch.empty(a.n)
    grads = torch.zeros(a.k, dtype=torch.float64)

    def chunked():
        for lo in range(0, a.n, a.chunk):
            hi = min(a.n, lo + a.chunk)
            torch.matmul(p.unsqueeze(0), w[:, lo:hi], out=out[lo:hi].unsqueeze(0))
        return out

    variants = {
        "sum": lambda: w.sum(),
        "fwd gemv": lambda: p @ w,
        "fwd gemv chunked": chunked,
        "bwd dots": lambda: torch.stack([torch.dot(g, w[j]) for j in range(a.k)]),
        "bwd mv": lambda: w @ g,
    }
    with tempfile.TemporaryDirectory() as tmp:
        lib = build_c(Path(tmp))
        if lib is not None:
            ptr = ctypes.c_void_p
            size = ctypes.c_size_t
            variants["fwd C"] = lambda: lib.mix_fwd(ptr(w.data_ptr()), size(a.k), size(a.n), ptr(p.data_ptr()),
                                                    ptr(out.data_ptr()))
            variants["bwd C"] = lambda: lib.mix_bwd(ptr(w.data_ptr()), size(a.k), size(a.n), ptr(g.data_ptr()),
                                                    ptr(grads.data_ptr()))
        ref = p @ w
        same_bits = torch.equal(chunked(), ref)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for f in variants.values():
            f()  # warm: pages touched, library loaded
        for _ in range(a.repeats):
            for name, f in variants.items():
                t0 = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t0)
    gb = a.k * a.n * 4 / 1e9
    print(f"stack: K={a.k} x N={a.n:,} float32 = {gb:.2f} GB; torch threads {torch.get_num_threads()}; "
          f"median of {a.repeats}; C kernel: {'built' if lib is not None else 'no compiler, skipped'}")
    print(f"{'variant':<18} {'median s':>9} {'GB/s':>7} {'/ sum':>7}")
    base = statistics.median(times["sum"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<18} {m:9.3f} {gb / m:7.2f} {m / base:7.2f}")
    print(f"chunked product has the same bits as the whole one: {same_bits}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
