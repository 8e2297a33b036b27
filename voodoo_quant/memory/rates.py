"""The time model's probe: how fast this machine runs the operations a run is made of, now.

A few seconds of measurements (:func:`probe`), each timed best of two after a warm-up (the
compensation walk: once after its warm-up), on matrices small enough to stay cheap and shaped so
that the rate per weight or per flop does not depend on their size:

* **quantization**: libggml-base's quantizer on one thread (as each ``VOODOO_QUANT_WORKERS``
  process runs it, ``candidates/precache.py``), per type, on a 128 × 512 float32 matrix with an
  imatrix vector, and without one for the types that can do without (weights/s): the K-quants
  search their scales against the vector (Q5_K 5.1 against 10.8 Mw/s without, on the 1.5B
  model's head rows), and llama-imatrix records no vector for the embedding or the output head. The matrix is seeded Student-t (5 degrees of freedom): the IQ
  searches' time depends on the values, and on the 1.5B model's own q/gate/down rows the rates of
  the default menu's types were within the probe's run-to-run scatter of Student-t's, where
  Gaussian rows were up to 1.5× slower for Q5_K (measured side by side on the 2-core machine);
* **the workers together**: the same quantization split over `workers` threads, against one: what
  `workers` processes get out of this machine as it is loaded now (1.0 when another job holds the
  other cores);
* **dequantization** per type, one thread (the sensitivity pass and the student build read every
  candidate back through libggml-base's ``to_float``);
* **error compensation** (``--error_compensation gptq``) per type: the walk that gives W'
  (``candidates/compensate.compensated``, the run's sweep and damping) on 32 × 512 and
  128 × 512 matrices with a seeded Hessian, its factor computed beforehand. The two sizes separate
  the seconds per weight from the seconds per 32-column step (Python's share, which the real
  tensors' 256 to 151,936 rows amortize); the walk's product ``rows · n²`` (float32, one thread)
  is taken out of both first, priced at the one-thread GEMM rate below;
* **float32 GEMM** at the model's widths: a [128, hidden] × [hidden, intermediate] product on
  torch's threads (the forward passes) and a [256, 256] × [256, 2048] one on one thread (the
  compensation walk's products);
* **the Cholesky factor**, float64 on one thread, n = 1024 (flop/s; on this machine the rate was
  flat within ±30 % from n = 1024 to 8,960, the down projection's width);
* **sha256** and **memory copy** bandwidth (bytes/s), for the hashes and copies of every weight a
  run makes.

Four grid types are not quantized by the probe: libggml-base sets up their grids once per process
(``ggml_quantize_init``: 23 s for IQ1_S and IQ1_M, 10 s for IQ2_S, measured here under load;
docs/facts.md), longer than the whole probe may take. Their quantization and walk are priced from
IQ2_XXS's, probed, by the ratios of :data:`DERIVED`, measured side by side with this module's own
functions (``bench/time_model.py constants``); their dequantization needs no grid setup and is
probed on random blocks. Every other type is probed itself: the K-quants, IQ4_XS and IQ4_NL need
no grid, and IQ2_XXS, IQ3_XXS and IQ3_S set theirs up in 2.5, 0.4 and 0.6 s
(``bench/results/time_model_constants.json``, ``GRID_SETUP_S``).

What the probe cannot measure in seconds (a disk, a stock tool) is a constant of
:mod:`.timing`, stated there with where it was measured.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch

from ..candidates import compensate, compensation_walk
from ..core import envs, ggml
from ..core import qtypes as qt
from ..quants.random_blocks import random_blocks

PROBE_N = 512  # columns of the probe matrices: two 256-superblocks, sixteen 32-blocks
PROBE_ROWS = 128
COMP_ROWS = (16, 128)  # the compensation probe's two sizes
CHOL_N = 1024
_SEED = 0
BASE = "IQ2_XXS"  # the probed grid type the DERIVED ones are priced from
# Seconds per weight of a type ÷ IQ2_XXS's, plain ("plain") and in the compensation walk of each
# sweep (the walk's seconds per weight beyond its GEMM), on one thread: the median of 3 runs of
# ``bench/time_model.py constants --only derived`` (CPU seconds; this module's quant_rates and
# compensation_rates on all seven grid types, side by side; bench/results/time_model_constants.json),
# 2026-12-07, the 2-core machine with the benchmark on both cores (an earlier run's figures differed
# by up to ±30 %). Under "ruled" IQ1_M is walked per step (compensation_walk.RULED_SWEEP); under
# "packed" IQ2_XS is walked as under "ruled" (compensation_walk.PACKED_RULED) and IQ1_M per step,
# against IQ2_XXS's probe walk, hence their "packed" ratios.
DERIVED: dict[str, dict[str, float]] = {
    "IQ2_XS": {"plain": 1.96, "ruled": 1.90, "fixed": 1.83, "packed": 3.25, "requant": 2.01},
    "IQ2_S": {"plain": 0.51, "ruled": 0.69, "fixed": 0.44, "packed": 0.47, "requant": 0.55},
    "IQ1_S": {"plain": 0.32, "ruled": 0.60, "fixed": 0.34, "packed": 0.23, "requant": 0.34},
    "IQ1_M": {"plain": 0.31, "ruled": 2.01, "fixed": 0.33, "packed": 2.63, "requant": 0.41},
}


@dataclass(frozen=True)
class Rates:
    """What :func:`probe` measured (or a test injected). Rates are per second."""

    quant: dict[str, float]  # type -> weights/s, one thread, plain, with an imatrix vector
    dequant: dict[str, float]  # type -> weights/s, one thread
    bare: dict[str, float] = field(default_factory=dict)  # type -> weights/s without an imatrix vector
    comp_weight: dict[str, float] = field(default_factory=dict)  # type -> s per weight of the walk, one thread
    comp_step: dict[str, float] = field(default_factory=dict)  # type -> s per 32-column step of the walk
    gemm: float = 1e10  # float32 flop/s on torch's threads, at the model's widths
    gemm1: float = 1e10  # float32 flop/s on one thread
    chol: float = 1e9  # float64 flop/s of a Cholesky factor, one thread
    parallel: float = 1.0  # throughput of `workers` quantizer threads ÷ one thread's
    sha256: float = 1e9  # bytes/s
    copy: float = 5e9  # bytes/s
    curvature: float = 1e-8  # s per weight per rung of the sensitivity pass's curvature products
    threads: int = 1  # torch's threads (the forward passes)
    workers: int = 1  # VOODOO_QUANT_WORKERS
    derived: tuple[str, ...] = ()  # the types priced from IQ2_XXS by DERIVED, not probed
    written: tuple[str, ...] = ()  # the types whose compensated bytes the walk writes (no quantization after it)
    seconds: float = 0.0  # what the probe took

    def quant_rate(self, qtype: str, imatrix: bool = True) -> float:
        """Weights/s of `qtype` on one thread, with an imatrix vector or without (the K-quants
        search their scales against it: Q5_K half as fast with one)."""
        t = qt.get(qtype).name
        return self.quant[t] if imatrix or t not in self.bare else self.bare[t]

    def dequant_rate(self, qtype: str) -> float:
        return self.dequant[qt.get(qtype).name]


def _best(fn: Callable[[], object], reps: int = 2) -> float:
    fn()  # warm-up: first-call costs (IQ grids, page faults, thread pools)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def probe_matrix(rows: int, n: int = PROBE_N, seed: int = _SEED) -> np.ndarray:
    """The probe's weights: seeded Student-t (5 degrees of freedom) × 0.02 (module docstring)."""
    rng = np.random.default_rng(seed)
    return np.ascontiguousarray(rng.standard_t(5, (rows, n)) * 0.02, dtype=np.float32)


