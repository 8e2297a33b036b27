"""What a compensated candidate costs against a plain one, per type, and where the time goes.

One process, one thread, side by side: for a (rows × n) GGUF-layout matrix with a random SPD
Hessian from correlated random activations (X scaled per column, H = XᵀX) and the matching imatrix
vector, each type is quantized plain (one libggml-base call) and compensated with the "requant"
sweep (the quantizer again at every 32-column step, float64) and the "fixed" sweep (a superblock
quantized once, later steps rounded with its scales in torch, float32). Printed per type: seconds,
compensated ÷ plain, the seconds spent inside libggml-base during the walk (quantize + dequantize),
seconds per 1e9 weights on one core, and the layer objective of the file's bytes tr(E H Eᵀ) with
E = W − Ŵ, each sweep's over plain's. The factor of each sweep is timed once per matrix (it is
shared by a tensor's types and by the tensors that read the same input).

Variants of the "fixed" sweep for the grid IQ types (compensation_walk.GRID_STEPS, GRID_HOLD): a sweep
named ``fixed-rR`` quantizes a grid superblock again every R-th 32-column step and rounds the steps
between with the last quantization's scales; ``fixed-kK`` quantizes it at its first K steps only
(the last 8 − K steps rounded with the K-th quantization's scales); a trailing ``h`` also writes the
rounded values into W'; ``fixed-pP`` walks each grid superblock P times, each pass rounding with
libggml-base's values for what the previous pass left (GRID_PASSES), ``fixed-pPt`` with those
values' scales and the torch rounding (GRID_PASS_ROUND); ``fixed-pack`` rounds each step by
libggml-base's quantization of a probe: the step's 32 columns of 8 rows side by side as one
256-wide row (compensation_walk.PACKED: every grid type; ``fixed-packmax``: rows divided by their largest
32-column RMS, not the superblock's RMS); ``fixed-step`` quantizes every grid superblock
again at each step (PACKED empty). Every variant but ``fixed-pack`` empties PACKED. ``fixed`` is
the sweep as the product runs it. A sweep name ending in ``-requant`` (``packed-requant``) has
the superblock types' bytes quantized by libggml-base again from W' instead of written by the
walk (compensation_walk.WRITE_CODES off); ``packed-probe`` rounds no grid type by the proxy
(compensation_walk.PACKED_PROXY empty), ``packed-before`` neither writes nor takes the proxy;
``-noheld`` (``packed-noheld``) has the proxy's held IQ3_XXS levels quantized again instead of
written (compensation_walk.WRITE_HELD off).

    .venv/bin/python bench/compensation_cost.py --shape 1536x1536 --shape 256x8960
    .venv/bin/python bench/compensation_cost.py --shape 1536x1536 --types Q4_K,IQ2_S --sweeps fixed
    .venv/bin/python bench/compensation_cost.py --types IQ3_S,IQ2_S --sweeps fixed-r1,fixed-r2,fixed-r4,fixed-r8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GRID = ("IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
MENU = ("Q8_0", "Q5_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ3_S", "IQ2_S", "IQ2_XXS", "IQ1_S")


_CLOCK = [time.perf_counter]


def _clock() -> float:
    """The benchmark's clock: wall seconds, or with --cpu_time the process's CPU seconds (one
    thread: the walk's own time, whatever else runs beside it)."""
    return _CLOCK[0]()


class _Timed:
    """libggml-base's quantize/dequantize with the seconds spent in them counted."""

    def __init__(self, lib):
        self.lib, self.seconds = lib, 0.0

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def quantize(self, *a, **k):
        t = _clock()
        try:
            return self.lib.quantize(*a, **k)
        finally:
            self.seconds += _clock() - t

    def dequantize(self, *a, **k):
        t = _clock()
        try:
            return self.lib.dequantize(*a, **k)
        finally:
            self.seconds += _clock() - t


def problem(rows: int, n: int, seed: int = 0, row_spread: float = 0.0):
    rng = np.random.default_rng(seed)
    X = (rng.normal(size=(2 * n, n)) * np.exp(rng.normal(0, 0.7, n))).astype(np.float32)
    mix = rng.normal(size=(n, n)).astype(np.float32) * 0.3 / np.sqrt(n)
    X = X + X @ mix  # correlated columns: something for the walk to pass the error on to
    H = (X.T @ X).astype(np.float32)
    vec = (X ** 2).mean(0).astype(np.float32)
    W = rng.normal(0, 0.02, (rows, n)).astype(np.float32)
    if row_spread:  # rows of uneven norm, as a real tensor's are
        W *= np.exp(rng.normal(0, row_spread, (rows, 1))).astype(np.float32)
    return W, H, vec


def variant(sweep: str) -> tuple[str, dict]:
    """(the product's sweep name, the compensation_walk module's settings for it) of `sweep`."""
    if sweep == "fixed-pack":
        return "fixed", {"PACKED": frozenset(GRID)}
    if sweep == "fixed-packmax":  # the probe's rows divided by their largest 32-column RMS
        return "fixed", {"PACKED": frozenset(GRID), "PACK_NORM": "max"}
    if sweep == "fixed-step":
        return "fixed", {"PACKED": frozenset()}
    if sweep.endswith("-requant"):  # the superblock types' bytes quantized again from W', not written by the walk
        return sweep[:-len("-requant")], {"WRITE_CODES": False}
    if sweep.endswith("-noheld"):  # the proxy's held levels quantized again from W', not written by the walk
        return sweep[:-len("-noheld")], {"WRITE_HELD": False}
    if sweep == "packed-probe":  # no grid type rounded by the proxy
        return "packed", {"PACKED_PROXY": frozenset()}
    if sweep == "packed-before":  # the packed sweep before either: every byte requantized, no proxy
        return "packed", {"WRITE_CODES": False, "PACKED_PROXY": frozenset()}
    if not sweep.startswith(("fixed-r", "fixed-k", "fixed-p")):
        return sweep, {}
    kind, arg = sweep[len("fixed-")], sweep[len("fixed-") + 1:]
    flag = arg.endswith(("h", "t"))
    k = int(arg.rstrip("ht"))
    if kind == "p":
        return "fixed", {"GRID_PASSES": k, "GRID_PASS_ROUND": flag, "PACKED": frozenset()}
    steps = range(0, 8, k) if kind == "r" else range(k)
    return "fixed", {"GRID_STEPS": frozenset(steps), "GRID_HOLD": flag, "PACKED": frozenset()}


def main() -> None:
    import torch

    from voodoo_quant.candidates import compensate, compensation_walk
    from voodoo_quant.core import ggml
    from voodoo_quant.candidates.compensate import Compensation

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", help="ROWSxN (GGUF layout); repeatable", default=None)
    ap.add_argument("--types", default=",".join(MENU))
    ap.add_argument("--sweeps", default="requant,fixed")
    ap.add_argument("--seed", type=int, default=0, help="the random problem's seed")
    ap.add_argument("--row_spread", type=float, default=0.0, help="rows scaled by exp(N(0, this))")
    ap.add_argument("--cpu_time", action="store_true",
                    help="time in the process's CPU seconds (for runs beside other work), not wall seconds")
    a = ap.parse_args()
    if a.cpu_time:
        _CLOCK[0] = time.process_time
    torch.set_num_threads(1)
    lib = ggml.lib()
    sweeps = a.sweeps.split(",")
    for shape in a.shape or ["1536x1536"]:
        rows, n = (int(x) for x in shape.split("x"))
        W, H, vec = problem(rows, n, a.seed, a.row_spread)
        H64 = H.astype(np.float64)
        comps = {}
        for sw in sweeps:
            base_sweep = variant(sw)[0]
            if any(variant(o)[0] == base_sweep for o in comps):
                comps[sw] = next(c for o, c in comps.items() if variant(o)[0] == base_sweep)
                continue
            compensate.release_factors()
            comps[sw] = Compensation(H, sweep=base_sweep)
            t = _clock()
            comps[sw].factor()
            print(f"# {rows} x {n}: factor of the {base_sweep} sweep {_clock() - t:.2f} s", flush=True)
        print(f"{'type':8} {'plain s':>8} {'s/1e9w':>8} " + " ".join(
            f"{sw + ' s':>10} {'÷plain':>7} {'in ggml':>8} {'s/1e9w':>8} {'obj÷plain':>9}" for sw in sweeps), flush=True)

        def objective(m: np.ndarray, q: str) -> float:
            deq = lib.dequantize(lib.quantize(m, q, vec, name="bench", workers=1), q, m.shape, name="bench")
            e = (W - deq).astype(np.float64)
            return float(np.sum((e @ H64) * e))

        for q in a.types.split(","):
            if n % lib.block_size(q):
                continue
            lib.quantize(W[:1], q, vec, name="warm", workers=1)  # IQ grids initialized outside the timings
            t = _clock()
            lib.quantize(W, q, vec, name="bench", workers=1)
            plain = _clock() - t
            base = objective(W, q)
            cells = []
            for sw in sweeps:
                compensate._FACTORS[comps[sw].digest] = comps[sw].factor()  # kept: the walk alone is timed
                timed = _Timed(lib)
                settings = variant(sw)[1]
                saved = {k: getattr(compensation_walk, k) for k in settings}
                for k, v in settings.items():
                    setattr(compensation_walk, k, v)
                t = _clock()
                try:
                    m, data = compensate.compensated(W, q, vec, comps[sw], timed)
                finally:
                    for k, v in saved.items():
                        setattr(compensation_walk, k, v)
                if data is None:  # the candidate's bytes: libggml-base's quantization of W'
                    data = lib.quantize(m, q, vec, name="bench", workers=1)
                dt = _clock() - t
                deq = lib.dequantize(data, q, m.shape, name="bench")
                e = (W - deq).astype(np.float64)
                obj = float(np.sum((e @ H64) * e))
                cells.append(f"{dt:10.2f} {dt / plain:7.2f} {timed.seconds:8.2f} {dt / W.size * 1e9:8.0f} {obj / base:9.3f}")
            print(f"{q:8} {plain:8.3f} {plain / W.size * 1e9:8.0f} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