def _imatrix(n: int) -> np.ndarray:
    return (np.random.default_rng(_SEED + 1).random(n) + 0.1).astype(np.float32)


def _hessian(n: int) -> np.ndarray:
    x = np.random.default_rng(_SEED + 2).standard_normal((4 * n, n)).astype(np.float32)
    x *= np.linspace(0.2, 2.0, n, dtype=np.float32)  # uneven columns, as real inputs are
    return np.ascontiguousarray(x.T @ x)


def gemm_rate(m: int, k: int, n: int, threads: int | None = None) -> float:
    """float32 flop/s of an [m, k] × [k, n] product (on `threads`, default torch's)."""
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(m, k), torch.randn(k, n)
        return 2.0 * m * k * n / _best(lambda: a @ b)
    finally:
        torch.set_num_threads(old)


def chol_rate(n: int = CHOL_N) -> float:
    """float64 flop/s (n³/3) of a Cholesky factor on one thread."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.from_numpy(_hessian(n).astype(np.float64)) / n + torch.eye(n, dtype=torch.float64)
        return n ** 3 / 3.0 / _best(lambda: torch.linalg.cholesky_ex(g))
    finally:
        torch.set_num_threads(old)


def curvature_rate(k: int) -> float:
    """Seconds per weight per rung of ``training/fisher.curvature``'s inner loop at `k` rungs (the
    rungs' errors of a 1M chunk scaled by √F, cast to float64, their K × K products: memory
    traffic per rung, the products a small share), on torch's threads."""
    k = max(1, k)
    n = 1 << 20
    w, sf = torch.randn(n), torch.rand(n)
    qs = [torch.randn(n) for _ in range(k)]

    def run():
        c = torch.stack([(q - w) * sf for q in qs]).double()
        return c @ c.t()
    return _best(run) / (n * k)


def quant_rates(types: Iterable[str], lib=None, *, imatrix: bool = True) -> dict[str, float]:
    """type -> weights/s quantized on one thread (each type's grids set up by the warm-up), with an
    imatrix vector, or without one (`imatrix` False: the types that need one are left out)."""
    lib = lib or ggml.lib()
    w = probe_matrix(PROBE_ROWS)
    vec = _imatrix(PROBE_N) if imatrix else None
    out = {}
    for t in sorted({qt.get(t).name for t in types}):
        if not imatrix and qt.get(t).needs_imatrix:
            continue
        v = None if qt.get(t).is_float else vec
        out[t] = w.size / _best(lambda: lib.quantize(w, t, v, workers=1))
    return out


def dequant_rates(types: Iterable[str], lib=None) -> dict[str, float]:
    """type -> weights/s dequantized on one thread, from random valid blocks (no grid setup)."""
    lib = lib or ggml.lib()
    out = {}
    for t in sorted({qt.get(t).name for t in types}):
        q = qt.get(t)
        n_blocks = PROBE_ROWS * PROBE_N // q.block
        data = random_blocks(q, n_blocks, np.random.default_rng(_SEED)).tobytes()
        shape = (PROBE_ROWS, PROBE_N)
        out[t] = PROBE_ROWS * PROBE_N / _best(lambda: lib.dequantize(data, t, shape))
    return out


def parallel_speedup(qtype: str, workers: int, lib=None) -> float:
    """Throughput of `workers` threads quantizing together ÷ one thread's (libggml-base splits the
    rows; cffi releases the GIL): at most `workers`, less when other jobs hold cores."""
    if workers <= 1:
        return 1.0
    lib = lib or ggml.lib()
    w = probe_matrix(16 * 4 * workers)
    v = None if qt.get(qtype).is_float else _imatrix(PROBE_N)
    one = _best(lambda: lib.quantize(w, qtype, v, workers=1))
    many = _best(lambda: lib.quantize(w, qtype, v, workers=workers))
    return max(1.0, min(float(workers), one / many))


def compensation_rates(types: Iterable[str], sweep: str, damp: float, gemm1: float, lib=None
                       ) -> tuple[dict[str, float], dict[str, float]]:
    """(type -> s per weight, type -> s per 32-column step) of the compensation walk on one
    thread, its ``rows · n²`` product taken out at `gemm1` flop/s (module docstring)."""
    lib = lib or ggml.lib()
    vec = _imatrix(PROBE_N)
    comp = compensate.Compensation(_hessian(PROBE_N), float(damp), sweep)
    old = torch.get_num_threads()
    per_weight, per_step = {}, {}
    try:
        comp.factor()  # computed once, kept: the walk alone is timed
        steps = PROBE_N / compensation_walk.STEP
        for t in sorted({qt.get(t).name for t in types}):
            if not compensate.applies(t):
                per_weight[t], per_step[t] = 0.0, 0.0
                continue
            secs = []
            for rows in COMP_ROWS:
                w = probe_matrix(rows, seed=_SEED + rows)
                s = _best(lambda: compensate.compensated(w, t, vec, comp, lib), reps=1)
                secs.append(max(0.0, s - rows * PROBE_N ** 2 / gemm1))
            (r0, r1), (s0, s1) = COMP_ROWS, secs
            a = max(0.0, (s1 - s0) / ((r1 - r0) * PROBE_N))
            per_weight[t] = a
            per_step[t] = max(0.0, s0 - a * r0 * PROBE_N) / steps
    finally:
        compensate.release_factors()
        torch.set_num_threads(old)
    return per_weight, per_step


def byte_rates() -> tuple[float, float]:
    """(sha256 bytes/s, memory copy bytes/s) on 32 MB."""
    buf = np.random.default_rng(_SEED).integers(0, 255, 32 << 20, dtype=np.uint8)
    out = np.empty_like(buf)
    sha = buf.nbytes / _best(lambda: hashlib.sha256(memoryview(buf)).digest())
    cp = buf.nbytes / _best(lambda: np.copyto(out, buf))
    return sha, cp


def probe(types: Iterable[str], *, hidden: int, intermediate: int, compensation: str | None = None,
          sweep: str = "packed", damp: float = 0.1, workers: int | None = None, rungs: int = 1, lib=None,
          plain: Iterable[str] = ()) -> Rates:
    """Measure this machine's rates for a run whose menus hold `types` (`rungs`: the most a tensor
    has), whose model is `hidden` wide with MLPs `intermediate` wide; `compensation` (the run's
    resolved ``--error_compensation``; None or "none": no walk probed), `sweep` and `damp` its
    settings. `plain`: types of `types` no candidate is compensated in (the guarantee's off-menu
    types), whose walk is not probed."""
    t0 = time.perf_counter()
    lib = lib or ggml.lib()
    types = sorted({qt.get(t).name for t in types})
    walk = set(types) - {qt.get(t).name for t in plain}
    derived = tuple(t for t in types if t in DERIVED)
    direct = sorted({t for t in types if t not in DERIVED} | ({BASE} if derived else set()))
    workers = workers or envs.quant_workers()
    q = quant_rates(direct, lib)
    bare = quant_rates(direct, lib, imatrix=False)  # tensors no imatrix covers (llama-imatrix skips the head)
    quantized = [t for t in direct if not qt.get(t).is_float]
    slowest = min(quantized, key=lambda t: q[t]) if quantized else direct[0]
    par = parallel_speedup(slowest, workers, lib)
    gemm = gemm_rate(128, hidden, intermediate)
    gemm1 = gemm_rate(256, 256, 2048, threads=1)
    chol = chol_rate()
    cw: dict[str, float] = {}
    cs: dict[str, float] = {}
    walked = sorted({t for t in direct if t in walk} | ({BASE} if walk & set(derived) else set()))
    if compensation and compensation != "none" and walked:
        cw, cs = compensation_rates(walked, sweep, damp, gemm1, lib)
    for t in derived:  # priced from IQ2_XXS's (module docstring)
        q[t] = q[BASE] / DERIVED[t]["plain"]
        if BASE in cw and t in walk:
            cw[t], cs[t] = cw[BASE] * DERIVED[t][sweep], cs[BASE]
    for t in set(direct) - set(types):  # probed only to price the derived ones
        q.pop(t)
        bare.pop(t, None)
    for t in set(cw) - walk:
        cw.pop(t)
        cs.pop(t)
    sha, cp = byte_rates()
    written = tuple(sorted(t for t in cw if compensate.writes_bytes(sweep, t)))
    return Rates(quant=q, dequant=dequant_rates(types, lib), bare=bare, comp_weight=cw, comp_step=cs, gemm=gemm, gemm1=gemm1,
                 written=written,
                 chol=chol, parallel=par, sha256=sha, copy=cp, curvature=curvature_rate(rungs),
                 threads=torch.get_num_threads(), workers=workers, derived=derived,
                 seconds=time.perf_counter() - t0)
